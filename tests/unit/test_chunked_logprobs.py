"""Chunked log-probabilities (``logprob_chunk_tokens``) and the no-grad passes under ``torch.inference_mode``.

"Equal" here: the chunked path does the plain path's arithmetic per token (bit for bit given the same logits,
:func:`test_chunks_do_the_plain_paths_arithmetic_bit_for_bit`); the only other difference is that the LM
head's matrix product runs on other row counts, which MKL rounds differently in the last bit of a float64
logit now and then (seen: 7e-15 on logits of size 1), hence the float64 tolerances of 1e-12 below.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.learner.data.batch import TrainBatch, collate
from services.learner.logprobs.lm_head import chunked_token_stats, token_stats
from services.learner.logprobs.policy import completion_logprobs_and_entropy, logprobs_no_grad
from services.learner.model import load_policy, reference_model
from services.learner.trainer import Trainer
from shared.config.learner import LearnerSettings
from shared.records import SamplingSpec
from tests.support.factories import make_rollout, make_scored, make_task
from tests.support.tiny_model import build_tiny_llama

F64 = torch.float64


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "m", seed=11, logit_scale=3.0)


def _settings(model_path, **overrides) -> LearnerSettings:
    fields = dict(
        model=str(model_path),
        compute_dtype="float32",  # float32/float64 arithmetic, also on a bf16-capable CPU
        group_size=3,
        groups_per_step=3,
        micro_batch_size=3,
        lr=1e-3,
        max_completion_length=12,
        api_token="t",
    )
    fields.update(overrides)
    return LearnerSettings(**fields)


def _batch(seed: int = 0) -> TrainBatch:
    """Three groups of three: prompts of 4, 7 and 5 tokens, completions of 1 to 9 tokens, a temperature per row."""
    rng = np.random.default_rng(seed)
    groups = []
    for g, prompt_len in enumerate((4, 7, 5)):
        rollout = make_rollout(make_task(group_size=3), seed=seed + g)
        completions = []
        for i, c in enumerate(rollout.completions):
            ids = rng.integers(5, 90, size=1 + 3 * i + g).astype(np.int32)
            behaviour = (-rng.random(ids.size) * 3).astype(np.float32)
            completions.append(c.model_copy(update={"token_ids": ids, "behaviour_logprobs": behaviour}))
        prompt = rng.integers(5, 90, prompt_len).astype(np.int32)
        rollout = rollout.model_copy(update={"completions": tuple(completions), "prompt_token_ids": prompt})
        rewards = rng.random(3).astype(np.float32)
        groups.append(
            make_scored(rollout, num_funcs=1).model_copy(
                update={"rewards_per_func": rewards[:, None], "rewards": rewards, "advantages": rewards - 0.5}
            )
        )
    batch = collate(groups, [torch.from_numpy(g.advantages.copy()) for g in groups], pad_id=4)
    batch.temperatures = torch.linspace(0.6, 1.4, batch.size)  # a different temperature on every row
    return batch


def _pass(model, batch, *, share_prompts, entropy, chunk_tokens):
    """Log-probabilities, entropies and the parameters' gradients of a weighted sum of both."""
    model.zero_grad()
    logprobs, entropies = completion_logprobs_and_entropy(
        model, batch, share_prompts=share_prompts, entropy=entropy, chunk_tokens=chunk_tokens
    )
    weights = torch.linspace(-1.0, 1.0, logprobs.numel(), dtype=logprobs.dtype).reshape(logprobs.shape)
    loss = (logprobs * weights).sum()
    if entropy == "grad":
        loss = loss + (entropies * weights.flip(0)).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logprobs.detach(), None if entropies is None else entropies.detach(), grads


def _assert_grads_close(ours: dict, theirs: dict, rel: float) -> None:
    """Max |difference| within ``rel`` of the largest gradient entry, per parameter."""
    assert ours.keys() == theirs.keys() and theirs
    for name, grad in theirs.items():
        assert float((ours[name] - grad).abs().max()) <= rel * float(grad.abs().max()) + 1e-15, name


@pytest.mark.parametrize("share_prompts", [True, False])
@pytest.mark.parametrize("entropy", ["none", "value", "grad"])
def test_chunked_logprobs_equal_the_full_logits_in_float64(tiny, share_prompts, entropy):
    model, _ = load_policy(_settings(tiny), str(tiny))
    model.double()
    batch = _batch()
    plain = _pass(model, batch, share_prompts=share_prompts, entropy=entropy, chunk_tokens=0)
    for chunk_tokens in (1, 5):  # one token; chunks across rows and groups
        chunked = _pass(model, batch, share_prompts=share_prompts, entropy=entropy, chunk_tokens=chunk_tokens)
        torch.testing.assert_close(chunked[0], plain[0], atol=1e-12, rtol=0)
        if entropy == "none":
            assert chunked[1] is None
        else:
            torch.testing.assert_close(chunked[1], plain[1], atol=1e-12, rtol=0)
        _assert_grads_close(chunked[2], plain[2], rel=1e-10)
        assert torch.all(chunked[0][batch.completion_mask == 0] == 0)


@pytest.mark.parametrize("share_prompts", [True, False])
def test_chunked_logprobs_equal_the_full_logits_to_float32_rounding(tiny, share_prompts):
    model, _ = load_policy(_settings(tiny), str(tiny))
    batch = _batch(seed=4)
    plain = _pass(model, batch, share_prompts=share_prompts, entropy="grad", chunk_tokens=0)
    chunked = _pass(model, batch, share_prompts=share_prompts, entropy="grad", chunk_tokens=4)
    assert chunked[0].dtype == torch.float32
    torch.testing.assert_close(chunked[0], plain[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked[1], plain[1], atol=1e-5, rtol=1e-5)
    _assert_grads_close(chunked[2], plain[2], rel=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("entropy", ["value", "grad"])
def test_chunks_do_the_plain_paths_arithmetic_bit_for_bit(dtype, entropy):
    """One-hot hidden states make the head's product exact in any order, so only the rest is compared."""
    tokens, vocab = 13, 50
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(tokens, vocab, generator=generator, dtype=dtype) * 3
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    temperatures = torch.rand(tokens, generator=generator, dtype=dtype) + 0.5
    head = torch.nn.Linear(tokens, vocab, bias=False, dtype=dtype)
    with torch.no_grad():
        head.weight.copy_(logits.T)
    hidden = torch.eye(tokens, dtype=dtype)
    results = []
    for chunk_tokens in (0, 4):
        head.zero_grad()
        if chunk_tokens:
            logprobs, entropies = chunked_token_stats(head, hidden, targets, temperatures, entropy, chunk_tokens)
        else:  # the plain path: [B, T, V] logits with the temperature of each token
            logprobs, entropies = token_stats(head(hidden)[None], targets[None], temperatures[None], entropy)
            logprobs, entropies = logprobs[0], entropies[0]
        (logprobs.sum() + 0.5 * entropies.sum()).backward()
        results.append((logprobs.detach(), entropies.detach(), head.weight.grad.clone()))
    for chunked, plain in zip(results[1], results[0], strict=True):
        assert torch.equal(chunked, plain)


@pytest.mark.parametrize("entropy", ["none", "value", "grad"])
def test_unit_temperatures_skip_the_division_and_change_no_bit(entropy):
    """None (every temperature 1) is the division by ones left out: dividing by 1 changes no value."""
    generator = torch.Generator().manual_seed(1)
    logits = (torch.randn(3, 5, 40, generator=generator) * 4).to(torch.bfloat16)
    targets = torch.randint(0, 40, (3, 5), generator=generator)
    results = []
    for temperatures in (torch.ones(3, 1), None):
        source = logits.clone().requires_grad_(True)
        logprobs, entropies = token_stats(source, targets, temperatures, entropy)
        total = logprobs.sum() + (0.5 * entropies.sum() if entropy == "grad" else 0.0)
        total.backward()
        results.append((logprobs.detach(), None if entropies is None else entropies.detach(), source.grad))
    for divided, as_is in zip(*results, strict=True):
        assert (divided is None and as_is is None) or torch.equal(divided, as_is)


def test_a_checkpointed_chunk_computes_a_value_entropy_once(monkeypatch):
    """The backward's recompute rebuilds the log-probabilities' graph only; the entropy's value (no gradient)
    comes from the forward."""
    import services.learner.logprobs.lm_head as lm_head

    calls = []
    entropy = lm_head.token_entropy
    monkeypatch.setattr(lm_head, "token_entropy", lambda log_probs: calls.append(1) or entropy(log_probs))
    generator = torch.Generator().manual_seed(2)
    head = torch.nn.Linear(6, 30, bias=False, dtype=F64)
    hidden = torch.randn(10, 6, generator=generator, dtype=F64, requires_grad=True)
    targets = torch.randint(0, 30, (10,), generator=generator)
    logprobs, entropies = chunked_token_stats(head, hidden, targets, None, "value", 4)
    logprobs.sum().backward()
    assert len(calls) == 3  # three chunks, each once
    assert not entropies.requires_grad
    plain_hidden = hidden.detach().clone().requires_grad_(True)
    want_logprobs, want_entropies = token_stats(head(plain_hidden), targets, None, "value")
    want_logprobs.sum().backward()
    torch.testing.assert_close(entropies, want_entropies, atol=1e-12, rtol=0)
    torch.testing.assert_close(hidden.grad, plain_hidden.grad, atol=1e-12, rtol=0)


def test_a_batch_on_a_device_keeps_its_temperatures_on_the_host():
    rollouts = [make_rollout(make_task(2, sampling=SamplingSpec(temperature=t, max_tokens=4)), 3) for t in (1.0, 0.7)]
    batch = collate([make_scored(r) for r in rollouts], [torch.tensor([0.5, -0.5])] * 2, pad_id=0)
    moved = batch.to(torch.device("meta"))
    assert moved.input_ids.device.type == "meta" and moved.temperatures.device.type == "cpu"
    assert torch.equal(moved.sampling_temperatures(), torch.tensor([1.0, 1.0, 0.7, 0.7]))
    assert batch.rows(slice(0, 2)).sampling_temperatures() is None  # every temperature 1: no division


def test_autograd_keeps_no_tokens_by_vocab_tensor_when_chunked(tiny):
    model, _ = load_policy(_settings(tiny), str(tiny))
    batch = _batch()
    vocab = model.config.vocab_size
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}  # the head's weight is [V, H]
    kept = {}
    for chunk in (0, 4):
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, saved=saved: saved.append(t) or t, lambda t: t):
            completion_logprobs_and_entropy(model, batch, share_prompts=False, entropy="grad", chunk_tokens=chunk)
        activations = [t for t in saved if t.untyped_storage().data_ptr() not in weights]
        kept[chunk] = max((t.numel() for t in activations if t.shape[-1] == vocab), default=0)
    assert kept[0] >= batch.num_tokens * vocab  # the plain path keeps [B, T, V] logits for the backward
    assert kept[4] == 0  # chunks keep only their [chunk] outputs; their logits are recomputed in the backward


def _tiny_model(kind: str, **config):
    """A small random model of a family whose logits are changed after the LM head."""
    from transformers import CohereConfig, CohereForCausalLM, Gemma2Config, Gemma2ForCausalLM

    sizes = dict(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        pad_token_id=4,
    )
    configs = {"gemma2": (Gemma2Config, Gemma2ForCausalLM), "cohere": (CohereConfig, CohereForCausalLM)}
    config_class, model_class = configs[kind]
    torch.manual_seed(0)
    return model_class(config_class(**sizes, **config)).float()


@pytest.mark.parametrize(
    ("kind", "config"),
    [("gemma2", {"final_logit_softcapping": 30.0}), ("cohere", {"logit_scale": 0.0625})],
)
def test_logits_changed_after_the_head_are_refused_naming_the_setting(kind, config):
    model = _tiny_model(kind, **config)
    batch = _batch()
    with pytest.raises(ValueError, match=r"changes its logits after its LM head.*logprob_chunk_tokens = 0"):
        completion_logprobs_and_entropy(model, batch, share_prompts=False, entropy="none", chunk_tokens=8)
    completion_logprobs_and_entropy(model, batch, share_prompts=False, entropy="none", chunk_tokens=0)


def test_a_gemma_without_softcapping_is_chunked(tiny):
    model = _tiny_model("gemma2", final_logit_softcapping=None).double()
    batch = _batch()
    plain = _pass(model, batch, share_prompts=False, entropy="value", chunk_tokens=0)
    chunked = _pass(model, batch, share_prompts=False, entropy="value", chunk_tokens=3)
    torch.testing.assert_close(chunked[0], plain[0], atol=1e-12, rtol=0)
    _assert_grads_close(chunked[2], plain[2], rel=1e-10)


@pytest.mark.parametrize("share_prompts", [True, False])
def test_lora_with_an_adapted_lm_head_is_chunked_through_its_adapters(tiny, share_prompts):
    settings = _settings(tiny, lora_rank=4, lora_target_modules=["q_proj", "v_proj", "lm_head"])
    model, _ = load_policy(settings, str(tiny))
    with torch.no_grad():  # B starts at 0: give the adapters something to add
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn_like(param) * 0.1)
    batch = _batch(seed=2)
    plain = _pass(model, batch, share_prompts=share_prompts, entropy="value", chunk_tokens=0)
    chunked = _pass(model, batch, share_prompts=share_prompts, entropy="value", chunk_tokens=4)
    assert any("lm_head.lora_B" in name for name in plain[2])
    torch.testing.assert_close(chunked[0], plain[0], atol=1e-5, rtol=1e-5)
    _assert_grads_close(chunked[2], plain[2], rel=1e-4)


@pytest.mark.parametrize("chunk_tokens", [0, 6])
def test_logprobs_no_grad_runs_in_inference_mode_and_returns_a_normal_tensor(tiny, chunk_tokens):
    model, _ = load_policy(_settings(tiny), str(tiny))
    batch = _batch()
    modes = []
    model.get_output_embeddings().register_forward_hook(lambda *_: modes.append(torch.is_inference_mode_enabled()))
    got = logprobs_no_grad(model, batch, micro_batch_size=2, chunk_tokens=chunk_tokens)
    assert modes and all(modes) and not got.is_inference()
    with torch.no_grad():  # what it computed before: the same passes under no_grad
        model.eval()
        parts = [
            completion_logprobs_and_entropy(model, mb, entropy="none", chunk_tokens=chunk_tokens)[0]
            for mb in batch.micro_batches(2)
        ]
    assert torch.equal(got, torch.cat(parts))


def _prepared_and_grads(tiny, **overrides):
    settings = _settings(tiny, beta=0.04, entropy_coef=0.01, top_entropy_quantile=0.5, **overrides)
    model, _ = load_policy(settings, str(tiny))
    model.double()
    trainer = Trainer(model, settings, reference=reference_model(model))
    modes = []
    model.get_output_embeddings().register_forward_hook(lambda *_: modes.append(torch.is_inference_mode_enabled()))
    batch = _batch(seed=3).to(trainer.device)
    batch.behaviour_logprobs = batch.behaviour_logprobs.double()
    prepared = trainer.prepare(batch)
    assert any(modes), "the no-grad passes ran under inference_mode"
    assert not prepared.old_logprobs.is_inference() and not prepared.ref_logprobs.is_inference()
    trainer.optimizer.adamw.zero_grad()
    trainer.accumulate_gradients(batch, prepared)  # the loss may save the prepared tensors for its backward
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return prepared, grads


def test_trainer_numbers_do_not_depend_on_chunks_or_no_grad_micro_batches(tiny):
    prepared, grads = _prepared_and_grads(tiny, logprob_chunk_tokens=0, no_grad_micro_batch_size=0)
    for overrides in ({"logprob_chunk_tokens": 5}, {"no_grad_micro_batch_size": 9}, {"no_grad_micro_batch_size": 2}):
        other, other_grads = _prepared_and_grads(tiny, **overrides)
        torch.testing.assert_close(other.old_logprobs, prepared.old_logprobs, atol=1e-12, rtol=0)
        torch.testing.assert_close(other.ref_logprobs, prepared.ref_logprobs, atol=1e-12, rtol=0)
        torch.testing.assert_close(other.importance_weights, prepared.importance_weights, atol=1e-12, rtol=0)
        assert float(other.normalisers.entropy_threshold) == pytest.approx(
            float(prepared.normalisers.entropy_threshold), abs=1e-12
        )
        _assert_grads_close(other_grads, grads, rel=1e-10)


def test_settings_defaults_and_bounds(tiny):
    settings = _settings(tiny)
    assert settings.logprob_chunk_tokens == 1024 and settings.no_grad_micro_batch_size == 0
    with pytest.raises(ValueError, match="logprob_chunk_tokens"):
        _settings(tiny, logprob_chunk_tokens=-1)
    with pytest.raises(ValueError, match="no_grad_micro_batch_size"):
        _settings(tiny, no_grad_micro_batch_size=-1)


def test_a_pass_without_completion_tokens_still_backpropagates(tiny):
    """A zero-weighted padding pass (sharded learner) may hold no completion token: it must still backward."""
    model, _ = load_policy(_settings(tiny), str(tiny))
    batch = _batch().rows(slice(0, 2))
    batch.completion_mask = torch.zeros_like(batch.completion_mask)
    logprobs, entropies = completion_logprobs_and_entropy(
        model, batch, share_prompts=False, entropy="grad", chunk_tokens=4
    )
    assert torch.all(logprobs == 0) and torch.all(entropies == 0)
    (logprobs.sum() * 0.0).backward()
    assert model.lm_head.weight.grad is not None and torch.all(model.lm_head.weight.grad == 0)
