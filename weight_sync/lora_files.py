"""A pushed LoRA adapter as the PEFT directory vLLM loads it from: ``adapter_config.json`` and
``adapter_model.safetensors``, written by the generator's engine worker into a directory only its user can read.

vLLM 0.32 loads an adapter only from a path (``LoRARequest`` refuses an empty ``lora_path``), and its worker
loads it again from that path whenever the adapter left its CPU cache (``max_cpu_loras``), so an adapter
put into the worker's manager from memory would be lost at the first eviction. A tmpfs directory costs one
write and one read of the adapter's few megabytes. The learner's half (the config it announces) and the
worker's half (the files) share :func:`peft_config` here, so both name the same rank, alpha and modules.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PRIVATE = 0o700  # the adapter is the policy being trained: no other user reads it


def peft_config(rank: int, alpha: float, target_modules: Sequence[str], base_model: str = "") -> dict:
    """The ``adapter_config.json`` of a plain LoRA adapter (no dropout, no bias, no DoRA/rsLoRA) as PEFT writes
    it and vLLM's ``PEFTHelper`` reads it."""
    if rank < 1:
        raise ValueError(f"LoRA rank {rank}: an adapter push needs learner.lora_rank >= 1")
    if not target_modules:
        raise ValueError("an adapter with no target modules: set learner.lora_target_modules")
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": sorted(target_modules),
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "base_model_name_or_path": base_model,
    }


def adapter_problem(names: Sequence[str]) -> str | None:
    """Why tensors named ``names`` are not a LoRA adapter's (PEFT's ``...lora_A.weight`` / ``...lora_B.weight``
    pairs), or None."""
    if not names:
        return "no tensors"
    stray = [n for n in names if not (n.endswith(".lora_A.weight") or n.endswith(".lora_B.weight"))]
    if stray:
        return f"{len(stray)} tensors are not LoRA A/B weights (first: {stray[0]})"
    a = {n.removesuffix(".lora_A.weight") for n in names if n.endswith(".lora_A.weight")}
    b = {n.removesuffix(".lora_B.weight") for n in names if n.endswith(".lora_B.weight")}
    if a != b:
        return f"unpaired LoRA weights: {sorted(a ^ b)[0]}"
    return None


def write_adapter(directory: Path, tensors: Mapping[str, torch.Tensor], config: Mapping) -> Path:
    """Write the adapter into ``directory`` (made owner-only; refused where it exists already, since an id is
    never loaded twice) and return it."""
    from safetensors.torch import save_file

    if problem := adapter_problem(list(tensors)):
        raise ValueError(f"not a LoRA adapter: {problem}")
    directory.parent.mkdir(mode=_PRIVATE, parents=True, exist_ok=True)
    directory.mkdir(mode=_PRIVATE)
    os.chmod(directory, _PRIVATE)  # mkdir's mode is masked by the umask
    save_file({name: t.detach().contiguous().cpu() for name, t in tensors.items()}, str(directory / WEIGHTS_FILE))
    (directory / CONFIG_FILE).write_text(json.dumps(dict(config), indent=1))
    return directory
