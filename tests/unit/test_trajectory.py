"""The trajectory runner with a scripted engine and real Python environments (docs/concepts/multi-turn-design.md §3
step 9): the engine reads exactly the prompt's ids and the trajectory's tokens before every turn (I1); the mask,
logprob and version invariants (I3); the budgets and cuts; faults close every session and make no record."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from environments.build import build_environment
from environments.session import EnvFault
from services.generator.engine import InvalidPromptError, PromptTooLongError
from services.generator.trajectory.runner import RolledBack, TrajectoryRunner, TrajectorySettings
from services.generator.trajectory.state import TRUNCATION_MARK, delta_room, derived_seed, turn_budget
from shared.config.environment import EnvironmentSettings
from shared.records import ChatMessage, PromptTask, SamplingSpec
from tests.support.scripted_turns import LOGPROB, NO_CLOSE, ScriptedEngine, tool_call
from tests.support.tiny_model import build_tokenizer

TEMPLATES = Path(__file__).resolve().parents[1] / "support" / "templates"


def _runner(script, env="AdderEnv", template=None, max_model_len=4096, **settings):
    tokenizer = build_tokenizer()
    engine = ScriptedEngine(tokenizer, script)
    environment = build_environment(
        EnvironmentSettings(python=f"tests.support.trajectory_envs:{env}", timeout_s=settings.pop("timeout_s", 10.0))
    )
    chat_template = (TEMPLATES / template).read_text() if template else None
    knobs = {"max_turns": 4, "max_tool_response_tokens": 64, **settings}
    trajectory_settings = TrajectorySettings(max_model_len=max_model_len, chat_template=chat_template, **knobs)
    return TrajectoryRunner(engine, environment, trajectory_settings), engine


def _task(group_size=3, max_tokens=600, seed=None) -> PromptTask:
    prompt = (ChatMessage(role="user", content="What is 1 + 2?"),)
    sampling = SamplingSpec(max_tokens=max_tokens, seed=seed)
    return PromptTask(prompt=prompt, group_size=group_size, sampling=sampling, policy_version=0)


def _run(runner, task=None):
    return asyncio.run(runner.run(task or _task()))


SCRIPT = [tool_call("add", a=1, b=2), tool_call("echo", text="three"), "The answer is 3."]


@pytest.mark.parametrize("template", [None, "chatml_tools.jinja"])
def test_the_engine_reads_the_prompt_and_the_trajectorys_tokens_before_every_turn(template):
    runner, engine = _runner(SCRIPT, template=template)
    group = _run(runner)
    assert len(group.completions) == 3 and len(engine.inputs) == 9
    for completion in group.completions:
        prompt = list(
            completion.prompt_token_ids if completion.prompt_token_ids is not None else group.prompt_token_ids
        )
        tokens = completion.token_ids.tolist()
        mine = [read for read in engine.inputs if read[: len(prompt)] == prompt]
        assert len(mine) == completion.trajectory.turns == 3
        for read in mine:  # I1: a prefix of prompt ++ tokens, cut where a sampled turn starts
            assert read == prompt + tokens[: len(read) - len(prompt)]
            assert completion.loss_mask[len(read) - len(prompt)] == 1


def test_with_a_tool_template_the_engines_text_is_the_templates_rendering_of_the_conversation():
    runner, _ = _runner(SCRIPT, template="chatml_tools.jinja")
    group = _run(runner)
    completion = group.completions[0]
    ids = group.prompt_token_ids + completion.token_ids.tolist()
    toolkit = next(iter(runner.toolkits._checked.values()))
    messages = runner_messages(group, 0)
    assert ids == toolkit.render(messages, False)[: len(ids)]


def runner_messages(group, sample):
    completion = group.completions[sample]
    prompt = completion.prompt or ()
    return [m.model_dump(mode="json", exclude_none=True) for m in (*prompt, *completion.messages)]


def test_masks_logprobs_and_versions_mark_exactly_the_sampled_tokens():
    runner, engine = _runner(SCRIPT)
    group = _run(runner)
    tokenizer = engine.tokenizer
    sampled = sum(len(tokenizer.encode(text, add_special_tokens=False)) + 1 for text in SCRIPT)
    for completion in group.completions:
        mask = completion.loss_mask.astype(bool)
        assert mask.sum() == sampled and mask[-1]
        assert np.all(completion.behaviour_logprobs[mask] == LOGPROB)
        assert np.all(completion.behaviour_logprobs[~mask] == 0.0)
        assert np.all(completion.token_versions[mask] == 3) and np.all(completion.token_versions[~mask] == -1)
        info = completion.trajectory
        assert (info.turns, info.tool_calls, info.tool_errors, info.cut) == (3, 2, 0, None)
        assert info.env_reward == 2.0  # AdderEnv.get_reward: the calls it served
        assert [m.role for m in completion.messages] == ["assistant", "tool", "assistant", "tool", "assistant"]
        assert completion.messages[1].content == "3" and completion.messages[1].name == "add"
        assert completion.messages[-1].content == "The answer is 3."
        assert completion.finish_reason == "stop"
    assert group.policy_version == 3 and group.num_tokens == 3 * sampled


def test_each_sample_gets_its_own_prompt_when_reset_returns_a_different_observation():
    runner, _ = _runner(SCRIPT)
    group = _run(runner)
    first, *others = group.completions
    assert first.prompt_token_ids is None and first.prompt[-1].content.startswith("What is 1 + 2? (try")
    for completion in others:
        assert completion.prompt_token_ids is not None and completion.prompt[-1].content.startswith("What is 1 + 2?")
        assert completion.prompt_token_ids.tolist() != group.prompt_token_ids
        assert completion.prompt[-1].content != first.prompt[-1].content


def test_samples_get_distinct_seeds_per_turn_from_the_tasks_seed():
    runner, engine = _runner(SCRIPT)
    _run(runner, _task(seed=7))
    assert len(set(engine.seeds)) == 9 and derived_seed(None, 1, 2) is None


def test_max_turns_cuts_a_trajectory_that_still_calls_a_tool():
    runner, _ = _runner([tool_call("add", a=1, b=1)], max_turns=2)
    info = _run(runner).completions[0].trajectory
    assert (info.turns, info.tool_calls, info.cut) == (2, 1, "max_turns")


def test_a_tool_result_is_cut_to_max_tool_response_tokens():
    runner, _ = _runner([tool_call("echo", text="x" * 200), "done"], max_tool_response_tokens=10)
    tool = _run(runner).completions[0].messages[1]
    assert tool.content == "x" * 10 + TRUNCATION_MARK


def test_a_tool_that_raises_is_a_tool_error_the_model_reads():
    runner, _ = _runner([tool_call("fail", why="no"), "ok"])
    completion = _run(runner).completions[0]
    assert completion.trajectory.tool_errors == 1 and "ValueError: no" in completion.messages[1].content


def test_the_token_budget_rolls_back_tool_messages_that_would_not_fit():
    first = len(build_tokenizer().encode(SCRIPT[0], add_special_tokens=False)) + 1
    runner, _ = _runner(SCRIPT)
    completion = _run(runner, _task(max_tokens=first + 5)).completions[0]
    assert completion.trajectory.cut == "token_budget" and completion.trajectory.turns == 1
    assert [m.role for m in completion.messages] == ["assistant"] and completion.loss_mask.all()


def test_the_engines_context_cuts_a_trajectory():
    runner, _ = _runner(SCRIPT, max_model_len=120)
    group = _run(runner)
    completion = group.completions[0]
    assert completion.trajectory.cut == "context" and completion.trajectory.turns == 1
    assert len(group.prompt_token_ids) + len(completion.token_ids) <= 120


def test_a_turn_that_hits_its_max_tokens_ends_the_trajectory_as_length():
    runner, _ = _runner(["y" * 100])
    completion = _run(runner, _task(max_tokens=30)).completions[0]
    assert completion.finish_reason == "length" and len(completion.token_ids) == 30


def test_a_turn_that_stops_without_the_close_token_ends_the_trajectory():
    runner, _ = _runner([tool_call("add", a=1, b=1) + NO_CLOSE])
    completion = _run(runner).completions[0]
    assert completion.trajectory.turns == 1 and completion.trajectory.tool_calls == 0
    assert completion.finish_reason == "stop"


def test_a_prompt_longer_than_the_context_is_refused():
    runner, _ = _runner(SCRIPT, max_model_len=20)
    with pytest.raises(PromptTooLongError):
        _run(runner)


def test_a_task_with_min_tokens_is_refused_before_any_session_opens():
    """vLLM's min_tokens would hold every turn open past its close token (a learner configured apart from the
    generator's environment can still send one)."""
    runner, _ = _runner(SCRIPT)
    task = _task()
    task = task.model_copy(update={"sampling": task.sampling.model_copy(update={"min_tokens": 4})})
    with pytest.raises(InvalidPromptError, match="min_tokens = 4 with an environment"):
        _run(runner, task)
    assert runner.environment.stats.sessions_opened == 0


def test_an_environment_fault_abandons_the_prompt_and_closes_every_session():
    runner, _ = _runner([tool_call("wait", seconds=5)], env="StuckEnv", timeout_s=0.2)
    with pytest.raises(EnvFault):
        _run(runner)
    stats = runner.environment.stats
    assert stats.sessions_opened == stats.sessions_closed == 3


def test_weights_that_go_back_between_turns_make_the_group_sample_again():
    runner, engine = _runner(SCRIPT)
    real = engine.sample_turn

    async def going_back(*args):
        turn = await real(*args)
        engine.policy_version = 1
        return turn

    engine.sample_turn = going_back
    with pytest.raises(RolledBack):
        _run(runner)


def test_budget_arithmetic():
    assert turn_budget(100, 1000, 50, 40).max_tokens == 60
    assert turn_budget(100, 120, 50, 40).max_tokens == 30
    assert turn_budget(100, 1000, 50, 100).cut == "token_budget"
    assert turn_budget(1000, 100, 50, 50).cut == "context"
    assert delta_room(100, 1000, 10, 50, 49) is None and delta_room(100, 1000, 10, 50, 50) == "token_budget"
    assert delta_room(1000, 100, 10, 50, 39) is None and delta_room(1000, 100, 10, 50, 40) == "context"


def test_a_push_between_turns_shows_in_the_token_versions_and_the_group_takes_the_oldest():
    runner, engine = _runner(SCRIPT)
    real = engine.sample_turn

    async def pushed_after_each_turn(*args):
        turn = await real(*args)
        engine.policy_version += 1  # a weight push lands between this turn and the next
        return turn

    engine.sample_turn = pushed_after_each_turn
    group = _run(runner)
    for completion in group.completions:
        sampled = completion.token_versions[completion.loss_mask.astype(bool)]
        assert sampled.min() < sampled.max()
    oldest = min(int(c.token_versions[c.loss_mask.astype(bool)].min()) for c in group.completions)
    assert group.policy_version == oldest == 3 and group.finished_policy_version == engine.policy_version
