"""The learner on multi-turn trajectories (docs/concepts/multi-turn-design.md §2.10): the loss mask, not the completion
mask, drives the logprobs, the loss, the importance weights and every count; tool and template tokens are
context only; a sample with a prompt of its own never shares another's. Float64 on a tiny Llama."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from services.learner.data.batch import TrainBatch, collate
from services.learner.logprobs.policy import completion_logprobs, completion_logprobs_and_entropy
from services.learner.model import load_policy
from services.learner.objective.importance import importance_weights
from services.learner.objective.loss import BatchNormalisers, LossInputs, compute_loss
from services.learner.trainer import Trainer
from shared.advantages import group_advantages
from shared.config.objective import LOSS_TYPES, Objective
from shared.records import Completion, ScoredGroup
from tests.support.factories import make_masked_completion, make_rollout, make_task
from tests.support.tiny_model import build_tiny_llama
from tests.unit.test_learner_core import _settings, assert_grads_close
from tests.unit.test_packing import _rms_norm_in_input_dtype

TEMPERATURE = 0.8
# (prompt of its own or None, token count, loss mask or None = single-turn) per completion, per group.
LAYOUT = [
    [(None, 4, None), (None, 6, None)],  # single-turn: every token sampled, one shared prompt
    [
        (None, 8, [1, 1, 1, 0, 0, 0, 1, 1]),
        ([7, 8, 9, 10], 5, [1, 1, 0, 0, 1]),  # reset() gave this sample a prompt of its own
        (None, 6, [1, 0, 1, 1, 1, 1]),
    ],
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "m", seed=3)


@pytest.fixture(autouse=True)
def float64_norms(monkeypatch):
    """RMSNorm in its input's dtype: float64 throughout (see tests/unit/test_packing.py)."""
    monkeypatch.setattr(LlamaRMSNorm, "forward", _rms_norm_in_input_dtype)


def _sequence_logprobs(model, prompt: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """[N] log pi(token | prompt ++ earlier tokens), one sequence alone: the reference."""
    with torch.no_grad():
        full = torch.tensor([[*prompt.tolist(), *ids.tolist()]])
        logits = model(full).logits[0, len(prompt) - 1 : -1].double() / TEMPERATURE
        return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids, dtype=torch.long)[:, None])[:, 0].numpy()


def _completion(model, prompt, own_prompt, ids, mask) -> Completion:
    """A completion whose behaviour logprobs are the model's on its sampled tokens."""
    seen = prompt if own_prompt is None else np.asarray(own_prompt, np.int32)
    behaviour = _sequence_logprobs(model, seen, ids).astype(np.float32)
    if mask is None:
        return Completion(text="", token_ids=ids, behaviour_logprobs=behaviour, finish_reason="stop")
    return make_masked_completion(
        ids, mask, behaviour, versions=[3 + (i % 2) for i in range(len(ids))], prompt_token_ids=own_prompt
    )


def _groups(model, seed: int = 0, layout=LAYOUT) -> list[ScoredGroup]:
    """A batch mixing single-turn rows and trajectories with masked spans and a per-sample prompt."""
    rng = np.random.default_rng(seed)
    groups = []
    for g, rows in enumerate(layout):
        prompt = rng.integers(5, 90, size=5 + 2 * g).astype(np.int32)
        completions = tuple(
            _completion(model, prompt, own, rng.integers(5, 90, size=n).astype(np.int32), mask) for own, n, mask in rows
        )
        task = make_task(
            group_size=len(rows),
            policy_version=3,
            sampling=make_task().sampling.model_copy(update={"temperature": TEMPERATURE}),
        )
        rollout = make_rollout(task, prompt_token_ids=prompt, completions=completions, finished_policy_version=4)
        rewards = rng.random(len(rows)).astype(np.float32)
        groups.append(
            ScoredGroup(
                rollout=rollout,
                reward_names=("r",),
                rewards_per_func=rewards[:, None],
                rewards=rewards,
                advantages=group_advantages(rewards, len(rows)),
            )
        )
    return groups


def _batch(groups) -> TrainBatch:
    return collate(groups, [torch.from_numpy(g.advantages.copy()) for g in groups], pad_id=4)


def _model(tiny, **overrides):
    settings = _settings(tiny, max_staleness=10, **overrides)
    model, _ = load_policy(settings, str(tiny))
    return model.double(), settings


def test_collate_builds_the_loss_mask_the_prompt_index_and_the_oldest_sampled_version(tiny):
    model, _ = _model(tiny)
    groups = _groups(model)
    batch = _batch(groups)
    assert batch.completion_mask.sum(1).tolist() == [4, 6, 8, 5, 6]  # every real token
    assert batch.loss_mask.tolist()[:2] == [[1.0] * 4 + [0.0] * 4, [1.0] * 6 + [0.0] * 2]  # single-turn: all
    assert batch.loss_mask[2].tolist() == [1, 1, 1, 0, 0, 0, 1, 1]
    assert batch.loss_mask[3].tolist() == [1, 1, 0, 0, 1, 0, 0, 0]
    assert batch.num_tokens == int(batch.loss_mask.sum()) == 4 + 6 + 5 + 3 + 5
    # One prompt for the single-turn group, one for the trajectories that read the rollout's, one of its own.
    assert batch.prompt_index.tolist() == [0, 0, 1, 2, 1]
    assert batch.group_index.tolist() == [0, 0, 1, 1, 1]
    single_turn = _batch(groups[:1])  # as before trajectories: no second mask, prompts shared by group
    assert single_turn.sampled_mask is None and single_turn.row_prompts is None
    assert single_turn.loss_mask is single_turn.completion_mask
    # The per-sample prompt is that row's input: its own ids, left-padded, then its tokens.
    prompt_end = batch.input_ids.shape[1] - batch.completion_length
    assert batch.input_ids[3, prompt_end - 4 : prompt_end].tolist() == [7, 8, 9, 10]
    assert int(batch.attention_mask[3, :prompt_end].sum()) == 4
    # Sampled tokens carry versions 3 and 4 (context -1): a row's version is its oldest sampled token's.
    assert batch.policy_versions.tolist() == [3, 3, 3, 3, 3]
    late = make_masked_completion([5, 6, 7], [1, 0, 1], versions=[5, 0, 4])
    rollout = make_rollout(make_task(group_size=1, policy_version=3), completions=(late,), finished_policy_version=5)
    zero = np.zeros(1, np.float32)
    scored = groups[1].model_copy(
        update={"rollout": rollout, "rewards": zero, "rewards_per_func": zero[:, None], "advantages": zero}
    )
    assert _batch([scored]).policy_versions.tolist() == [4]  # min over sampled (5, 4), the -1 ignored


def _paths(model, batch, entropy="grad"):
    """Every logprob path: padded, prompt-shared, packed (shared or not), each plain and chunked."""
    out = {}
    for name, kwargs in {
        "padded": dict(share_prompts=False),
        "shared": dict(share_prompts=True),
        "packed": dict(share_prompts=False, packed=True),
        "packed_shared": dict(share_prompts=True, packed=True),
    }.items():
        for chunk in (0, 3):
            model.zero_grad()
            logprobs, entropies = completion_logprobs_and_entropy(
                model, batch, entropy=entropy, chunk_tokens=chunk, **kwargs
            )
            weights = torch.linspace(-1.0, 1.0, logprobs.numel(), dtype=logprobs.dtype, device=logprobs.device)
            weights = weights.reshape(logprobs.shape)
            ((logprobs * weights).sum() + (entropies * weights.flip(0)).sum()).backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            out[f"{name}/chunk{chunk}"] = (logprobs.detach(), entropies.detach(), grads)
    return out


def masked_reference(model, groups, batch) -> torch.Tensor:
    """[B, T] each row's per-sequence reference logprobs at its loss-mask positions, 0 elsewhere (float64)."""
    reference = torch.zeros(batch.completion_ids.shape, dtype=torch.float64)
    row = 0
    for group in groups:
        for c in group.rollout.completions:
            prompt = group.rollout.prompt_token_ids if c.prompt_token_ids is None else c.prompt_token_ids
            reference[row, : len(c.token_ids)] = torch.from_numpy(_sequence_logprobs(model, prompt, c.token_ids))
            row += 1
    return reference * batch.loss_mask.double()


def test_every_logprob_path_equals_the_per_sequence_reference_at_loss_mask_positions_and_0_elsewhere(tiny):
    model, _ = _model(tiny)
    groups = _groups(model, seed=1)
    batch = _batch(groups)
    reference = masked_reference(model, groups, batch)
    results = _paths(model, batch)
    padded_lp, padded_h, padded_grads = results["padded/chunk0"]
    # Left padding moves float32 rounding inside SDPA's softmax (tests/unit/test_learner_core.py): ~1e-7.
    torch.testing.assert_close(padded_lp, reference, atol=2e-6, rtol=0)
    context = batch.loss_mask == 0
    for name, (logprobs, entropies, grads) in results.items():
        torch.testing.assert_close(logprobs, padded_lp, atol=1e-12, rtol=0, msg=name)
        torch.testing.assert_close(entropies, padded_h, atol=1e-12, rtol=0, msg=name)
        assert torch.all(logprobs[context] == 0) and torch.all(entropies[context] == 0), name
        assert_grads_close(grads, padded_grads, rel=1e-9)


def test_a_per_sample_prompt_is_not_shared_by_its_group(tiny):
    """Sharing by group index would give the row with its own prompt the group's prompt: other logprobs."""
    model, _ = _model(tiny)
    batch = _batch(_groups(model, seed=2))
    assert batch.row_prompts is not None
    by_group = dataclasses.replace(batch, row_prompts=None)  # shared by group
    for packed in (False, True):
        right = completion_logprobs(model, batch, share_prompts=True, packed=packed)
        wrong = completion_logprobs(model, by_group, share_prompts=True, packed=packed)
        torch.testing.assert_close(right, completion_logprobs(model, batch, share_prompts=False), atol=1e-12, rtol=0)
        assert not torch.allclose(right[3], wrong[3])


def _perturbed_at_context(batch: TrainBatch, seed: int) -> TrainBatch:
    """``batch`` with other behaviour logprobs and other target ids at its context (loss mask 0) positions."""
    g = torch.Generator().manual_seed(seed)
    context = (batch.completion_mask - batch.loss_mask).bool()
    behaviour = torch.where(context, -3 * torch.rand(batch.loss_mask.shape, generator=g), batch.behaviour_logprobs)
    ids = torch.where(context, torch.randint(5, 90, batch.loss_mask.shape, generator=g), batch.completion_ids)
    return dataclasses.replace(batch, behaviour_logprobs=behaviour, completion_ids=ids)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(loss_type="dapo"),
        dict(loss_type="grpo", importance_level="sequence", beta=0.0),
        dict(loss_type="grpo", ratio_level="sequence", importance_level="sequence", off_policy_mask_threshold=0.1),
        dict(loss_type="bnpo", top_entropy_quantile=0.5, entropy_coef=0.01),
    ],
)
def test_behaviour_logprobs_and_targets_at_context_positions_change_no_number_of_a_step(tiny, overrides):
    """A tool token's own logprob, behaviour logprob and id never enter the step: only its place in the
    context (input_ids, unchanged here) does. Padded micro-batches: there the targets are not the input."""
    settings = _settings(tiny, max_staleness=10, share_prompts="off", max_tokens_per_micro_batch=0, **overrides)
    results = []
    for perturb in (False, True):
        model, _ = load_policy(settings, str(tiny))
        model.double()
        batch = _batch(_groups(model, seed=3))
        batch.behaviour_logprobs.sub_(0.3 * batch.loss_mask * torch.linspace(-1, 1, batch.completion_length))
        if perturb:
            batch = _perturbed_at_context(batch, seed=7)
        trainer = Trainer(model, settings)
        prepared = trainer.prepare(batch)
        model.zero_grad()
        step = trainer.accumulate_gradients(batch, prepared)
        results.append((prepared, step, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (prepared, step, grads), (prepared_p, step_p, grads_p) = results
    torch.testing.assert_close(prepared_p.old_logprobs, prepared.old_logprobs, atol=0, rtol=0)
    torch.testing.assert_close(prepared_p.importance_weights, prepared.importance_weights, atol=0, rtol=0)
    assert step_p.metrics == step.metrics
    assert_grads_close(grads_p, grads, rel=0.0)


def _draw(seed: int, shape: torch.Size) -> dict[str, torch.Tensor]:
    """Logprobs, old, behaviour and reference logprobs (negative) and entropies (positive), [B, T] float64."""
    g = torch.Generator().manual_seed(seed)
    names = ("logprobs", "old_logprobs", "behaviour_logprobs", "ref_logprobs")
    drawn = {name: -2.0 * torch.rand(shape, generator=g, dtype=torch.float64) for name in names}
    return {**drawn, "entropies": torch.rand(shape, generator=g, dtype=torch.float64)}


@pytest.mark.parametrize(
    ("loss_type", "level"), [(t, "token") for t in LOSS_TYPES] + [("grpo", "sequence"), ("dapo", "sequence")]
)
def test_loss_and_gradient_ignore_every_input_at_masked_positions(loss_type, level):
    """Logprobs, old, behaviour and reference logprobs and entropies drawn anew at the masked positions: the
    loss, the metrics, the importance weights of sampled tokens and the gradient are the same, and no gradient
    reaches a masked position."""
    mask = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 0, 1, 0, 0, 1], [1, 1, 1, 1, 1, 0]], dtype=torch.float64)
    config = Objective(
        loss_type=loss_type, beta=0.04, max_completion_length=6, ratio_level=level, off_policy_mask_threshold=0.5
    )
    base = _draw(0, mask.shape)
    outs = []
    for seed in (1, 2):
        fresh = _draw(seed, mask.shape)
        mixed = {name: torch.where(mask.bool(), base[name], fresh[name]) for name in base}
        logprobs = mixed.pop("logprobs").requires_grad_()
        weights = importance_weights(mixed["old_logprobs"], mixed["behaviour_logprobs"], mask, level=level, cap=3.0)
        advantages = torch.tensor([0.7, -1.2, 0.4], dtype=torch.float64)
        inputs = LossInputs(logprobs=logprobs, advantages=advantages, mask=mask, importance_weights=weights, **mixed)
        out = compute_loss(inputs, config, BatchNormalisers.of_batch(mask))
        out.loss.backward()
        outs.append((out, weights, logprobs.grad))
    (out, weights, grad), (out_p, weights_p, grad_p) = outs
    assert float(out_p.loss.detach()) == pytest.approx(float(out.loss.detach()), abs=1e-14)
    assert out_p.metrics == pytest.approx(out.metrics, abs=1e-14)
    torch.testing.assert_close(weights_p[mask.bool()], weights[mask.bool()], atol=1e-14, rtol=0)
    torch.testing.assert_close(grad_p, grad, atol=1e-14, rtol=0)
    assert torch.all(grad[~mask.bool()] == 0)


def test_other_environment_text_moves_the_weights_of_sampled_tokens_only_through_their_context(tiny):
    """Two batches whose tool results differ in text: the learner's logprobs of the tool tokens are 0 in both,
    sampled tokens before the first tool result have equal logprobs, and an importance weight of a sampled
    token is equal in both batches exactly where its logprob is (the context is the only way in)."""
    model, _ = _model(tiny)
    groups = _groups(model, seed=4)
    other = []
    for group in groups:
        completions = []
        for c in group.rollout.completions:
            if c.loss_mask is not None:
                text = np.where(c.loss_mask == 1, c.token_ids, (c.token_ids + 17) % 85 + 5).astype(np.int32)
                c = c.model_copy(update={"token_ids": text})
            completions.append(c)
        other.append(
            group.model_copy(update={"rollout": group.rollout.model_copy(update={"completions": tuple(completions)})})
        )
    a, b = _batch(groups), _batch(other)
    assert torch.equal(a.loss_mask, b.loss_mask) and not torch.equal(a.completion_ids, b.completion_ids)
    old_a = completion_logprobs(model, a, share_prompts=True, packed=True).detach()
    old_b = completion_logprobs(model, b, share_prompts=True, packed=True).detach()
    context = a.loss_mask == 0
    assert torch.all(old_a[context] == 0) and torch.all(old_b[context] == 0)
    first_context = torch.where(context.any(1), context.float().argmax(1), a.completion_length)
    before = (torch.arange(a.completion_length)[None, :] < first_context[:, None]) & a.loss_mask.bool()
    torch.testing.assert_close(old_a[before], old_b[before], atol=1e-12, rtol=0)
    after = a.loss_mask.bool() & ~before
    assert not torch.allclose(old_a[after], old_b[after])  # the context changed them
    weights_a = importance_weights(old_a, a.behaviour_logprobs.double(), a.loss_mask, cap=100.0)
    weights_b = importance_weights(old_b, b.behaviour_logprobs.double(), b.loss_mask, cap=100.0)
    same = a.loss_mask.bool() & torch.isclose(old_a, old_b, atol=1e-12, rtol=0)
    torch.testing.assert_close(weights_a[same], weights_b[same], atol=1e-12, rtol=0)
    assert torch.all(weights_a[context] == 1) and torch.all(weights_b[context] == 1)


def test_every_count_of_a_step_is_the_loss_mask_sum(tiny):
    """Normalisers, the step's token means (the importance ratio, the logp difference, the entropy) are over the
    sampled tokens: with tool tokens in the batch, counting the completion mask would give other numbers."""
    model, settings = _model(tiny, top_entropy_quantile=0.5, num_iterations=1)
    batch = _batch(_groups(model, seed=5))
    shift = 0.2 * torch.linspace(-1, 1, batch.completion_length) * batch.loss_mask
    batch.behaviour_logprobs.sub_(shift)
    tokens = float(batch.loss_mask.sum())
    assert tokens < float(batch.completion_mask.sum())
    trainer = Trainer(model, settings)
    prepared = trainer.prepare(batch)
    counts = prepared.normalisers
    assert counts.num_tokens == counts.num_items_in_batch == tokens and counts.num_sequences == batch.size
    sampled = batch.loss_mask.bool()
    weights = prepared.importance_weights
    old = prepared.old_logprobs
    assert weights is not None and old is not None
    logp = prepared.sampling_metrics["sampling/sampling_logp_difference/mean"]
    assert logp == pytest.approx(float((batch.behaviour_logprobs - old).abs()[sampled].mean()), rel=1e-6)  # float32
    _, entropies = completion_logprobs_and_entropy(model, batch, entropy="value")
    model.zero_grad()
    step = trainer.accumulate_gradients(batch, prepared)
    assert step.metrics["entropy"] == pytest.approx(float(entropies[sampled].mean()), rel=1e-9)
    metrics = trainer._importance_metrics(batch, step.importance_weights)
    assert metrics["sampling/importance_sampling_ratio/mean"] == pytest.approx(float(weights[sampled].mean()))
    assert metrics["sampling/importance_sampling_ratio/min"] == pytest.approx(float(weights[sampled].min()))


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_a_step_gradient_is_the_direct_loss_over_the_loss_mask(tiny, loss_type):
    """The trainer's micro-batched, packed step equals the objective computed directly on the whole batch with
    the loss mask as its mask (and differs from the one over the completion mask)."""
    model, settings = _model(tiny, loss_type=loss_type, micro_batch_size=2)
    batch = _batch(_groups(model, seed=8))
    batch.behaviour_logprobs.sub_(0.3 * batch.loss_mask * torch.linspace(-1, 1, batch.completion_length))
    trainer = Trainer(model, settings)
    prepared = trainer.prepare(batch)
    model.zero_grad()
    trainer.accumulate_gradients(batch, prepared)
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    config = Objective(loss_type=loss_type, max_completion_length=settings.max_completion_length)
    direct = {}
    for name, mask in (("loss", batch.loss_mask), ("completion", batch.completion_mask)):
        model.zero_grad()
        logprobs = completion_logprobs(model, batch)
        inputs = LossInputs(
            logprobs,
            prepared.old_logprobs,
            batch.advantages,
            mask.double(),
            behaviour_logprobs=batch.behaviour_logprobs.double(),
            importance_weights=prepared.importance_weights,
        )
        compute_loss(inputs, config, BatchNormalisers.of_batch(mask)).loss.backward()
        direct[name] = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert_grads_close(ours, direct["loss"], rel=1e-6)
    with pytest.raises(AssertionError):
        assert_grads_close(ours, direct["completion"], rel=1e-3)
