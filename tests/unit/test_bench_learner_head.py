"""bench/learner.py's bare loop: the LM head in chunks gives the gradients of the full-logits loop."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from bench import learner as bench
from services.learner.hardware import resolve_precision


@pytest.mark.parametrize("chunk", [1, 7, 64, 10_000])
def test_chunked_head_matches_full_logits(chunk: int) -> None:
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    shape = bench.BatchShape(groups=2, group_size=3, prompt=5, completion_min=2, completion_max=9, micro_batch_size=4)
    groups = bench.make_groups(shape, config.vocab_size)
    precision = resolve_precision("float32", "float32", "cpu")
    grads = []
    for chunk_tokens in (0, chunk):
        model = bench.build_model(config, torch.float32, "cpu")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        bench.bare_step(model, optimizer, groups, shape.micro_batch_size, precision, "cpu", chunk_tokens)
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    full, chunked = grads
    assert full.keys() == chunked.keys()
    for name in full:
        assert torch.count_nonzero(full[name]) > 0, name
        torch.testing.assert_close(chunked[name], full[name], rtol=1e-4, atol=1e-6, msg=name)
