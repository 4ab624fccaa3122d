"""Padding-free packed micro-batches: the token-budget plan, the packed row, the per-device defaults, and the
gradient of a packed step equal to the padded step's in float64 for every loss type, with and without shared
prompts."""

from __future__ import annotations

import dataclasses
from typing import get_args

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from services.learner.data.batch import TrainBatch
from services.learner.logprobs.packing import (
    attention_implementation,
    check_attention,
    pack,
    plan_micro_batches,
    resolve_share_prompts,
    resolve_token_budget,
    sequence_lengths,
)
from services.learner.logprobs.policy import completion_logprobs_and_entropy
from services.learner.model import load_policy
from services.learner.trainer import Trainer
from shared.config.learner import LearnerSettings
from tests.support.tiny_model import build_tiny_llama
from tests.unit.test_learner_core import _batch, _groups, _settings, assert_grads_close

LOSS_TYPES = get_args(LearnerSettings.model_fields["loss_type"].annotation)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "m", seed=3)


def _rms_norm_in_input_dtype(self: LlamaRMSNorm, hidden: torch.Tensor) -> torch.Tensor:
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))


@pytest.fixture(autouse=True)
def float64_norms(monkeypatch):
    """transformers' RMSNorm computes in float32 whatever its input (a float64 input too), so a shared prompt's
    gradient, the sum of its completions' gradients, rounds to float32 differently when the completions are
    split differently (~1e-7). The same norm in the input's dtype makes float64 mean float64 throughout."""
    monkeypatch.setattr(LlamaRMSNorm, "forward", _rms_norm_in_input_dtype)


def _plan(prompts, completions, groups, **bounds) -> list[tuple[int, int]]:
    return [(s.start, s.stop) for s in plan_micro_batches(prompts, completions, groups, **bounds)]


def test_plan_fills_micro_batches_up_to_the_token_budget_in_order():
    prompts, completions, groups = [4, 4, 4, 6, 6], [3, 5, 2, 9, 1], [0, 0, 0, 1, 1]
    # Sequences of 7, 9, 6, 15, 7 tokens.
    assert _plan(prompts, completions, groups, max_tokens=16, max_rows=8, share_prompts=False) == [
        (0, 2),
        (2, 3),
        (3, 4),
        (4, 5),
    ]
    # Shared: a group's prompt counts once per micro-batch: 4+3+5+2 = 14, then 6+9+1 = 16.
    assert _plan(prompts, completions, groups, max_tokens=16, max_rows=8, share_prompts=True) == [(0, 3), (3, 5)]
    # The row bound still holds.
    assert _plan(prompts, completions, groups, max_tokens=100, max_rows=2, share_prompts=True) == [
        (0, 2),
        (2, 4),
        (4, 5),
    ]


def test_plan_gives_a_sequence_longer_than_the_budget_a_micro_batch_alone():
    assert _plan([5, 5, 5], [1, 20, 1], [0, 1, 2], max_tokens=10, max_rows=4, share_prompts=False) == [
        (0, 1),
        (1, 2),
        (2, 3),
    ]
    with pytest.raises(ValueError, match="must be at least 1"):
        plan_micro_batches([1], [1], [0], max_tokens=0, max_rows=1, share_prompts=False)


def test_share_prompts_is_on_for_the_cpu_and_off_for_cuda_and_under_torchrun():
    assert resolve_share_prompts("auto", "cpu", distributed=False) is True
    assert resolve_share_prompts("auto", "cuda", distributed=False) is False
    assert resolve_share_prompts("on", "cuda", distributed=False) is True
    assert resolve_share_prompts("off", "cpu", distributed=False) is False
    assert resolve_share_prompts("on", "cpu", distributed=True) is False
    with pytest.raises(ValueError, match="'auto', 'on' or 'off'"):
        resolve_share_prompts("yes", "cpu", distributed=False)


def test_token_budget_auto_is_the_padded_worst_case_and_zero_turns_packing_off():
    assert resolve_token_budget("auto", "cpu", rows=8, sequence_tokens=768) == 8 * 768
    assert resolve_token_budget("auto", "cuda", rows=8, sequence_tokens=1280, attention="flash_attention_2") == 8 * 1280
    assert resolve_token_budget("auto", "cuda", rows=8, sequence_tokens=1280, attention="sdpa") == 0
    assert resolve_token_budget("auto", "cuda", rows=8, sequence_tokens=1280) == 0
    assert resolve_token_budget(4096, "cuda", rows=8, sequence_tokens=1280, attention="sdpa") == 4096
    assert resolve_token_budget(0, "cuda", rows=8, sequence_tokens=1280) == 0
    assert resolve_token_budget(4096, "cpu", rows=8, sequence_tokens=1280) == 4096
    with pytest.raises(ValueError, match="'auto' or a count"):
        resolve_token_budget(-1, "cpu", rows=8, sequence_tokens=10)


def test_flash_attention_is_chosen_only_for_cuda_and_refused_with_a_shared_prompt_mask():
    assert attention_implementation("cpu") is None
    check_attention("sdpa", share_prompts=True)
    check_attention("flash_attention_2", share_prompts=False)
    with pytest.raises(ValueError, match=r"set learner\.share_prompts = 'off'"):
        check_attention("flash_attention_2", share_prompts=True)


def _toy_batch() -> TrainBatch:
    """Two completions of one group (prompt [11, 12]) and one of another (prompt [21]); pad 0."""
    input_ids = torch.tensor([[0, 11, 12, 31, 32, 0], [0, 11, 12, 41, 0, 0], [0, 0, 21, 51, 52, 53]])
    attention = (input_ids != 0).long()
    completion_ids = input_ids[:, 3:]
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention,
        position_ids=(attention.cumsum(1) - 1).clamp(min=0),
        completion_ids=completion_ids,
        completion_mask=(completion_ids != 0).float(),
        behaviour_logprobs=torch.zeros(3, 3),
        advantages=torch.zeros(3),
        temperatures=torch.ones(3),
        policy_versions=torch.zeros(3, dtype=torch.long),
        group_index=torch.tensor([0, 0, 1]),
        truncated=torch.zeros(3, dtype=torch.bool),
    )


def test_packed_row_without_shared_prompts_is_each_sequence_from_position_zero():
    batch = _toy_batch()
    assert sequence_lengths(batch) == ([2, 2, 1], [2, 1, 3])
    row = pack(batch, share_prompts=False)
    assert row.input_ids.tolist() == [[11, 12, 31, 32, 11, 12, 41, 21, 51, 52, 53]]
    assert row.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3]]
    assert row.attention is None
    # Position 1 (the prompt's last token) predicts completion token 0, and so on; 0 past a completion's end.
    assert row.predictors.tolist() == [[1, 2, 0], [5, 0, 0], [7, 8, 9]]


def test_packed_row_with_shared_prompts_has_each_prompt_once_and_a_tree_mask():
    row = pack(_toy_batch(), share_prompts=True)
    assert row.input_ids.tolist() == [[11, 12, 31, 32, 41, 21, 51, 52, 53]]
    assert row.position_ids.tolist() == [[0, 1, 2, 3, 2, 0, 1, 2, 3]]
    assert row.predictors.tolist() == [[1, 2, 0], [1, 0, 0], [5, 6, 7]]
    assert row.attention is not None
    # Completion token 41 (position 4) sees the prompt and itself, not the other completion (31, 32).
    assert row.attention[4].tolist() == [True, True, False, False, True, False, False, False, False]
    # The second group sees nothing of the first; it is causal inside.
    assert row.attention[7].tolist() == [False] * 5 + [True, True, True, False]


@pytest.mark.parametrize("share_prompts", [False, True])
@pytest.mark.parametrize("chunk_tokens", [0, 3])
def test_packed_forward_equals_the_padded_forward_in_float64(tiny, share_prompts, chunk_tokens):
    model, _ = load_policy(_settings(tiny), str(tiny))
    model.double()
    batch = _batch(_groups(model, seed=9))
    batch.temperatures = torch.linspace(0.6, 1.4, batch.size)
    results = []
    for packed in (False, True):
        model.zero_grad()
        logprobs, entropies = completion_logprobs_and_entropy(
            model, batch, share_prompts=share_prompts, entropy="grad", chunk_tokens=chunk_tokens, packed=packed
        )
        weights = torch.linspace(-1.0, 1.0, logprobs.numel(), dtype=logprobs.dtype).reshape(logprobs.shape)
        assert entropies is not None
        ((logprobs * weights).sum() + (entropies * weights.flip(0)).sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append((logprobs.detach(), entropies.detach(), grads))
    (padded_lp, padded_h, padded_grads), (packed_lp, packed_h, packed_grads) = results
    torch.testing.assert_close(packed_lp, padded_lp, atol=1e-12, rtol=0)
    torch.testing.assert_close(packed_h, padded_h, atol=1e-12, rtol=0)
    assert torch.all(packed_lp[batch.completion_mask == 0] == 0)
    assert_grads_close(packed_grads, padded_grads, rel=1e-10)


def _step_gradient(tiny, budget: int, share: str, **overrides) -> tuple[dict, Trainer]:
    """One step's accumulated gradient in float64 (importance weights from shifted behaviour logprobs, old
    logprobs shifted so that the ratios are off 1 and clipping acts)."""
    settings = _settings(
        tiny, max_tokens_per_micro_batch=budget, share_prompts=share, beta=0.0, max_staleness=0, **overrides
    )
    model, _ = load_policy(settings, str(tiny))
    model.double()
    batch = _batch(_groups(model, seed=5))
    shift = torch.linspace(-0.4, 0.4, batch.behaviour_logprobs.numel()).reshape(batch.behaviour_logprobs.shape)
    batch.behaviour_logprobs.add_(shift.flip(0) * batch.completion_mask)
    trainer = Trainer(model, settings)
    prepared = trainer.prepare(batch)
    assert prepared.old_logprobs is not None
    old = prepared.old_logprobs + shift.double() * batch.completion_mask
    prepared = dataclasses.replace(prepared, old_logprobs=old)
    model.zero_grad()
    trainer.accumulate_gradients(batch, prepared)
    return {n: p.grad.clone() for n, p in model.named_parameters()}, trainer


@pytest.mark.parametrize("share", ["on", "off"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_packed_step_gradient_equals_the_padded_step_gradient_in_float64(tiny, loss_type, share):
    """Packed micro-batches of the padded ones' rows, and (but for kl_cov, which ranks tokens within a
    micro-batch as verl does) packed micro-batches split by a small token budget: the same gradient."""
    padded, trainer = _step_gradient(tiny, 0, share, loss_type=loss_type)
    assert not trainer.planner.packed and trainer.planner.share_prompts is (share == "on")
    same_rows, trainer = _step_gradient(tiny, 10_000, share, loss_type=loss_type)
    assert trainer.planner.packed
    assert_grads_close(same_rows, padded, rel=1e-10)
    if loss_type != "kl_cov":
        by_tokens, trainer = _step_gradient(tiny, 25, share, loss_type=loss_type)
        assert trainer.planner.token_budget == 25
        assert_grads_close(by_tokens, padded, rel=1e-10)


def test_packed_step_with_entropy_terms_and_a_token_split_equals_the_padded_step(tiny):
    overrides = dict(loss_type="grpo", entropy_coef=0.05, top_entropy_quantile=0.5, micro_batch_size=4)
    padded, _ = _step_gradient(tiny, 0, "on", **overrides)
    packed, trainer = _step_gradient(tiny, 30, "on", **overrides)
    assert len(trainer.planner.plan(_batch(_groups(trainer.model, seed=5)))[1]) > 2  # the budget, not the rows, splits
    assert_grads_close(packed, padded, rel=1e-10)
