"""Runs a prompt's G trajectories against an environment: sample a turn, parse its tool calls, call the
environment, append the template's delta, until the model stops calling tools or a bound is reached.

One task per trajectory inside one ``asyncio.TaskGroup`` per prompt (docs/concepts/multi-turn-design.md §2.8): a
trajectory waiting on its environment holds nothing else, and the engine batches whichever are sampling. An
:class:`~environments.session.EnvFault` in any trajectory cancels its siblings and propagates: the prompt is
abandoned and redelivered, and no ``Completion`` is ever made of a trajectory the environment failed (I5).
Every session is closed on every path by ``Environment.session``'s context manager (I6).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from environments.protocol import StepResponse, ToolCallIn
from environments.session import EnvFault, Environment, Session
from services.generator.engine import InvalidPromptError, PromptTooLongError
from services.generator.trajectory.parsing import ParsedTurn, ToolCallParser
from services.generator.trajectory.state import (
    SampledTurn,
    Trajectory,
    cut_tool_content,
    delta_room,
    derived_seed,
    turn_budget,
)
from services.generator.trajectory.template import PrefixBreak, Render, check_template, make_render, turn_delta
from shared.chat import message_dict
from shared.records import Completion, PromptTask, SamplingSpec
from shared.sampled_versions import trajectory_version

log = logging.getLogger(__name__)


class RolledBack(RuntimeError):
    """The engine's weights went back to an older version during a turn (a restarted learner's reset push):
    no version describes the turn's tokens, so the prompt is sampled again."""


class TurnSampler(Protocol):
    """What the runner needs of the engine (``services/generator/engine.py::Engine``)."""

    tokenizer: Any
    policy_version: int

    async def sample_turn(
        self, context_ids: list[int], spec: SamplingSpec, max_tokens: int, stop_token_ids: list[int], seed: int | None
    ) -> SampledTurn: ...


@dataclass(frozen=True)
class TrajectorySettings:
    """The ``[environment]`` settings the runner reads, and the engine's context."""

    max_turns: int
    max_tool_response_tokens: int
    max_model_len: int
    tool_parser: str = "hermes"
    chat_template: str | None = None  # the template's text, None: the tokenizer's own
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Toolkit:
    """What one set of tool schemas needs: the renderer, its checked close token, and the parser."""

    tools: tuple[dict[str, Any], ...]
    render: Render
    close_token: int
    parser: ToolCallParser


@dataclass(frozen=True)
class SampledTrajectories:
    """A prompt's G trajectories as records, with the rollout-level facts the loop writes."""

    completions: tuple[Completion, ...]
    prompt_token_ids: list[int]  # sample 0's; a sample whose prompt differs carries its own
    policy_version: int  # the oldest sampled token's version (what staleness reads)
    finished_policy_version: int
    lowest_policy_version: int  # below policy_version: the weights went back after the last turn (each was checked)
    started_at: float
    finished_at: float

    @property
    def num_tokens(self) -> int:
        return sum(int(c.loss_mask.sum()) if c.loss_mask is not None else len(c.token_ids) for c in self.completions)


class Toolkits:
    """Renderers checked once per distinct set of tool schemas (an HTTP environment names its tools only when
    a session opens). A template that fails the start check raises ``TemplateError``, which stops the
    generator: it is a configuration to fix, not a prompt to retry."""

    def __init__(self, tokenizer: Any, settings: TrajectorySettings) -> None:
        self.tokenizer = tokenizer
        self.settings = settings
        self._checked: dict[str, Toolkit] = {}

    def get(self, tools: Sequence[Mapping[str, Any]]) -> Toolkit:
        key = json.dumps(list(tools), sort_keys=True)
        if key not in self._checked:
            render = make_render(self.tokenizer, tools, self.settings.chat_template, self.settings.chat_template_kwargs)
            close = check_template(render, self.tokenizer, tools)
            parser = ToolCallParser(self.tokenizer, tools, self.settings.tool_parser)
            self._checked[key] = Toolkit(tuple(dict(t) for t in tools), render, close, parser)
        return self._checked[key]


class TrajectoryRunner:
    """Samples a prompt's trajectories; see the module docstring."""

    def __init__(self, engine: TurnSampler, environment: Environment, settings: TrajectorySettings) -> None:
        self.engine = engine
        self.environment = environment
        self.settings = settings
        self.toolkits = Toolkits(engine.tokenizer, settings)
        self.template_breaks = 0

    async def run(self, task: PromptTask) -> SampledTrajectories:
        """All G trajectories of ``task``; raises ``EnvFault`` (the prompt is abandoned), ``RolledBack``, or
        ``InvalidPromptError`` (from the engine) as the first of its trajectories' failures."""
        if task.sampling.min_tokens:  # vLLM's min_tokens would hold every turn open past its close token
            raise InvalidPromptError(
                f"min_tokens = {task.sampling.min_tokens} with an environment: a turn ends at the model's own turn "
                "end (set the learner's min_completion_length to 0)"
            )
        started_at = time.time()
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._trajectory(task, i)) for i in range(task.group_size)]
        except BaseExceptionGroup as failures:
            raise _first_leaf(failures) from None
        trajectories = [t.result() for t in tasks]
        return self._records(task, trajectories, started_at)

    def _records(self, task: PromptTask, trajectories: list[Trajectory], started_at: float) -> SampledTrajectories:
        first, task_prompt = trajectories[0], prompt_messages(task, None)
        completions = tuple(
            t.completion(
                self._text(t.tokens),
                own_prompt_ids=t.prompt_ids != first.prompt_ids,
                own_prompt=t.prompt != task_prompt,
            )
            for t in trajectories
        )
        oldest = min(trajectory_version(c.token_versions, c.loss_mask) for c in completions)
        return SampledTrajectories(
            completions=completions,
            prompt_token_ids=first.prompt_ids,
            policy_version=oldest,
            finished_policy_version=self.engine.policy_version,
            lowest_policy_version=min(oldest, self.engine.policy_version),
            started_at=started_at,
            finished_at=time.time(),
        )

    def _text(self, token_ids: list[int]) -> str:
        return self.engine.tokenizer.decode(token_ids, skip_special_tokens=False)

    async def _trajectory(self, task: PromptTask, sample: int) -> Trajectory:
        row = task_row(task)
        async with self.environment.session(row, f"{task.task_id}/{sample}") as session:
            toolkit = self.toolkits.get(session.tools)
            prompt = prompt_messages(task, session.observation)
            trajectory = Trajectory(
                prompt_ids=toolkit.render(prompt, True), prompt=prompt, limit=task.sampling.max_tokens
            )
            while await self._turn(task, sample, session, toolkit, trajectory):
                pass
            trajectory.env_reward = await session.reward()
            trajectory.latencies_s = list(session.latencies_s)
        return trajectory

    async def _turn(
        self, task: PromptTask, sample: int, session: Session, toolkit: Toolkit, trajectory: Trajectory
    ) -> bool:
        """One assistant turn and, when it calls tools, their results. True: another turn follows."""
        context = self.settings.max_model_len
        budget = turn_budget(trajectory.limit, context, len(trajectory.prompt_ids), trajectory.used)
        if budget.cut is not None:
            if trajectory.turns == 0:
                raise PromptTooLongError(
                    f"prompt has {len(trajectory.prompt_ids)} tokens; the engine's context is {context}"
                )
            trajectory.cut = budget.cut
            return False
        turn = await self._sample(task, sample, toolkit, trajectory, budget.max_tokens)
        if turn.finish_reason == "length" or not turn.token_ids or turn.token_ids[-1] != toolkit.close_token:
            trajectory.finish_reason = "length" if turn.finish_reason == "length" else "stop"
            trajectory.messages.append({"role": "assistant", "content": self._text_of(turn.token_ids, toolkit)})
            return False
        parsed = toolkit.parser.parse(turn.token_ids[:-1], trajectory.turns)
        trajectory.messages.append(parsed.message)
        return await self._act(session, toolkit, trajectory, parsed)

    def _text_of(self, token_ids: list[int], toolkit: Toolkit) -> str:
        ids = token_ids[:-1] if token_ids and token_ids[-1] == toolkit.close_token else token_ids
        return self.engine.tokenizer.decode(ids, skip_special_tokens=True)

    async def _sample(
        self, task: PromptTask, sample: int, toolkit: Toolkit, trajectory: Trajectory, max_tokens: int
    ) -> SampledTurn:
        seed = derived_seed(task.sampling.seed, sample, trajectory.turns)
        turn = await self.engine.sample_turn(
            trajectory.engine_input(), task.sampling, max_tokens, [toolkit.close_token], seed
        )
        newest = max(trajectory.versions, default=turn.version)
        if turn.lowest_version < turn.version or turn.version < newest:
            went_to = turn.lowest_version
            raise RolledBack(f"the weights went back from version {max(newest, turn.version)} to {went_to}")
        trajectory.add_sampled(turn.token_ids, turn.logprobs, turn.version)
        return turn

    async def _act(self, session: Session, toolkit: Toolkit, trajectory: Trajectory, parsed: ParsedTurn) -> bool:
        """Run the turn's calls and extend the trajectory with their results. True: another turn follows."""
        calls = parsed.message.get("tool_calls") or []
        if parsed.malformed:  # the start marker without a call that parses: one failed call, the turn is final
            trajectory.tool_calls += 1
            trajectory.tool_errors += 1
            return False
        if not calls:
            return False
        if trajectory.turns >= self.settings.max_turns:
            trajectory.cut = "max_turns"
            return False
        response = await session.step([ToolCallIn(**call) for call in parsed.calls]) if parsed.calls else None
        tool_messages = self._tool_messages(calls, parsed, response)
        trajectory.tool_calls += len(calls)
        errors = [message.pop("_error") for message in tool_messages]
        trajectory.tool_errors += sum(errors)
        if response is not None and response.done:
            trajectory.messages += tool_messages  # nothing follows them: kept for rewards, not in the tokens
            return False
        return self._extend(toolkit, trajectory, tool_messages)

    def _tool_messages(
        self, calls: list[dict[str, Any]], parsed: ParsedTurn, response: StepResponse | None
    ) -> list[dict[str, Any]]:
        """The tool messages answering ``calls``, in their order: the environment's results and the parser's
        rejections, each result's content cut to ``max_tool_response_tokens``."""
        answers = {m["tool_call_id"]: {**m, "_error": True} for m in parsed.rejected}
        for result in response.results if response is not None else ():
            answers[result.tool_call_id] = {
                "role": "tool",
                "content": result.content,
                "tool_call_id": result.tool_call_id,
                "name": result.name,
                "_error": result.error,
            }
        missing = [call["id"] for call in calls if call["id"] not in answers]
        if missing:
            raise EnvFault(f"the environment answered no result for tool call(s) {', '.join(missing)}")
        tokenizer = self.engine.tokenizer
        messages = []
        for call in calls:
            message = dict(answers[call["id"]])
            message["content"] = cut_tool_content(
                message["content"],
                self.settings.max_tool_response_tokens,
                lambda text: tokenizer.encode(text, add_special_tokens=False),
                lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
            )
            messages.append(message)
        return messages

    def _extend(self, toolkit: Toolkit, trajectory: Trajectory, tool_messages: list[dict[str, Any]]) -> bool:
        """Append the template's delta for the tool messages and the next assistant header, when it keeps the
        prefix (else the trajectory ends at the break) and fits (else the tool messages are rolled back)."""
        history = trajectory.prompt + trajectory.messages
        try:
            delta = turn_delta(toolkit.render, history, tool_messages, toolkit.close_token)
        except PrefixBreak as exc:
            self.template_breaks += 1
            log.error("the chat template rewrote the history; the trajectory ends here: %s", exc)
            trajectory.cut = "template_break"
            return False
        room = delta_room(
            trajectory.limit, self.settings.max_model_len, len(trajectory.prompt_ids), trajectory.used, len(delta)
        )
        if room is not None:
            trajectory.cut = room
            return False
        trajectory.add_context(delta)
        trajectory.messages += tool_messages
        return True


def _first_leaf(failures: BaseExceptionGroup) -> BaseException:
    """The first real failure of a group (cancellations of the siblings are its consequence)."""
    for exc in failures.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            return _first_leaf(exc)
        if not isinstance(exc, asyncio.CancelledError):
            return exc
    return failures.exceptions[0]


def task_row(task: PromptTask) -> dict[str, Any]:
    """The dataset row an environment's ``reset`` gets: ``prompt`` (plain JSON) and the task's columns."""
    prompt = task.prompt if isinstance(task.prompt, str) else [message_dict(m) for m in task.prompt]
    return {"prompt": prompt, **task.columns}


def prompt_messages(task: PromptTask, observation: str | None) -> list[dict[str, Any]]:
    """The sample's prompt messages: a text prompt is one user message; ``reset``'s observation is appended
    to the last user message's content, as TRL's environment_factory does."""
    if isinstance(task.prompt, str):
        messages = [{"role": "user", "content": task.prompt}]
    else:
        messages = [message_dict(m) for m in task.prompt]
    if observation:
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if users:
            messages[users[-1]] = {**messages[users[-1]], "content": messages[users[-1]]["content"] + observation}
        else:
            messages.append({"role": "user", "content": observation})
    return messages
