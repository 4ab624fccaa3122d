"""The learner's batch, logprobs and step on a tiny Llama: padding is invisible, and a learner step equals
the synchronous GRPO step computed directly on the batch."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from services.learner.data.batch import collate
from services.learner.data.collector import drop_reason
from services.learner.logprobs.policy import completion_logprobs, logprobs_no_grad
from services.learner.model import load_policy
from services.learner.objective.loss import BatchNormalisers, LossInputs, compute_loss
from services.learner.optimizer import lr_lambda
from services.learner.trainer import Trainer
from shared.advantages import group_advantages
from shared.config.learner import LearnerSettings
from shared.config.objective import Objective
from shared.records import Completion, PromptTask, Rollout, RolloutTimings, SamplingSpec, ScoredGroup
from tests.support.factories import make_scored, make_trajectory_rollout
from tests.support.tiny_model import build_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "m", seed=3)


def _settings(model_path, **overrides) -> LearnerSettings:
    fields = dict(
        model=str(model_path),
        compute_dtype="float32",  # "equal" below means float32/float64 arithmetic, also on a bf16-capable CPU
        group_size=4,
        groups_per_step=2,
        micro_batch_size=2,
        lr=1e-3,
        max_completion_length=12,
        max_steps=10,
        api_token="t",
    )
    fields.update(overrides)
    return LearnerSettings(**fields)


def _groups(model, temperature=0.8, seed=0) -> list[ScoredGroup]:
    """Two groups with prompts and completions of different lengths; behaviour logprobs from the model."""
    rng = np.random.default_rng(seed)
    groups = []
    for g, prompt_len in enumerate((5, 9)):
        task = PromptTask(prompt="x", group_size=4, policy_version=0, sampling=SamplingSpec(temperature=temperature))
        prompt = rng.integers(5, 90, size=prompt_len).astype(np.int32)
        completions = []
        for i in range(4):
            ids = rng.integers(5, 90, size=3 + 2 * i + g).astype(np.int32)
            with torch.no_grad():
                full = torch.tensor([list(prompt) + list(ids)])
                logits = model(full).logits[0, prompt_len - 1 : -1].float() / temperature
                lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids, dtype=torch.long)[:, None])[:, 0]
            completions.append(Completion(text="", token_ids=ids, behaviour_logprobs=lp.numpy(), finish_reason="stop"))
        rollout = Rollout(
            group_id=task.task_id,
            task=task,
            prompt_token_ids=prompt,
            completions=tuple(completions),
            policy_version=0,
            finished_policy_version=0,
            generator_id="g",
            timings=RolloutTimings(received_at=0, started_at=0, finished_at=0),
        )
        rewards = rng.random(4).astype(np.float32)
        groups.append(
            ScoredGroup(
                rollout=rollout,
                reward_names=("r",),
                rewards_per_func=rewards[:, None],
                rewards=rewards,
                advantages=group_advantages(rewards, 4),
            )
        )
    return groups


def assert_grads_close(ours: dict, theirs: dict, rel: float) -> None:
    """Max |difference| within ``rel`` of the largest gradient entry, per parameter. (In float64 the padded
    and the prompt-sharing forwards agree to about 1e-7 relative: attention's softmax runs in float32.)"""
    for name, grad in theirs.items():
        scale = float(grad.abs().max())
        assert float((ours[name] - grad).abs().max()) <= rel * scale + 1e-12, name


def _batch(groups):
    return collate(groups, [torch.from_numpy(g.advantages.copy()) for g in groups], pad_id=4)


def test_padded_batch_logprobs_equal_unpadded_per_sequence(tiny):
    settings = _settings(tiny)
    model, _ = load_policy(settings, str(tiny))
    groups = _groups(model)
    batch = _batch(groups)
    got = logprobs_no_grad(model, batch, micro_batch_size=3)
    row = 0
    for group in groups:
        for completion in group.rollout.completions:
            n = len(completion.token_ids)
            np.testing.assert_allclose(got[row, :n].numpy(), completion.behaviour_logprobs, atol=1e-5)
            assert torch.all(got[row, n:] == 0)
            row += 1


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_learner_step_gradient_equals_direct_synchronous_grpo_gradient(tiny, loss_type):
    settings = _settings(tiny, loss_type=loss_type, max_staleness=0)
    model, _ = load_policy(settings, str(tiny))
    model.double()  # float64 so that "equal" can mean equal to 1e-8, not float32 rounding
    groups = _groups(model)
    batch = _batch(groups)
    trainer = Trainer(model, settings)
    prepared = trainer.prepare(batch)
    assert prepared.importance_weights is not None and prepared.old_logprobs is not None
    # Behaviour logprobs came from these weights: every importance weight is 1.
    torch.testing.assert_close(prepared.importance_weights, torch.ones_like(prepared.old_logprobs), atol=1e-5, rtol=0)
    model.zero_grad()
    trainer.accumulate_gradients(batch, prepared)
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}

    # The same objective computed directly on the whole batch, in one piece.
    config = Objective(loss_type=loss_type, max_completion_length=12)
    counts = BatchNormalisers(num_items_in_batch=batch.completion_mask.sum())
    model.zero_grad()
    logprobs = completion_logprobs(model, batch)
    weights = prepared.importance_weights
    inputs = LossInputs(
        logprobs, logprobs.detach(), batch.advantages, batch.completion_mask, importance_weights=weights
    )
    compute_loss(inputs, config, counts).loss.backward()
    direct = {n: p.grad.clone() for n, p in model.named_parameters()}
    # TRL's on-policy step: no importance weights (they are 1 up to the float32 behaviour logprobs).
    model.zero_grad()
    logprobs = completion_logprobs(model, batch)
    inputs = LossInputs(logprobs, logprobs.detach(), batch.advantages, batch.completion_mask)
    compute_loss(inputs, config, counts).loss.backward()
    assert_grads_close(ours, direct, rel=1e-6)
    assert_grads_close(ours, {n: p.grad for n, p in model.named_parameters()}, rel=1e-5)


def test_train_takes_num_iterations_steps_and_changes_the_weights(tiny):
    settings = _settings(tiny, num_iterations=2, warmup_steps=1)
    model, _ = load_policy(settings, str(tiny))
    batch = _batch(_groups(model))
    before = model.lm_head.weight.detach().clone()
    trainer = Trainer(model, settings)
    results = trainer.train(batch)
    assert len(results) == 2 and trainer.step == 2
    assert not torch.equal(before, model.lm_head.weight)
    assert results[0]["clip_ratio/region_mean"] == 0.0  # first iteration is on-policy
    assert {"loss", "grad_norm", "learning_rate", "sampling/importance_sampling_ratio/mean"} <= set(results[0])


def test_kl_without_a_reference_model_is_refused_at_construction(tiny):
    settings = _settings(tiny, beta=0.04)
    model, _ = load_policy(settings, str(tiny))
    with pytest.raises(ValueError, match=r"beta = 0.04 needs a reference model: pass reference=.* or set beta = 0"):
        Trainer(model, settings)


def test_lr_schedule_warms_up_then_decays():
    assert lr_lambda(0, 2, 10, 0.1) == 0.5
    assert lr_lambda(1, 2, 10, 0.1) == 1.0
    assert lr_lambda(2, 2, 10, 0.1) == pytest.approx(1.0)
    assert lr_lambda(10, 2, 10, 0.1) == pytest.approx(0.1)


def test_reusing_the_training_forward_gives_the_recomputed_old_logprobs_gradient(tiny):
    grads, prepared, steps = {}, {}, {}
    for mode in ("recompute", "reuse"):
        settings = _settings(tiny, old_logprobs=mode)
        model, _ = load_policy(settings, str(tiny))
        model.double()
        batch = _batch(_groups(model, seed=4))
        trainer = Trainer(model, settings)
        model.zero_grad()
        prepared[mode] = trainer.prepare(batch)
        steps[mode] = trainer.accumulate_gradients(batch, prepared[mode])
        grads[mode] = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert prepared["recompute"].old_logprobs is not None and prepared["reuse"].old_logprobs is None  # no extra pass
    assert prepared["reuse"].importance_weights is None  # the training forward makes them
    torch.testing.assert_close(
        steps["reuse"].importance_weights, prepared["recompute"].importance_weights, atol=1e-9, rtol=0
    )
    torch.testing.assert_close(steps["recompute"].importance_weights, prepared["recompute"].importance_weights)
    assert_grads_close(grads["reuse"], grads["recompute"], rel=1e-6)
    with pytest.raises(ValueError, match="needs num_iterations = 1"):
        _settings(tiny, old_logprobs="reuse", num_iterations=2)


def test_behaviour_old_logprobs_clip_the_ratio_against_the_sampled_logprobs(tiny):
    """``old_logprobs = "behaviour"``: no extra pass, no importance weights, and the gradient of the loss with the
    generator's logprobs as the old ones (the recompute path handed them explicitly), not the reuse gradient."""
    grads, prepared = {}, {}
    for mode in ("recompute", "reuse", "behaviour"):
        model, _ = load_policy(_settings(tiny), str(tiny))
        model.double()
        batch = _batch(_groups(model, seed=4))
        shift = torch.randn(batch.behaviour_logprobs.shape, generator=torch.Generator().manual_seed(0))
        batch = dataclasses.replace(batch, behaviour_logprobs=batch.behaviour_logprobs + 0.3 * shift)  # a stale sampler
        trainer = Trainer(model, _settings(tiny, old_logprobs=mode, epsilon_low=0.05, epsilon_high=0.05))
        model.zero_grad()
        prepared[mode] = trainer.prepare(batch)
        if mode == "recompute":  # the definition: the sampled logprobs as old, no importance weights
            prepared[mode] = dataclasses.replace(
                prepared[mode], old_logprobs=batch.behaviour_logprobs.double(), importance_weights=None
            )
        step = trainer.accumulate_gradients(batch, prepared[mode])
        grads[mode] = {n: p.grad.clone() for n, p in model.named_parameters()}
        if mode == "behaviour":
            assert prepared[mode].old_logprobs is None and step.importance_weights is None
            assert step.metrics["clip_ratio/region_mean"] > 0  # some tokens left the band around the sampled policy
    assert_grads_close(grads["behaviour"], grads["recompute"], rel=1e-9)
    largest = max(float((grads["behaviour"][n] - grads["reuse"][n]).abs().max()) for n in grads["reuse"])
    assert largest > 1e-6  # the old policy differs from the training forward's, so does the gradient
    _settings(tiny, old_logprobs="behaviour", num_iterations=2)  # the old policy stays the sampler's: allowed
    filters = {"top_p": 0.9, "top_k": 20, "min_p": 0.1, "repetition_penalty": 1.1, "min_completion_length": 2}
    for name, value in filters.items():  # the sampler's logprobs would be of another distribution than the learner's
        with pytest.raises(ValidationError, match=f"'behaviour' .* with {name} = {value} they are a filtered"):
            _settings(tiny, old_logprobs="behaviour", **{name: value})
        _settings(tiny, old_logprobs="reuse", **{name: value})  # a capped importance weight there: allowed


def test_shared_prompt_forward_equals_the_padded_forward_values_and_gradients(tiny):
    settings = _settings(tiny)
    model, _ = load_policy(settings, str(tiny))
    model.double()
    batch = _batch(_groups(model, seed=9))
    results = {}
    for share in (True, False):
        model.zero_grad()
        logprobs = completion_logprobs(model, batch, share_prompts=share)
        (logprobs * batch.advantages.double()[:, None]).sum().backward()
        results[share] = (logprobs.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    torch.testing.assert_close(results[True][0], results[False][0], atol=1e-12, rtol=1e-10)
    assert_grads_close(results[True][1], results[False][1], rel=1e-6)
    # Micro-batches that split a group work too.
    split = torch.cat([completion_logprobs(model, mb) for mb in batch.micro_batches(3)])
    torch.testing.assert_close(split.detach(), results[False][0], atol=1e-12, rtol=1e-10)


def test_step_metrics_have_trl_clip_extremes_and_the_sampling_logp_difference(tiny):
    settings = _settings(tiny, num_iterations=2, micro_batch_size=8)  # one micro-batch: extremes = means
    model, _ = load_policy(settings, str(tiny))
    batch = _batch(_groups(model))
    shift = torch.linspace(0.0, 0.7, batch.behaviour_logprobs.numel()).reshape(batch.behaviour_logprobs.shape)
    batch.behaviour_logprobs.sub_(shift * batch.completion_mask)
    mask = batch.completion_mask.bool()
    diff = (batch.behaviour_logprobs - logprobs_no_grad(model, batch, micro_batch_size=3)).abs()[mask]
    results = Trainer(model, settings).train(batch)
    for result in results:
        assert result["clip_ratio/low_min"] == pytest.approx(result["clip_ratio/low_mean"], abs=1e-7)
        assert result["clip_ratio/high_max"] == pytest.approx(result["clip_ratio/high_mean"], abs=1e-7)
        assert result["sampling/sampling_logp_difference/mean"] == pytest.approx(float(diff.mean()), abs=1e-5)
        assert result["sampling/sampling_logp_difference/max"] == pytest.approx(float(diff.max()), abs=1e-5)
    assert results[1]["clip_ratio/region_mean"] > 0  # the second iteration is off-policy: the extremes are not trivial


def test_staleness_drops_a_trajectory_group_by_its_oldest_sampled_version():
    """Sampled tokens of versions 3 and 4 (tool tokens -1): the group is as old as version 3, for the drop
    rule and for each row of the batch; a rollout claiming a newer version than a sampled token is refused."""
    rollout = make_trajectory_rollout()
    assert rollout.policy_version == 3 and rollout.finished_policy_version == 4
    group = make_scored(rollout, num_funcs=1)
    assert drop_reason(group, set(), policy_version=5, max_staleness=2) is None
    assert (
        drop_reason(group, set(), policy_version=6, max_staleness=2) == "stale_dropped"
    )  # its version 4 is only 2 old
    assert _batch([group]).policy_versions.tolist() == [3, 3]
    with pytest.raises(ValidationError, match="trajectory_version"):
        rollout.model_validate({**dict(rollout), "policy_version": 4})


def test_a_per_sample_prompt_is_its_rows_prompt_and_never_shared_with_its_group(tiny):
    """The trainer's step with shared prompts equals the unshared one when one trajectory of a group has a
    prompt of its own (sharing by group would run it on the group's prompt)."""
    grads = {}
    for share in ("on", "off"):
        settings = _settings(tiny, share_prompts=share, max_staleness=0)
        model, _ = load_policy(settings, str(tiny))
        model.double()
        groups = _groups(model, seed=6)
        rollout = groups[1].rollout
        completions = list(rollout.completions)
        completions[1] = completions[1].model_copy(update={"prompt_token_ids": np.array([7, 8, 9], np.int32)})
        groups[1] = groups[1].model_copy(
            update={"rollout": rollout.model_copy(update={"completions": tuple(completions)})}
        )
        batch = _batch(groups)
        assert batch.prompt_index.tolist() == [0, 0, 0, 0, 1, 2, 1, 1]
        trainer = Trainer(model, settings)
        assert trainer.planner.share_prompts is (share == "on")
        model.zero_grad()
        trainer.accumulate_gradients(batch, trainer.prepare(batch))
        grads[share] = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert_grads_close(grads["on"], grads["off"], rel=1e-6)
