"""Environments, rewards and a tool-calling tiny model for the multi-turn end-to-end tests
(tests/e2e/test_multi_turn.py, tests/e2e/test_multi_turn_faults.py).

A random tiny model never writes a hermes tool call by itself, and a chat template cannot pre-write one for it:
the parser reads only the sampled text. So :func:`build_tool_calling_model` builds a tiny Llama that *samples*
real calls. Its tokenizer is tests/support/tiny_model.py's character-level one plus three tokens, as real tool
models have them: ``<tool_call>``, ``</tool_call>`` and the whole call ``{"name": "tick", "arguments": {}}`` (so a
call is three samples, not thirty characters a bigram cannot order). Its weights are random and near-uniform, with
a bigram tilt through the residual stream (embedding direction -> output row): after the assistant header's ``\\n``
the model opens a call with p ~ 0.6, then writes the call, the end tag and the close token with p ~ 0.95 each, and
closes any other text with p ~ 0.06 per token. The generator's real hermes parser
(services/generator/trajectory/parsing.py) reads what it sampled; nothing is scripted after sampling.

This module is the ``[environment] python`` module (copied beside the configuration file) and the
``--environment`` of ``python -m services.env_server``; it imports only the standard library at module level.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

CALL = '{"name": "tick", "arguments": {}}'
TOOL_TOKENS = ["<tool_call>", "</tool_call>", CALL]
GATE_ENV = "E2E_TOOL_GATE"  # a path: while that file exists, tick() blocks (and says so in <path>.blocked)
_TILT = {  # (token, next token, logit added to next after token)
    "open": ("\n", "<tool_call>", 5.5),
    "call": ("<tool_call>", CALL, 10.0),
    "end": (CALL, "</tool_call>", 10.0),
    "close": ("</tool_call>", "<|im_end|>", 10.0),
}


def build_tool_tokenizer():
    """tests/support/tiny_model.py's character tokenizer and ChatML, plus the three tool-call tokens."""
    from tests.support.tiny_model import build_tokenizer  # torch: not imported where the environments run

    return build_tokenizer(TOOL_TOKENS)


def build_tool_calling_model(path: str | Path, seed: int = 7, hidden: int = 128) -> Path:
    """Write the tilted tiny Llama (see the module docstring) and its tokenizer to ``path``."""
    import torch

    from tests.support.tiny_model import tiny_llama  # torch: not imported where the environments run

    path = Path(path)
    tokenizer = build_tool_tokenizer()
    model = tiny_llama(tokenizer, seed, hidden=hidden, max_positions=2048)
    ids = tokenizer.convert_tokens_to_ids
    with torch.no_grad():
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        embed[:, 0] = 3.0  # a constant direction: every token leans a little towards the close token
        head[ids("<|im_end|>"), 0] = 0.17
        for dim, (token, following, logit) in enumerate(_TILT.values(), start=1):
            embed[ids(token), dim] = 3.0
            head[ids(following), dim] = logit / 8.0  # the final norm scales a marker of 3 to about 8
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.chat_template = (Path(__file__).parent / "templates" / "chatml_tools.jinja").read_text()
    tokenizer.save_pretrained(path)
    return path


class TickEnv:
    """One tool, ``tick``, that counts its calls; the reward is the number of ticks (more calls, more reward)."""

    def reset(self, **row) -> None:
        self.ticks = 0

    def tick(self) -> str:
        """Count one tick and say how many there were."""
        self.ticks += 1
        return f"tick {self.ticks}"

    def get_reward(self) -> float:
        return float(self.ticks)


class GatedTickEnv(TickEnv):
    """``TickEnv`` whose ``tick`` blocks while the file named by ``$E2E_TOOL_GATE`` exists, writing
    ``<gate>.blocked`` while it waits (so a test knows a generator is held inside an environment step)."""

    _lock = threading.Lock()

    def tick(self) -> str:
        """Count one tick and say how many there were."""
        gate = os.environ.get(GATE_ENV)
        if gate:
            while os.path.exists(gate):
                with self._lock:
                    Path(gate + ".blocked").touch()
                time.sleep(0.05)
        return super().tick()


def tool_messages(prompts, completions, **columns) -> list[float]:
    """A TRL tool-use reward: the share of the conversation's messages that are tool results (it raises on a
    completion that is not a message list, which stops the scorer and fails the test)."""
    return [sum(m["role"] == "tool" for m in messages) / len(messages) for messages in completions]
