"""Advantages against independent float64 references written as plain loops, and hand-worked cases."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats

from shared.advantages import (
    bnpo_advantages,
    bnpo_beta_parameters,
    combine_rewards,
    group_advantages,
    reward_metrics,
    zero_std_groups,
)

TOL = 1e-6


# Independent references: per-element Python loops over float64 numpy values -------------------------------


def ref_mean_std(values, unbiased):
    present = [v for v in values if not math.isnan(v)]
    if not present:
        return math.nan, math.nan
    mean = sum(present) / len(present)
    dof = len(present) - 1 if unbiased else len(present)
    std = math.sqrt(sum((v - mean) ** 2 for v in present) / dof) if dof > 0 else math.nan
    return mean, std


def ref_group_advantages(rewards, g, scale, eps, unbiased):
    out = []
    _, std_batch = ref_mean_std(rewards, unbiased)
    for start in range(0, len(rewards), g):
        group = rewards[start : start + g]
        mean, std = ref_mean_std(group, unbiased)
        present = [v for v in group if not math.isnan(v)]
        no_signal = len(present) < 2 or max(present) == min(present)
        for r in group:
            if math.isnan(r) or no_signal:
                out.append(0.0)
            elif scale == "group":
                out.append((r - mean) / (std + eps))
            elif scale == "batch":
                out.append((r - mean) / (std_batch + eps))
            else:
                out.append(r - mean)
    return np.array(out)


def ref_bnpo(rewards, g, lo, hi):
    s = [(r - lo) / (hi - lo) for r in rewards]
    p = [ref_mean_std(s[i : i + g], True)[0] for i in range(0, len(s), g)]
    present_p = [x for x in p if not math.isnan(x)]
    m, sd = ref_mean_std(present_p, True)
    if math.isnan(sd) or sd == 0:
        a = b = 1.0
    else:
        v = sd * sd
        k = m * (1 - m) / v - 1
        a, b = max(1 + k * m / 3, 1.0), max(1 + k * (1 - m) / 3, 1.0)
    out = []
    for q, pq in enumerate(p):
        if math.isnan(pq):
            out.extend([0.0] * g)
            continue
        pdf = stats.beta(a, b).pdf(pq)
        weight = min(1 / pdf, 1e6) if pdf > 0 else 1e6
        out.extend(0.0 if math.isnan(x) else weight * (x - pq) for x in s[q * g : (q + 1) * g])
    return np.array(out)


def random_rewards(rng, groups, g, nan_frac=0.15, discrete=False):
    if discrete:
        rewards = rng.integers(0, 2, size=groups * g).astype(np.float64)
    else:
        rewards = rng.normal(size=groups * g)
    rewards[rng.random(groups * g) < nan_frac] = np.nan
    # Make one group constant so zero-std handling is exercised.
    rewards[:g] = 0.5 if not discrete else 1.0
    return rewards


# Tests ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("g", range(2, 9))
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("unbiased", [True, False])
def test_group_advantages_match_reference(g, scale, unbiased):
    rng = np.random.default_rng(1000 * g + len(scale) + unbiased)
    rewards = random_rewards(rng, groups=6, g=g)
    got = group_advantages(rewards, g, scale_rewards=scale, std_unbiased=unbiased)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, ref_group_advantages(rewards, g, scale, 1e-4, unbiased), atol=TOL)


def test_hand_worked_group_of_four():
    rewards = np.array([3.9, 0.9, 0.7, 0.1], dtype=np.float64)
    # mean 1.4; unbiased std sqrt(8.68/3) = 1.70098...; population std sqrt(8.68/4) = 1.47309...
    expected_unbiased = [1.4696544776800355, -0.29393089553600704, -0.41150325375040997, -0.7642203283936184]
    expected_population = [1.69699538370231, -0.33939907674046194, -0.4751587074366468, -0.8824375995252011]
    got = group_advantages(rewards, 4, std_unbiased=True)
    np.testing.assert_allclose(got, expected_unbiased, atol=1e-12)
    got = group_advantages(rewards, 4, std_unbiased=False)
    np.testing.assert_allclose(got, expected_population, atol=1e-12)
    np.testing.assert_allclose(group_advantages(rewards, 4, scale_rewards="none"), [2.5, -0.5, -0.7, -1.3])


def test_float32_works_and_nan_rows_get_zero():
    rewards = np.array([1.0, float("nan"), 0.0, 1.0], dtype=np.float32)
    got = group_advantages(rewards, 4)
    assert got.dtype == np.float32
    assert got[1] == 0
    assert np.isfinite(got).all()


def test_constant_group_gets_exact_zeros_and_is_counted():
    rewards = np.array([0.1, 0.1, 0.1, 0.1, 0.0, 1.0, 1.0, 0.0], dtype=np.float64)
    got = group_advantages(rewards, 4)
    assert np.array_equal(got[:4], np.zeros(4))
    assert zero_std_groups(rewards, 4).tolist() == [True, False]
    metrics = reward_metrics(rewards, 4)
    assert metrics["frac_reward_zero_std"] == 0.5
    assert metrics["reward"] == pytest.approx(0.3)


def test_bad_shapes_are_rejected():
    with pytest.raises(ValueError, match="multiple of group_size=4"):
        group_advantages(np.zeros(6), 4)
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(np.zeros(4), 4, scale_rewards="grp")  # type: ignore[arg-type]


@pytest.mark.parametrize("g", range(2, 9))
def test_combine_rewards_matches_reference(g):
    rng = np.random.default_rng(g)
    per_func = rng.normal(size=(g * 3, 3))
    per_func[rng.random(per_func.shape) < 0.3] = np.nan
    per_func[0, :] = np.nan
    weights = rng.random(3)
    expected = []
    for row in per_func:
        terms = [w * r for w, r in zip(weights, row, strict=True) if not math.isnan(r)]
        expected.append(sum(terms) if terms else math.nan)
    got = combine_rewards(per_func, weights)
    np.testing.assert_allclose(got, expected, atol=TOL)
    assert math.isnan(got[0])


@pytest.mark.parametrize("g", range(2, 9))
@pytest.mark.parametrize("discrete", [True, False])
def test_bnpo_matches_reference(g, discrete):
    rng = np.random.default_rng(7 * g + discrete)
    if discrete:
        rewards = random_rewards(rng, groups=8, g=g, discrete=True)
        lo, hi = 0.0, 1.0
    else:
        rewards = rng.uniform(-1, 3, size=8 * g)
        rewards[rng.random(8 * g) < 0.1] = np.nan
        lo, hi = -1.0, 3.0
    got = bnpo_advantages(rewards, g, reward_min=lo, reward_max=hi)
    np.testing.assert_allclose(got, ref_bnpo(rewards, g, lo, hi), rtol=1e-6, atol=TOL)


def test_bnpo_single_group_and_zero_variance_use_uniform_beta():
    rewards = np.array([1.0, 0.0, 0.0, 1.0], dtype=np.float64)
    assert bnpo_beta_parameters(np.array([0.5], dtype=np.float64)) == (1.0, 1.0)
    np.testing.assert_allclose(bnpo_advantages(rewards, 4), [0.5, -0.5, -0.5, 0.5])
    same_rates = np.array([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0], dtype=np.float64)
    np.testing.assert_allclose(bnpo_advantages(same_rates, 4), [0.5, -0.5, -0.5, 0.5, -0.5, 0.5, 0.5, -0.5])


def test_bnpo_hand_worked_parameters():
    # p = [0.25, 0.75]: m = 0.5, v = 0.125, k = 0.25/0.125 - 1 = 1, alpha = beta = max(1 + 1/6, 1) = 7/6.
    alpha, beta = bnpo_beta_parameters(np.array([0.25, 0.75], dtype=np.float64))
    assert float(alpha) == pytest.approx(7 / 6) and float(beta) == pytest.approx(7 / 6)


def test_bnpo_rejects_rewards_out_of_bounds():
    with pytest.raises(ValueError, match=r"BNPO needs rewards in \[0.0, 1.0\]"):
        bnpo_advantages(np.array([0.0, 2.0]), 2)


def test_advantages_module_imports_neither_torch_nor_a_service():
    """The scorer and the learner share this maths; it must stay in ``shared``'s light dependencies."""
    code = (
        "import sys, shared.advantages; "
        "assert 'torch' not in sys.modules, 'torch imported'; "
        "assert not [m for m in sys.modules if m.startswith('services')], 'a service imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
