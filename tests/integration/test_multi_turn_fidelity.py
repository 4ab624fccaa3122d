"""Token fidelity of multi-turn trajectories through the real vLLM engine (CPU build): for every turn the
engine's input is the prompt's ids plus the trajectory's tokens so far, the sampled spans are the engine's own
outputs, and at the generator's weights the learner's logprobs of the sampled tokens match the behaviour
logprobs (docs/concepts/multi-turn-design.md §3 step 15), with two chat templates (the tiny model's ChatML, and a
Qwen2.5-style template that renders tools and tool calls).

A random tiny model never writes a tool call, so the parser is replaced by one that reads every turn as a
call to ``echo`` with the turn's text: what is under test is the token bookkeeping, not the parsing (tested on
its own in ``tests/unit/test_tool_parsing.py``). The model's output layer is tilted so that it ends a turn
(``<|im_end|>``) every ~15 tokens, which gives trajectories of several turns.
"""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from environments.build import build_environment
from services.generator.trajectory import runner as runner_module
from services.generator.trajectory.parsing import ParsedTurn
from services.generator.trajectory.runner import TrajectoryRunner, TrajectorySettings
from services.learner.data.batch import collate
from services.learner.logprobs.policy import completion_logprobs
from shared.config.environment import EnvironmentSettings
from shared.config.generator import GeneratorSettings
from shared.records import ChatMessage, PromptTask, Rollout, RolloutTimings, SamplingSpec
from tests.support.factories import make_scored
from tests.support.tiny_model import build_turn_ending_llama

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TEMPLATES = Path(__file__).resolve().parents[1] / "support" / "templates"
MAX_MODEL_LEN = 2048  # the tool template's system turn lists the tools' schemas: ~1000 characters, one token each


class EchoEverything:
    """Reads every turn as one call to ``echo`` with the turn's text (see the module docstring)."""

    def __init__(self, tokenizer, tools, kind="hermes") -> None:
        self.tokenizer = tokenizer

    def parse(self, token_ids, turn: int) -> ParsedTurn:
        text = self.tokenizer.decode(list(token_ids), skip_special_tokens=True)
        arguments = {"text": text[:20]}
        call = {"id": f"call_{turn}_0", "name": "echo", "arguments": arguments}
        message = {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": call["id"], "type": "function", "function": {"name": "echo", "arguments": call["arguments"]}}
            ],
        }
        return ParsedTurn(message, (call,), (), False)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from services.generator.engine import Engine

    model = build_turn_ending_llama(tmp_path_factory.mktemp("fidelity") / "model", max_positions=MAX_MODEL_LEN)
    settings = GeneratorSettings(model=str(model), dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=16)
    started = Engine.start(settings, str(model), policy_version=0)
    seen: list[tuple[list[int], list[int]]] = []  # (prompt ids, output ids) of every request, as vLLM reports them
    generate = started.llm.generate

    async def recording(prompt, params, request_id):
        final = None
        async for output in generate(prompt, params, request_id):
            final = output
            yield output
        seen.append((list(final.prompt_token_ids), list(final.outputs[0].token_ids)))

    started.llm.generate = recording
    # vLLM's client binds its output task to the first event loop that uses it: every test runs in this one.
    started.model_path, started.seen, started.loop = model, seen, asyncio.new_event_loop()
    yield started

    async def shut_down(engine) -> None:
        # In the loop vLLM's client runs in: called from outside it, AsyncLLM's shutdown only schedules the closing
        # of its ZMQ sockets on that loop, which then never runs again; the open sockets make the context's
        # termination, whenever the garbage collector reaches it, wait forever (a later test hung 600 s on it).
        engine.shutdown()
        await asyncio.sleep(0)  # the cancelled output tasks end

    started.loop.run_until_complete(shut_down(started))
    resources = started.llm.engine_core.resources
    sockets = (resources.output_socket, resources.input_socket, resources.first_req_send_socket)
    assert all(socket is None or socket.closed for socket in sockets), "vLLM's client left a ZMQ socket open"
    started.loop.close()
    del started
    gc.collect()


def _trajectories(engine, template: str | None, monkeypatch):
    monkeypatch.setattr(runner_module, "ToolCallParser", EchoEverything)
    environment = build_environment(EnvironmentSettings(python="tests.support.trajectory_envs:AdderEnv"))
    knobs = TrajectorySettings(
        max_turns=3,
        max_tool_response_tokens=12,
        max_model_len=MAX_MODEL_LEN,
        chat_template=(TEMPLATES / template).read_text() if template else None,
    )
    runner = TrajectoryRunner(engine, environment, knobs)
    task = PromptTask(
        prompt=(ChatMessage(role="user", content="Say something."),),
        group_size=8,
        sampling=SamplingSpec(max_tokens=400, temperature=1.0),
        policy_version=0,
    )
    engine.seen.clear()
    group = engine.loop.run_until_complete(runner.run(task))
    rollout = Rollout(
        group_id=task.task_id,
        task=task,
        prompt_token_ids=group.prompt_token_ids,
        completions=group.completions,
        policy_version=group.policy_version,
        finished_policy_version=group.finished_policy_version,
        generator_id="g",
        timings=RolloutTimings(received_at=0.0, started_at=group.started_at, finished_at=group.finished_at),
    )
    return rollout


def _prompt_of(rollout: Rollout, completion) -> list[int]:
    own = completion.prompt_token_ids
    return list(own) if own is not None else list(rollout.prompt_token_ids)


@pytest.mark.parametrize("template", [None, "chatml_tools.jinja"])
def test_the_engine_reads_prompt_plus_trajectory_and_its_outputs_are_the_sampled_spans(engine, template, monkeypatch):
    rollout = _trajectories(engine, template, monkeypatch)
    turns = [c.trajectory.turns for c in rollout.completions]
    assert np.mean(turns) > 1, turns
    assert len(engine.seen) == sum(turns)
    for completion in rollout.completions:
        prompt, tokens, mask = _prompt_of(rollout, completion), completion.token_ids.tolist(), completion.loss_mask
        mine = [(read, out) for read, out in engine.seen if read[: len(prompt)] == prompt]
        assert len(mine) == completion.trajectory.turns
        spans = []
        for read, out in mine:
            start = len(read) - len(prompt)
            assert read == prompt + tokens[:start]  # I1, as vLLM reports what it read
            assert tokens[start : start + len(out)] == out and mask[start : start + len(out)].all()  # I2
            spans.append((start, start + len(out)))
        assert sum(end - start for start, end in spans) == int(mask.sum())  # nothing else is sampled


@pytest.mark.parametrize("template", [None, "chatml_tools.jinja"])
def test_the_learners_logprobs_at_the_generators_weights_match_the_behaviour_logprobs(engine, template, monkeypatch):
    rollout = _trajectories(engine, template, monkeypatch)
    model = AutoModelForCausalLM.from_pretrained(engine.model_path, dtype=torch.float32)
    scored = make_scored(rollout)
    batch = collate([scored], [torch.from_numpy(scored.advantages.copy())], pad_id=4)
    mask = batch.loss_mask.bool()
    with torch.no_grad():
        for packed in (False, True):
            logprobs = completion_logprobs(model, batch, packed=packed)
            difference = (logprobs - batch.behaviour_logprobs)[mask]
            ratio, worst = difference.exp().mean().item(), difference.abs().max().item()
            print(f"template {template} packed {packed}: ratio mean {ratio:.6f}, max |diff| {worst:.2e}")
            assert abs(ratio - 1.0) < 0.01
            assert worst < 0.05
    assert int(mask.sum()) == sum(int(c.loss_mask.sum()) for c in rollout.completions)
