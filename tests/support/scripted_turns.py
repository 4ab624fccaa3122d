"""A scripted stand-in for the generator's engine in multi-turn tests: it answers turn k of every trajectory
with a fixed text and records every context it read, so a test can check what the engine saw (I1)."""

from __future__ import annotations

import asyncio
import json

from services.generator.trajectory.state import SampledTurn

LOGPROB = -0.5
NO_CLOSE = "<no close>"  # a scripted reply that stops without the close token (another stop token)


def tool_call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


class ScriptedEngine:
    """Answers turn k of every trajectory with ``script[k]`` and records what it read (the I1 check)."""

    def __init__(self, tokenizer, script: list[str], version: int = 3) -> None:
        self.tokenizer = tokenizer
        self.script = script
        self.policy_version = version
        self.inputs: list[list[int]] = []
        self.weights_ok = True  # what the rollout loop reads of an engine
        self.paused_by_operator = False
        self.active_requests = 0
        self.seeds: list[int | None] = []

    async def sample_turn(self, context_ids, spec, max_tokens, stop_token_ids, seed) -> SampledTurn:
        self.inputs.append(list(context_ids))
        self.seeds.append(seed)
        turn = self.tokenizer.decode(context_ids).count("<|im_start|>assistant") - 1
        text = self.script[min(turn, len(self.script) - 1)]
        ids = self.tokenizer.encode(text.replace(NO_CLOSE, ""), add_special_tokens=False)
        if NO_CLOSE not in text:
            ids.append(stop_token_ids[0])
        finish = "length" if len(ids) > max_tokens else "stop"
        ids = ids[:max_tokens]
        version = self.policy_version
        await asyncio.sleep(0.001)  # the other trajectories run meanwhile
        return SampledTurn(
            ids, [LOGPROB] * len(ids), finish, version, self.policy_version, min(version, self.policy_version)
        )
