"""Import smoke test of the generator's GPU path against the installed vLLM: every ``vllm`` module and name
that services/generator and weight_sync import (found by parsing the sources, so a new import is covered at once) must
exist. A vLLM that lacks one (the GPU image once had vLLM 0.11, without ``model_loader.reload``) fails here
instead of at the first weight push. Run it inside an image to check that image's vLLM."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
SOURCES = (ROOT / "services" / "generator", ROOT / "weight_sync")  # the engine, and the worker extension


def vllm_imports() -> list[tuple[str, str | None, str]]:
    """(module, name or None, where) for every vLLM import in services/generator and weight_sync, lazy ones
    included."""
    found = []
    for path in [path for folder in SOURCES for path in sorted(folder.glob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            where = f"{path.parent.name}/{path.name}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm":
                found += [(node.module, alias.name, where) for alias in node.names]
            elif isinstance(node, ast.Import):
                found += [(a.name, None, where) for a in node.names if a.name.split(".")[0] == "vllm"]
    return found


def test_the_generator_imports_vllm_somewhere():
    modules = {module for module, _, _ in vllm_imports()}
    # The receiver's and the engine's entry points: if parsing missed these, the test below proves nothing.
    assert {"vllm.model_executor.model_loader.reload", "vllm.v1.engine.async_llm"} <= modules


@pytest.mark.parametrize(("module", "name", "where"), vllm_imports(), ids=lambda v: str(v))
def test_every_vllm_import_of_the_generator_resolves(module, name, where):
    imported = importlib.import_module(module)
    if name is not None:
        assert hasattr(imported, name) or importlib.util.find_spec(f"{module}.{name}"), (
            f"{where}: {module} has no {name} in the installed vLLM"
        )


def test_the_vllm_api_the_generator_calls_exists():
    """Beyond imports: the methods, keyword arguments and fields the engine and receiver use."""
    import dataclasses
    import inspect

    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.v1.engine.async_llm import AsyncLLM

    def params(fn) -> set[str]:
        return set(inspect.signature(fn).parameters)

    assert {"mode", "clear_cache"} <= params(AsyncLLM.pause_generation)
    from vllm.v1.engine.core_client import AsyncMPClient  # AsyncLLM.engine_core: the weight update pauses with it

    assert {"mode", "clear_cache"} <= params(AsyncMPClient.pause_scheduler_async)
    assert "reset_running_requests" in params(AsyncLLM.reset_prefix_cache)
    assert {"method", "args"} <= params(AsyncLLM.collective_rpc) and hasattr(AsyncLLM, "resume_generation")
    assert {"logprobs_mode", "worker_extension_cls", "gpu_memory_utilization"} <= {
        f.name for f in dataclasses.fields(AsyncEngineArgs)
    }
    assert {"rank", "world_size", "store"} <= {f.name for f in dataclasses.fields(StatelessProcessGroup)}
    assert {"group", "device"} <= params(PyNcclCommunicator.__init__)
    assert {"tensor", "src", "stream"} <= params(PyNcclCommunicator.broadcast)
    # The direct loader accepts these quantization methods by class name; a rename must fail here.
    from weight_sync.direct_load import _PLAIN_METHODS

    assert {UnquantizedLinearMethod.__name__, UnquantizedEmbeddingMethod.__name__} == _PLAIN_METHODS
    assert hasattr(UnquantizedLinearMethod, "process_weights_after_loading")
