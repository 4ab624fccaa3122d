"""Every policy objective, KL estimator, mask and the entropy bonus against a float64 reference.

The references below are written from the papers' and peers' formulas (TRL 1.16 ``GRPOTrainer._compute_loss``,
verl 0.9 ``core_algos.py``), one sequence and one token at a time, without calling the code under test. Both
the loss value and its gradient with respect to the log-probabilities (torch.autograd) must agree to 1e-6.
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import torch

from services.learner.data.batch import collate
from services.learner.data.collector import SKIPS_REPORTED_EVERY, replacement_cap_reached, skip_report_due
from services.learner.logprobs import entropy as entropy_module
from services.learner.logprobs.policy import completion_logprobs_and_entropy
from services.learner.metrics.batch_metrics import finalize_advantages
from services.learner.model import load_policy, reference_model
from services.learner.objective.loss import (
    BatchNormalisers,
    LossInputs,
    adaptive_entropy_coef,
    compute_loss,
    entropy_threshold,
)
from services.learner.trainer import Trainer
from shared.advantages import compute_advantages
from shared.config.learner import LearnerSettings
from shared.config.objective import Objective
from shared.records import AdvantageSpec
from tests.support.factories import make_rollout, make_scored, make_task
from tests.support.tiny_model import build_tiny_llama

TOL = 1e-6
F64 = torch.float64


def random_batch(seed: int, b: int = 6, t: int = 7) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(seed)
    logprobs = -rng.random((b, t)) * 3
    lengths = rng.integers(1, t + 1, size=b)
    lengths[0], lengths[1] = 0, t  # an empty row and a full one
    return {
        "logprobs": torch.tensor(logprobs, dtype=F64),
        "old": torch.tensor(logprobs + rng.normal(scale=0.3, size=(b, t)), dtype=F64),
        "ref": torch.tensor(logprobs + rng.normal(scale=0.3, size=(b, t)), dtype=F64),
        "behaviour": torch.tensor(logprobs + rng.normal(scale=0.5, size=(b, t)), dtype=F64),
        "advantages": torch.tensor(rng.normal(size=b), dtype=F64),
        "mask": torch.tensor((np.arange(t)[None, :] < lengths[:, None]).astype(np.float64)),
        "weights": torch.tensor(rng.uniform(0.2, 2.0, size=(b, t)), dtype=F64),
        "entropies": torch.tensor(rng.uniform(0.0, 3.0, size=(b, t)), dtype=F64),
        "truncated": torch.tensor(rng.random(b) < 0.3),
    }


def seed_of(*key: object) -> int:
    """A seed that is the same in every process (``hash`` of a str is salted per interpreter)."""
    return zlib.crc32(repr(key).encode())


# The reference -------------------------------------------------------------------------------------------


def ref_kl(lp, ref, name):
    x = lp - ref
    if name == "k1":
        return x
    if name == "abs":
        return torch.abs(x)
    if name == "k2":
        return 0.5 * x * x
    d = ref - lp
    if name == "k3":
        return torch.exp(d) - d - 1
    d = torch.clamp(d, -20.0, 20.0)  # low_var_kl, verl
    return torch.clamp(torch.exp(d) - d - 1, -10.0, 10.0)


def ref_token_terms(i, lp, old, adv, idx, c, w, beh_ok):
    """Per-token objective terms of sequence i (a list of 0-d tensors) and its per-token ratios."""
    a = float(adv[i])
    lr = [lp[i, j] - old[i, j] for j in idx]
    if c["ratio_level"] == "sequence":
        s = torch.exp(sum(lr) / len(lr))
        ratios = [s] * len(idx)
    else:
        ratios = [torch.exp(x) for x in lr]
    kind = c["loss_type"]
    terms = []
    for k, j in enumerate(idx):
        r = ratios[k]
        if kind in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
            r_c = torch.clamp(r, 1 - c["epsilon_low"], 1 + c["epsilon_high"])
            r_u = torch.clamp(r, max=c["delta"]) if c.get("delta") else r
            term = -torch.minimum(r_u * a, r_c * a)
        elif kind == "cispo":
            term = -torch.clamp(r, min=c.get("cispo_clip_min"), max=c["cispo_clip_max"]).detach() * a * lp[i, j]
        elif kind == "sapo":
            tau = c["sapo_temperature_pos"] if a > 0 else c["sapo_temperature_neg"]
            term = -torch.sigmoid(tau * (r - 1)) * (4.0 / tau) * a
        elif kind == "vespo":
            log_w = sum(float(torch.clamp(x.detach(), -20, 20)) for x in lr)
            if w is not None:
                log_w += sum(min(max(math.log(float(w[i, jj])), math.log(1e-8)), 20.0) for jj in idx)
            log_w = min(max(log_w, math.log(1e-8)), 20.0)
            k_, lam = (c["vespo_k_pos"], c["vespo_lambda_pos"]) if a >= 0 else (c["vespo_k_neg"], c["vespo_lambda_neg"])
            phi = math.exp(lam + k_ * log_w - lam * math.exp(log_w))
            term = -phi * a * lp[i, j]
        else:
            raise AssertionError(kind)
        terms.append(term * beh_ok)
    return terms, ratios


def ref_geo_mean(i, lp, old, adv, idx, c, w):
    """GMPO's one loss value per sequence (verl ``compute_policy_loss_geo_mean``)."""
    a = float(adv[i])
    sign = float(np.sign(a))
    total = 0.0
    for j in idx:
        x = lp[i, j] - old[i, j]
        x_c = torch.clamp(x, -c["epsilon_low"], c["epsilon_high"])
        total = total + sign * torch.minimum(sign * x, sign * x_c)
    value = -a * torch.exp(total / (len(idx) + 1e-8))
    if w is not None:
        value = value * math.exp(sum(math.log(float(w[i, j]) + 1e-10) for j in idx) / (len(idx) + 1e-8))
    return value


def ref_kl_cov_selection(lp, adv, active, ratio):
    """verl ``kl_cov``: the top ``ratio`` of active tokens by (A - mean A)(logp - mean logp)."""
    flat = [(i, j) for i in range(lp.shape[0]) for j in range(lp.shape[1]) if active[i][j]]
    a = np.array([float(adv[i]) for i, _ in flat])
    p = np.array([float(lp[i, j].detach()) for i, j in flat])
    cov = (a - a.mean()) * (p - p.mean())
    n = max(1, int(len(flat) * ratio))
    return {flat[k] for k in np.argsort(-cov)[:n]}


def reference_loss(b, c, *, lp):
    """The whole micro-batch loss in float64, from the formulas, one sequence at a time."""
    old, adv, mask = b["old"], b["advantages"], b["mask"]
    w = b["weights"] if c.get("weighted") else None
    n_rows, t = mask.shape
    truncated = b["truncated"] if c.get("truncate") else torch.zeros(n_rows, dtype=torch.bool)
    active = [[bool(mask[i, j]) and not bool(truncated[i]) for j in range(t)] for i in range(n_rows)]
    ent = b["entropies"]
    q = c.get("top_entropy_quantile", 1.0)
    if q < 1.0:
        values = [float(ent[i, j]) for i in range(n_rows) for j in range(t) if active[i][j]]
        threshold = float(np.quantile(np.array(values), 1 - q))
    selected = ref_kl_cov_selection(lp, adv, active, c["kl_cov_ratio"]) if c["loss_type"] == "kl_cov" else set()
    seq_sums, seq_counts, ent_sum, ent_count = [], [], 0.0, 0
    for i in range(n_rows):
        idx = [j for j in range(t) if active[i][j]]
        if not idx:
            seq_sums.append(0.0)
            seq_counts.append(0)
            continue
        beh_ok = 1.0
        if c.get("off_policy_mask_threshold") is not None:
            gap = sum(float(b["behaviour"][i, j] - lp[i, j].detach()) for j in idx) / len(idx)
            beh_ok = 1.0 if (float(adv[i]) >= 0 or gap <= c["off_policy_mask_threshold"]) else 0.0
        if c["loss_type"] == "geo_mean":
            seq_value = ref_geo_mean(i, lp, old, adv, idx, c, w) * beh_ok
            terms, ratios = [seq_value] * len(idx), [torch.exp(lp[i, j] - old[i, j]) for j in idx]
        elif c["loss_type"] == "kl_cov":
            a = float(adv[i])
            terms, ratios = [], []
            for j in idx:
                x = lp[i, j] - old[i, j]
                term = -a * torch.exp(x) + (c["kl_cov_coef"] * torch.abs(x) if (i, j) in selected else 0.0)
                terms.append(term * beh_ok)
                ratios.append(torch.exp(x))
        else:
            terms, ratios = ref_token_terms(i, lp, old, adv, idx, c, w, beh_ok)
        total = 0.0
        for k, j in enumerate(idx):
            term = terms[k]
            acting = q >= 1.0 or float(ent[i, j]) >= threshold
            if not acting:
                term = term * 0.0
            else:
                ent_sum += float(ent[i, j])
                ent_count += 1
            if w is not None and c["loss_type"] not in ("vespo", "geo_mean"):
                term = term * float(w[i, j])
            if c.get("beta", 0.0) > 0:
                kl = ref_kl(lp[i, j], b["ref"][i, j], c["kl_estimator"])
                if c.get("kl_bias_correction"):
                    kl = kl * ratios[k]
                term = term + c["beta"] * kl
            total = total + term
        seq_sums.append(total)
        seq_counts.append(len(idx))
    n_seq = c.get("num_sequences", n_rows)
    agg = c["loss_aggregation"]
    if agg == "grpo":
        loss = sum(s / max(n, 1) for s, n in zip(seq_sums, seq_counts, strict=True)) / n_seq
    elif agg == "bnpo":
        loss = sum(seq_sums) / max(sum(seq_counts), 1)
    elif agg == "dr_grpo":
        loss = sum(seq_sums) / (n_seq * c["max_completion_length"])
    elif agg == "dapo":
        loss = sum(seq_sums) / c["num_items_in_batch"]
    else:  # seq_sum
        loss = sum(seq_sums) / n_seq
    if c.get("entropy_coef", 0.0):
        loss = loss - c["entropy_coef"] * ent_sum / max(ent_count, 1)
    return loss


# The cases -----------------------------------------------------------------------------------------------

PEER_AGGREGATION = {
    "grpo": "grpo",
    "bnpo": "bnpo",
    "dr_grpo": "dr_grpo",
    "dapo": "dapo",
    "luspo": "seq_sum",
    "cispo": "dapo",
    "sapo": "grpo",
    "vespo": "dapo",
    "geo_mean": "grpo",
    "kl_cov": "dapo",
}
OBJECTIVES = [
    ("grpo", "token"),
    ("grpo", "sequence"),  # GSPO
    ("bnpo", "token"),
    ("dr_grpo", "token"),
    ("dapo", "token"),
    ("dapo", "sequence"),
    ("luspo", "sequence"),
    ("cispo", "token"),
    ("cispo", "sequence"),
    ("sapo", "token"),
    ("sapo", "sequence"),
    ("vespo", "token"),
    ("geo_mean", "token"),
    ("kl_cov", "token"),
]
COMBOS = {
    "plain": {},
    "kl_weights_delta": {
        "beta": 0.04,
        "kl_estimator": "k3",
        "kl_bias_correction": True,
        "weighted": True,
        "delta": 1.6,
    },
    "masks_entropy": {
        "beta": 0.1,
        "kl_estimator": "k2",
        "off_policy_mask_threshold": 0.05,
        "top_entropy_quantile": 0.4,
        "entropy_coef": 0.01,
        "truncate": True,
        "weighted": True,
    },
}
BASE = {
    "epsilon_low": 0.2,
    "epsilon_high": 0.28,
    "cispo_clip_max": 1.3,
    "cispo_clip_min": None,
    "sapo_temperature_pos": 1.0,
    "sapo_temperature_neg": 1.05,
    "vespo_k_pos": 2.0,
    "vespo_lambda_pos": 3.0,
    "vespo_k_neg": 3.0,
    "vespo_lambda_neg": 2.0,
    "kl_cov_ratio": 0.2,
    "kl_cov_coef": 1.0,
    "kl_bias_correction": False,
    "max_completion_length": 9,
    "num_items_in_batch": 23.0,
}
CONFIG_KEYS = set(Objective.model_fields)


def ours(b, c, lp, entropies=None):
    config = Objective(**{k: v for k, v in c.items() if k in CONFIG_KEYS})
    inputs = LossInputs(
        logprobs=lp,
        old_logprobs=b["old"],
        advantages=b["advantages"],
        mask=b["mask"],
        ref_logprobs=b["ref"],
        behaviour_logprobs=b["behaviour"],
        importance_weights=b["weights"] if c.get("weighted") else None,
        entropies=b["entropies"] if entropies is None else entropies,
        truncated=b["truncated"] if c.get("truncate") else None,
    )
    batch = BatchNormalisers(num_sequences=c.get("num_sequences"), num_items_in_batch=c["num_items_in_batch"])
    return compute_loss(inputs, config, batch)


def loss_and_grad(fn):
    def run(b):
        lp = b["logprobs"].clone().requires_grad_(True)
        loss = fn(lp)
        value = loss.loss if hasattr(loss, "loss") else loss
        (grad,) = torch.autograd.grad(value, lp)
        return float(value.detach()), grad

    return run


def case_config(loss_type, level, combo):
    c = {**BASE, **COMBOS[combo], "loss_type": loss_type, "ratio_level": level}
    c["loss_aggregation"] = PEER_AGGREGATION[loss_type]
    if level == "sequence":  # sequence ratios sit near 1: a narrow range makes the clipping act
        c.update(epsilon_low=0.03, epsilon_high=0.03, cispo_clip_max=1.02)
    if loss_type not in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        c.pop("delta", None)  # two-sided clipping belongs to the clipped objectives (TRL ignores it elsewhere)
    return c


@pytest.mark.parametrize("combo", sorted(COMBOS))
@pytest.mark.parametrize(("loss_type", "level"), OBJECTIVES)
def test_objective_matches_reference(loss_type, level, combo):
    b = random_batch(seed=seed_of(loss_type, level, combo))
    c = case_config(loss_type, level, combo)
    got_value, got_grad = loss_and_grad(lambda lp: ours(b, c, lp))(b)
    want_value, want_grad = loss_and_grad(lambda lp: reference_loss(b, c, lp=lp))(b)
    assert got_value == pytest.approx(want_value, abs=TOL, rel=TOL)
    torch.testing.assert_close(got_grad, want_grad, atol=TOL, rtol=TOL)
    assert torch.isfinite(got_grad).all()


# Constants away from their defaults, and with fractions float32 cannot hold: a Python float that becomes a
# float32 tensor on its way into a float64 computation is off by ~1e-7 relative, far above 1e-12.
ODD_CONSTANTS = {
    "sapo_temperature_pos": 0.7310000000000001,
    "sapo_temperature_neg": 1.3333333333333333,
    "vespo_k_pos": 1.1,
    "vespo_lambda_pos": 2.3,
    "vespo_k_neg": 0.7,
    "vespo_lambda_neg": 1.9,
}
F64_TOL = 1e-12


@pytest.mark.parametrize("combo", ["plain", "kl_weights_delta", "masks_entropy"])
@pytest.mark.parametrize(("loss_type", "level"), [("sapo", "token"), ("sapo", "sequence"), ("vespo", "token")])
def test_sapo_and_vespo_stay_float64_at_non_default_constants(loss_type, level, combo):
    b = random_batch(seed=seed_of("f64", loss_type, level, combo))
    c = {**case_config(loss_type, level, combo), **ODD_CONSTANTS}
    got_value, got_grad = loss_and_grad(lambda lp: ours(b, c, lp))(b)
    want_value, want_grad = loss_and_grad(lambda lp: reference_loss(b, c, lp=lp))(b)
    assert got_value == pytest.approx(want_value, rel=F64_TOL, abs=1e-15)
    torch.testing.assert_close(got_grad, want_grad, rtol=F64_TOL, atol=1e-15)


@pytest.mark.parametrize("estimator", ["k1", "abs", "k2", "k3", "low_var_kl"])
@pytest.mark.parametrize("bias_correction", [False, True])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_kl_estimators_match_reference(estimator, bias_correction, level):
    b = random_batch(seed=seed_of(estimator, bias_correction, level))
    b["ref"][2, 0] = b["logprobs"][2, 0] + 30.0  # exercises low_var_kl's clamps
    c = {**BASE, "loss_type": "grpo", "loss_aggregation": "grpo", "ratio_level": level, "beta": 0.3}
    c.update(kl_estimator=estimator, kl_bias_correction=bias_correction)
    got_value, got_grad = loss_and_grad(lambda lp: ours(b, c, lp))(b)
    want_value, want_grad = loss_and_grad(lambda lp: reference_loss(b, c, lp=lp))(b)
    assert got_value == pytest.approx(want_value, abs=TOL, rel=TOL)
    torch.testing.assert_close(got_grad, want_grad, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "luspo", "sapo", "geo_mean"])
def test_per_sequence_aggregations_add_up_over_micro_batches(loss_type):
    b = random_batch(seed=31, b=8)
    c = case_config(loss_type, "sequence" if loss_type == "luspo" else "token", "plain")
    whole = ours(b, c, b["logprobs"]).loss
    parts = 0.0
    for rows in (slice(0, 3), slice(3, 8)):
        part = {k: (v[rows] if isinstance(v, torch.Tensor) else v) for k, v in b.items()}
        parts += float(ours(part, {**c, "num_sequences": 8}, part["logprobs"]).loss)
    assert parts == pytest.approx(float(whole), abs=1e-12)


def test_gspo_gradient_equals_verl_token_form():
    """verl's GSPO writes s_it = sg(s_i) pi_t / sg(pi_t) and averages tokens; TRL's exp(mean log r) has the
    same gradient: -A s_i / |y_i| per token (unclipped) under seq-mean-token-mean."""
    b = random_batch(seed=4)
    c = {**case_config("grpo", "sequence", "plain"), "epsilon_low": 10.0, "epsilon_high": 10.0}
    _, got = loss_and_grad(lambda lp: ours(b, c, lp))(b)
    mask, adv = b["mask"], b["advantages"]
    lengths = mask.sum(dim=1).clamp(min=1.0)
    s = torch.exp(((b["logprobs"] - b["old"]) * mask).sum(dim=1) / lengths)
    expected = -(adv * s / lengths / mask.shape[0]).unsqueeze(1) * mask
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-12)


def test_entropy_threshold_is_torch_quantile_and_masks_top_fraction():
    values = torch.tensor(np.random.default_rng(0).uniform(0, 4, size=101), dtype=F64)
    for q in (0.0, 0.2, 0.5, 1.0):
        assert float(entropy_threshold(values, q)) == pytest.approx(float(torch.quantile(values, 1 - q)), abs=1e-12)
    assert int((values >= entropy_threshold(values, 0.2)).sum()) == 21
    assert int((values >= entropy_threshold(values, 0.0)).sum()) == 1  # only the highest-entropy token


def test_entropy_is_logged_and_given_threshold_is_used():
    b = random_batch(seed=9)
    config = Objective(top_entropy_quantile=0.5)
    common = dict(logprobs=b["logprobs"], old_logprobs=b["old"], advantages=b["advantages"], mask=b["mask"])
    out = compute_loss(LossInputs(**common, entropies=b["entropies"]), config, BatchNormalisers(entropy_threshold=1e9))
    assert float(out.loss) == 0.0  # no token reaches the batch-wide threshold: no policy term
    mask = b["mask"]
    assert out.metrics["entropy"] == pytest.approx(float((b["entropies"] * mask).sum() / mask.sum()), abs=1e-12)


def test_entropy_bonus_gradient_reaches_entropies():
    b = random_batch(seed=12)
    entropies = b["entropies"].clone().requires_grad_(True)
    config = Objective(entropy_coef=0.5)
    out = compute_loss(
        LossInputs(b["logprobs"], b["old"], b["advantages"], b["mask"], entropies=entropies),
        config,
        BatchNormalisers(num_entropy_tokens=40.0),
    )
    out.loss.backward()
    torch.testing.assert_close(entropies.grad, -0.5 * b["mask"] / 40.0, atol=1e-12, rtol=0)


def test_adaptive_entropy_controller():
    kw = dict(target=0.2, delta=0.005, coef_min=0.0, coef_max=0.012)
    assert adaptive_entropy_coef(0.0, 0.1, **kw) == pytest.approx(0.005)
    assert adaptive_entropy_coef(0.01, 0.2, **kw) == pytest.approx(0.012)  # capped at coef_max
    assert adaptive_entropy_coef(0.003, 0.5, **kw) == 0.0  # floored at coef_min


def test_truncated_completions_leave_loss_and_counts():
    b = random_batch(seed=14)
    truncated = torch.zeros(6, dtype=torch.bool)
    truncated[1] = True
    config = Objective(loss_type="bnpo")
    got = compute_loss(LossInputs(b["logprobs"], b["old"], b["advantages"], b["mask"], truncated=truncated), config)
    mask = b["mask"].clone()
    mask[1] = 0
    want = compute_loss(LossInputs(b["logprobs"], b["old"], b["advantages"], mask), config)
    assert float(got.loss) == pytest.approx(float(want.loss), abs=1e-12)


def test_config_and_input_errors():
    b = random_batch(seed=2)
    args = (b["logprobs"], b["old"], b["advantages"], b["mask"])
    with pytest.raises(ValueError, match="set ratio_level = 'token'"):
        Objective(loss_type="geo_mean", ratio_level="sequence")
    with pytest.raises(ValueError, match="delta clips the ratio"):
        Objective(loss_type="cispo", delta=2.0)
    with pytest.raises(ValueError, match="kl_estimator"):
        Objective(kl_estimator="k4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="behaviour_logprobs"):
        compute_loss(LossInputs(*args), Objective(off_policy_mask_threshold=0.5))
    with pytest.raises(ValueError, match="entropies"):
        compute_loss(LossInputs(*args), Objective(top_entropy_quantile=0.2))
    with pytest.raises(ValueError, match="num_items_in_batch"):
        compute_loss(LossInputs(*args), Objective(loss_type="cispo"))


# Advantage estimators --------------------------------------------------------------------------------------


def rewards_with_nan(seed, n_groups=4, g=5, n_func=1):
    rng = np.random.default_rng(seed)
    values = rng.normal(size=(n_groups * g, n_func))
    values[3, 0] = np.nan
    values[g : 2 * g, :] = 0.7  # a group whose rewards all agree
    return values


def test_rloo_matches_leave_one_out_reference():
    r = rewards_with_nan(40)[:, 0]
    got = compute_advantages(r, 5, AdvantageSpec(estimator="rloo"))
    for k in range(4):
        block = r[5 * k : 5 * k + 5]
        for i, value in enumerate(block):
            others = [x for j, x in enumerate(block) if j != i and not np.isnan(x)]
            want = 0.0 if np.isnan(value) else value - sum(others) / len(others)
            assert got[5 * k + i] == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("baseline", [False, True])
def test_reinforce_pp_matches_token_whitening_reference(baseline):
    r = rewards_with_nan(41)[:, 0]
    lengths = np.random.default_rng(1).integers(1, 30, size=r.size)
    name = "reinforce_pp_baseline" if baseline else "reinforce_pp"
    spec = AdvantageSpec(estimator=name)
    got = compute_advantages(r, 5, spec, lengths=lengths)
    # verl: the return at every response token is r (gamma 1), whitened over all response tokens.
    tokens, owners = [], []
    for k in range(4):
        block = r[5 * k : 5 * k + 5]
        mean = np.nanmean(block) if baseline else 0.0
        for i in range(5):
            if not np.isnan(block[i]):
                tokens += [block[i] - mean] * int(lengths[5 * k + i])
                owners += [5 * k + i] * int(lengths[5 * k + i])
    tokens = np.array(tokens)
    mu = tokens.sum() / (tokens.size + 1e-8)
    var = ((tokens - mu) ** 2).sum() / (tokens.size + 1e-8) * tokens.size / (tokens.size - 1)
    want = np.zeros_like(r)
    for value, owner in zip((tokens - mu) / np.sqrt(var + 1e-8), owners, strict=True):
        want[owner] = value
    np.testing.assert_allclose(got, want, atol=1e-9)


def test_gdpo_matches_trl_normalize_then_sum_reference():
    per_func = rewards_with_nan(42, n_func=3)
    per_func[7, :] = np.nan  # unscorable
    weights = [1.0, 0.5, 2.0]
    spec = AdvantageSpec(reward_aggregation="normalize_then_sum", reward_weights=tuple(weights))
    got = compute_advantages(np.zeros(20), 5, spec, rewards_per_func=per_func)
    summed = np.full(20, np.nan)
    for row in range(20):
        k = row // 5
        terms = []
        for f in range(3):
            block = per_func[5 * k : 5 * k + 5, f]
            present = block[~np.isnan(block)]
            if np.isnan(per_func[row, f]) or present.size < 2:
                continue
            terms.append(weights[f] * (per_func[row, f] - present.mean()) / (present.std(ddof=1) + 1e-4))
        if terms:
            summed[row] = sum(terms)
    present = summed[~np.isnan(summed)]
    want = np.where(np.isnan(summed), 0.0, (summed - present.mean()) / (present.std(ddof=1) + 1e-4))
    np.testing.assert_allclose(got, want, atol=1e-9)
    with pytest.raises(ValueError, match="rewards_per_func"):
        compute_advantages(np.zeros(20), 5, spec)


def test_new_estimators_need_the_batch():
    assert AdvantageSpec(estimator="reinforce_pp").needs_batch
    assert AdvantageSpec(reward_aggregation="normalize_then_sum").needs_batch
    assert not AdvantageSpec(estimator="rloo").needs_batch


@pytest.mark.parametrize(
    "spec",
    [
        AdvantageSpec(reward_aggregation="normalize_then_sum", reward_weights=(1.0, 0.5)),
        AdvantageSpec(estimator="reinforce_pp_baseline"),
    ],
)
def test_learner_finalises_batch_estimators_over_the_whole_batch(spec):
    """Each group's provisional advantages are redone over the batch: GDPO from rewards_per_func, REINFORCE++
    whitened with the completions' token counts."""
    groups = []
    for k in range(3):
        rollout = make_rollout(make_task(group_size=4), tokens=3 + k, seed=k)
        scored = make_scored(rollout, num_funcs=2)
        per_func = np.random.default_rng(k).normal(size=(4, 2)).astype(np.float32)
        groups.append(
            scored.model_copy(
                update={
                    "rewards_per_func": per_func,
                    "rewards": per_func @ np.array([1.0, 0.5], np.float32),
                    "advantage_spec": spec,
                }
            )
        )
    got = torch.cat(finalize_advantages(groups)).numpy()
    per_func = np.concatenate([g.rewards_per_func for g in groups]).astype(np.float64)
    rewards = np.concatenate([g.rewards for g in groups]).astype(np.float64)
    lengths = np.array([3] * 4 + [4] * 4 + [5] * 4)
    want = compute_advantages(rewards, 4, spec, rewards_per_func=per_func, lengths=lengths)
    np.testing.assert_allclose(got, want, atol=1e-6)
    if spec.estimator == "reinforce_pp_baseline":  # the token counts matter
        assert not np.allclose(got, compute_advantages(rewards, 4, spec), atol=1e-3)


def test_dynamic_sampling_cap():
    assert not replacement_cap_reached(skipped=5, cap=None, collected=1)  # no cap: wait as long as it takes
    assert not replacement_cap_reached(skipped=2, cap=2, collected=3)
    assert replacement_cap_reached(skipped=3, cap=2, collected=3)  # train on the 3 it has
    assert not replacement_cap_reached(skipped=9, cap=2, collected=0)  # never on nothing


def test_a_step_waiting_for_replacements_says_so_every_few_skipped_groups():
    every = SKIPS_REPORTED_EVERY
    assert not skip_report_due(skipped=0, reported=0) and not skip_report_due(skipped=every - 1, reported=0)
    assert skip_report_due(skipped=every, reported=0)
    assert not skip_report_due(skipped=2 * every - 1, reported=every)  # said at `every`: quiet until 2 * every
    assert skip_report_due(skipped=2 * every + 3, reported=every)


# Entropy from the logprob pass -----------------------------------------------------------------------------


def naive_entropy(scaled):
    return -(torch.softmax(scaled, -1) * torch.log_softmax(scaled, -1)).sum(-1)


@pytest.mark.parametrize("contiguous", [True, False])
def test_chunked_entropy_value_and_gradient_match_naive(contiguous, monkeypatch):
    monkeypatch.setattr(entropy_module, "_CHUNK_ELEMENTS", 50)  # several chunks per row
    logits = torch.randn(3, 9, 17, dtype=F64) * 3
    source = logits.clone().requires_grad_(True)
    view = source if contiguous else source[:, 1:]  # a strided slice, as the model's logits[:, :-1]
    got = entropy_module.token_entropy(torch.log_softmax(view, -1))
    want = naive_entropy(view)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    weights = torch.randn_like(want)
    (g_got,) = torch.autograd.grad((got * weights).sum(), source)
    (g_want,) = torch.autograd.grad((want * weights).sum(), source)
    torch.testing.assert_close(g_got, g_want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("temperatures", [None, torch.full((2, 1), 0.7)])
def test_token_stats_keep_one_vocab_sized_tensor_for_backward(temperatures):
    """The log-softmax's output, which its own backward needs; the entropy keeps nothing more of that size."""
    from services.learner.logprobs.lm_head import token_stats

    logits = torch.randn(2, 7, 50, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 50, (2, 6))
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        token_stats(logits[:, :-1], targets, temperatures, "grad")
    big = {t.untyped_storage().data_ptr() for t in saved if t.numel() >= targets.numel() * 50}
    assert len(big) == 1


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "m", seed=5)


def tiny_settings(model_path, **overrides) -> LearnerSettings:
    fields = dict(
        model=str(model_path),
        group_size=4,
        groups_per_step=2,
        micro_batch_size=4,
        lr=1e-3,
        max_completion_length=8,
        max_steps=4,
        api_token="t",
        compute_dtype="float32",  # exact comparisons below; "auto" is bfloat16 on an AMX CPU
    )
    fields.update(overrides)
    return LearnerSettings(**fields)


def tiny_batch(model, seed=0):
    """Two groups of four completions (one cut at max tokens), behaviour logprobs a little off the model's."""
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(2):
        rollout = make_rollout(make_task(group_size=4), tokens=4 + g, seed=seed + g)
        completions = []
        for i, c in enumerate(rollout.completions):
            ids = rng.integers(5, 90, size=3 + i + g).astype(np.int32)
            behaviour = (-rng.random(ids.size) * 4).astype(np.float32)
            completions.append(c.model_copy(update={"token_ids": ids, "behaviour_logprobs": behaviour}))
        rollout = rollout.model_copy(
            update={"completions": tuple(completions), "prompt_token_ids": rng.integers(5, 90, 6).astype(np.int32)}
        )
        rewards = rng.random(4).astype(np.float32)
        scored = make_scored(rollout, num_funcs=1).model_copy(
            update={"rewards_per_func": rewards[:, None], "rewards": rewards, "advantages": rewards - rewards.mean()}
        )
        groups.append(scored)
    return collate(groups, [torch.from_numpy(g.advantages.copy()) for g in groups], pad_id=4)


@pytest.mark.parametrize("share_prompts", [True, False])
def test_policy_entropy_comes_from_the_logprob_pass(tiny, share_prompts):
    model, _ = load_policy(tiny_settings(tiny), str(tiny))
    batch = tiny_batch(model)
    with torch.no_grad():
        _, entropies = completion_logprobs_and_entropy(model, batch, share_prompts=share_prompts)
        for row in range(batch.size):
            n = int(batch.completion_mask[row].sum())
            full = batch.input_ids[row : row + 1, batch.attention_mask[row].bool()]
            logits = model(full).logits[0, -n - 1 : -1].float() / batch.temperatures[row]
            torch.testing.assert_close(entropies[row, :n], naive_entropy(logits), atol=1e-5, rtol=1e-5)
            assert torch.all(entropies[row, n:] == 0)


RUNS = {
    "grpo": {},
    "gspo": {"ratio_level": "sequence"},
    "bnpo": {"loss_type": "bnpo"},
    "dr_grpo": {"loss_type": "dr_grpo"},
    "dapo": {"loss_type": "dapo", "epsilon_high": 0.28},
    "luspo": {"loss_type": "luspo", "ratio_level": "sequence"},
    "cispo": {"loss_type": "cispo", "ratio_level": "sequence", "mask_truncated_completions": True},
    "sapo": {"loss_type": "sapo"},
    # These behaviour logprobs are far off the model's: folded into w they would make phi(w) ~ 0.
    "vespo": {"loss_type": "vespo", "importance_correction": False},
    "geo_mean": {"loss_type": "geo_mean"},
    "kl_cov": {"loss_type": "kl_cov", "kl_cov_ratio": 0.2},
    "kl_entropy_masks": {
        "beta": 0.04,
        "kl_estimator": "low_var_kl",
        "off_policy_mask_threshold": 0.5,
        "top_entropy_quantile": 0.2,
        "adaptive_entropy": True,
        "entropy_coef": 0.01,
        "entropy_target": 100.0,
        "num_iterations": 2,
    },
}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_short_training_run_per_objective_is_finite(tiny, name):
    settings = tiny_settings(tiny, **RUNS[name])
    model, _ = load_policy(settings, str(tiny))
    reference = reference_model(model) if settings.beta > 0 else None
    trainer = Trainer(model, settings, reference=reference)
    before = model.lm_head.weight.detach().clone()
    results = trainer.train(tiny_batch(model, seed=1))
    assert len(results) == settings.num_iterations
    for metrics in results:
        assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"]), metrics
        assert 0.0 < metrics["entropy"] < math.log(model.config.vocab_size) + 1e-6
    assert not torch.equal(before, model.lm_head.weight)
    if settings.adaptive_entropy:  # entropy below the target: the coefficient grows, step by step
        assert [m["entropy_coef"] for m in results] == pytest.approx([0.015, 0.02])


def test_entropy_threshold_is_taken_over_the_whole_batch(tiny):
    settings = tiny_settings(tiny, top_entropy_quantile=0.3, mask_truncated_completions=True, micro_batch_size=2)
    model, _ = load_policy(settings, str(tiny))
    batch = tiny_batch(model, seed=2)
    counts = Trainer(model, settings).prepare(batch).normalisers
    with torch.no_grad():
        _, entropies = completion_logprobs_and_entropy(model, batch)
    keep = batch.completion_mask.bool() & ~batch.truncated.unsqueeze(1)
    expected = torch.quantile(entropies[keep].double(), 0.7)
    assert float(counts.entropy_threshold) == pytest.approx(float(expected), abs=1e-5)
    # The trainer's own forward (packed rows) and this one differ in the last bits: a token that sits on the
    # threshold (several tie there: completions of one prompt share tokens) may fall on either side of it.
    threshold, kept = float(counts.entropy_threshold), entropies[keep].double()
    surely, maybe = int((kept >= threshold + 1e-5).sum()), int((kept >= threshold - 1e-5).sum())
    assert surely <= float(counts.num_entropy_tokens) <= maybe
