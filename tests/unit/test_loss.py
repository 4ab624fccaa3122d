"""The GRPO loss and importance weights against independent float64 loop references; exact gradients."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from services.learner.data.staleness import is_stale, min_fresh_version, staleness
from services.learner.objective.importance import importance_weight_metrics, importance_weights
from services.learner.objective.loss import BatchNormalisers, LossInputs, aggregate, compute_loss, k3_kl
from shared.config.objective import Objective

TOL = 1e-6


def random_batch(seed, b=5, t=7, dtype=torch.float64):
    rng = np.random.default_rng(seed)
    logprobs = -rng.random((b, t)) * 3
    old = logprobs + rng.normal(scale=0.4, size=(b, t))
    ref = logprobs + rng.normal(scale=0.3, size=(b, t))
    behaviour = old + rng.normal(scale=0.5, size=(b, t))
    advantages = rng.normal(size=b)
    lengths = rng.integers(0, t + 1, size=b)
    lengths[0] = 0  # an empty row
    lengths[1] = t
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float64)
    as_t = lambda x: torch.tensor(x, dtype=dtype)  # noqa: E731
    return {
        k: as_t(v)
        for k, v in dict(
            logprobs=logprobs, old=old, ref=ref, behaviour=behaviour, advantages=advantages, mask=mask
        ).items()
    }


def inputs_of(batch, rows=slice(None), **optional) -> LossInputs:
    """The batch's (rows of) logprobs, old logprobs, advantages and mask, plus ``optional`` inputs."""
    keys = ("logprobs", "old", "advantages", "mask")
    return LossInputs(*(batch[k][rows] for k in keys), **optional)


def ref_loss(batch, loss_type, eps_low, eps_high, delta, beta, weights, max_len, num_items):
    lp, old, ref = batch["logprobs"].numpy(), batch["old"].numpy(), batch["ref"].numpy()
    adv, mask = batch["advantages"].numpy(), batch["mask"].numpy()
    b, t = lp.shape
    per_seq, total, count = [], 0.0, 0.0
    for i in range(b):
        seq_sum, seq_count = 0.0, 0.0
        for j in range(t):
            if mask[i, j] == 0:
                continue
            rho = math.exp(lp[i, j] - old[i, j])
            rho_c = min(max(rho, 1 - eps_low), 1 + eps_high)
            rho_u = min(rho, delta) if delta is not None else rho
            term = -min(rho_u * adv[i], rho_c * adv[i])
            if weights is not None:
                term *= weights[i, j]
            if beta > 0:
                d = ref[i, j] - lp[i, j]
                term += beta * (math.exp(d) - d - 1)
            seq_sum += term
            seq_count += 1
        per_seq.append(seq_sum / max(seq_count, 1))
        total += seq_sum
        count += seq_count
    if loss_type == "grpo":
        return sum(per_seq) / b
    if loss_type == "bnpo":
        return total / max(count, 1)
    if loss_type == "dr_grpo":
        return total / (b * max_len)
    return total / num_items


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("delta", [None, 1.5])
@pytest.mark.parametrize("weighted", [False, True])
def test_policy_loss_matches_reference(loss_type, beta, delta, weighted):
    batch = random_batch(seed=hash((loss_type, beta, delta, weighted)) % 2**32)
    weights = torch.rand_like(batch["logprobs"]) * 2 if weighted else None
    config = Objective(
        loss_type=loss_type,
        epsilon_low=0.2,
        epsilon_high=0.28,
        delta=delta,
        beta=beta,
        kl_bias_correction=False,
        max_completion_length=9,
    )
    inputs = inputs_of(batch, ref_logprobs=batch["ref"], importance_weights=weights)
    out = compute_loss(inputs, config, BatchNormalisers(num_items_in_batch=23.0))
    loss, metrics = out.loss, out.metrics
    expected = ref_loss(batch, loss_type, 0.2, 0.28, delta, beta, None if weights is None else weights.numpy(), 9, 23.0)
    assert loss.dtype == torch.float64
    assert float(loss) == pytest.approx(expected, abs=TOL)
    assert ("kl" in metrics) == (beta > 0)


def test_clip_metrics_match_reference():
    batch = random_batch(seed=3, b=8, t=10)
    metrics = compute_loss(inputs_of(batch), Objective(epsilon_low=0.1, epsilon_high=0.1)).metrics
    lp, old, adv, mask = (batch[k].numpy() for k in ("logprobs", "old", "advantages", "mask"))
    low = high = n = 0
    for i in range(lp.shape[0]):
        for j in range(lp.shape[1]):
            if mask[i, j]:
                rho = math.exp(lp[i, j] - old[i, j])
                low += rho < 0.9 and adv[i] < 0
                high += rho > 1.1 and adv[i] > 0
                n += 1
    assert metrics["clip_ratio/low_mean"] == pytest.approx(low / n, abs=TOL)
    assert metrics["clip_ratio/high_mean"] == pytest.approx(high / n, abs=TOL)
    assert metrics["clip_ratio/region_mean"] == pytest.approx((low + high) / n, abs=TOL)


def test_on_policy_grpo_gradient_is_minus_advantage_over_length_and_batch():
    batch = random_batch(seed=11, b=4, t=6)
    logprobs = batch["logprobs"].clone().requires_grad_(True)
    inputs = LossInputs(logprobs, batch["logprobs"].clone(), batch["advantages"], batch["mask"])
    compute_loss(inputs, Objective()).loss.backward()
    mask, adv = batch["mask"], batch["advantages"]
    lengths = mask.sum(dim=1)
    b = mask.shape[0]
    for i in range(b):
        for j in range(mask.shape[1]):
            expected = -adv[i] / (lengths[i] * b) if mask[i, j] else 0.0
            assert float(logprobs.grad[i, j]) == pytest.approx(float(expected), abs=1e-12)


@pytest.mark.parametrize("loss_type", ["bnpo", "dapo"])
def test_token_mean_over_micro_batches_equals_one_token_mean(loss_type):
    """With the whole batch's counts (what the learner passes), bnpo's and dapo's micro-batch losses add up to
    the token mean of the batch in one piece."""
    batch = random_batch(seed=5, b=6, t=8)
    whole = float(compute_loss(inputs_of(batch), Objective(loss_type="bnpo")).loss)
    splits = (slice(0, 2), slice(2, 6))
    counts = BatchNormalisers.of_batch(batch["mask"])
    config = Objective(loss_type=loss_type)
    parts = sum(float(compute_loss(inputs_of(batch, rows), config, counts).loss) for rows in splits)
    assert parts == pytest.approx(whole, abs=1e-12)
    if loss_type == "bnpo":  # without the counts each micro-batch is its own batch, as in TRL
        own = sum(float(compute_loss(inputs_of(batch, rows), config).loss) for rows in splits)
        assert own != pytest.approx(whole, abs=1e-6)


def test_importance_weights_are_not_differentiated_and_kl_is_not_weighted():
    batch = random_batch(seed=8)
    weights = torch.full_like(batch["logprobs"], 0.0)
    inputs = inputs_of(batch, ref_logprobs=batch["ref"], importance_weights=weights)
    loss = compute_loss(inputs, Objective(loss_type="bnpo", beta=0.5, kl_bias_correction=False)).loss
    kl = k3_kl(batch["logprobs"], batch["ref"])
    expected = float(0.5 * (kl * batch["mask"]).sum() / batch["mask"].sum())
    assert float(loss) == pytest.approx(expected, abs=1e-12)


def test_loss_argument_errors():
    batch = random_batch(seed=1)
    with pytest.raises(ValueError, match="max_completion_length"):  # the settings always give one (ge=1)
        aggregate(batch["logprobs"], batch["mask"], "dr_grpo")
    with pytest.raises(ValueError, match="num_items_in_batch"):
        compute_loss(inputs_of(batch), Objective(loss_type="dapo"))
    with pytest.raises(ValueError, match="ref_logprobs"):
        compute_loss(inputs_of(batch), Objective(beta=0.1))
    with pytest.raises(ValueError, match="loss_type"):
        Objective(loss_type="ppo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="loss_aggregation"):
        Objective(loss_aggregation="token_mean")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="advantages must be"):
        compute_loss(LossInputs(batch["logprobs"], batch["old"], batch["advantages"][:2], batch["mask"]), Objective())


# Importance weights ----------------------------------------------------------------------------------------


def ref_weights(old, behaviour, mask, level, mode, cap, cap_min):
    b, t = old.shape
    out = np.zeros((b, t))
    for i in range(b):
        d = [max(min((old[i, j] - behaviour[i, j]) * mask[i, j], 20.0), -20.0) for j in range(t)]
        seq = math.exp(max(min(sum(d), 20.0), -20.0))
        for j in range(t):
            w = math.exp(d[j]) if level == "token" else seq
            if mode == "truncate":
                w = min(w, cap)
                if cap_min is not None:
                    w = max(w, cap_min)
            else:
                low = -math.inf if cap_min is None else cap_min
                w = w if low <= w <= cap else 0.0
            out[i, j] = w
    return out


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
@pytest.mark.parametrize("cap_min", [None, 0.5])
def test_importance_weights_match_reference(level, mode, cap_min):
    batch = random_batch(seed=21, b=6, t=9)
    batch["behaviour"][2, 0] = batch["old"][2, 0] - 40.0  # exercises the +-20 clamp
    got = importance_weights(
        batch["old"], batch["behaviour"], batch["mask"], level=level, mode=mode, cap=2.0, cap_min=cap_min
    )
    expected = ref_weights(
        batch["old"].numpy(), batch["behaviour"].numpy(), batch["mask"].numpy(), level, mode, 2.0, cap_min
    )
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-9, atol=TOL)
    assert not got.requires_grad


def test_importance_weight_metrics_and_no_grad():
    old = torch.zeros(2, 3, requires_grad=True)
    behaviour = torch.tensor([[0.0, -0.5, 0.0], [0.2, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    weights = importance_weights(old, behaviour, mask)
    assert weights.grad_fn is None
    metrics = importance_weight_metrics(weights, mask)
    assert metrics["sampling/importance_sampling_ratio/max"] == pytest.approx(math.exp(0.5))
    assert metrics["sampling/importance_sampling_ratio/min"] == pytest.approx(math.exp(-0.2))


def test_staleness_rule():
    assert staleness(7, 5) == 2
    assert min_fresh_version(7, 2) == 5
    assert not is_stale(7, 5, max_staleness=2)
    assert is_stale(7, 4, max_staleness=2)
    assert not is_stale(3, 3, max_staleness=0)
    with pytest.raises(ValueError, match="newer"):
        staleness(3, 4)
