"""Built-in rewards on hand-written cases; plugins with TRL's convention; validation; the breaker."""

from __future__ import annotations

import logging
import math

import httpx
import numpy as np
import pytest
from pydantic import ValidationError

from services.scorer.holding import retry_delay
from services.scorer.rewards.builtin import (
    correctness,
    digit,
    extract_answer,
    hard_format,
    make_overlong,
    mark,
    overlong_penalty,
    soft_format,
)
from services.scorer.rewards.functions import (
    RewardBatch,
    RewardBugError,
    RewardError,
    RewardFailure,
    RewardFunction,
    intake_state,
    run_function,
    score_batch,
    validate_rewards,
)
from services.scorer.rewards.trl_convention import trl_style
from services.scorer.scoring import reward_batch, scored_group
from services.scorer.scoring_loop import ScoringLoop
from shared.config.scorer import RewardSpec, ScorerSettings
from shared.records import AdvantageSpec, ChatMessage
from shared.resilience import CircuitBreaker, CircuitOpenError
from shared.reward_protocol import load_reward_function
from tests.support.factories import make_rollout, make_task

TAGGED = "<think>\n{reasoning}\n</think>\n<answer>\n{answer}\n</answer>"


def _classic():
    """Reference answer 72; completions answering 72, 60, 48 and 120, with and without correct tags."""
    tagged = [TAGGED.format(reasoning="48/2 = 24, 48 + 24 = 72", answer=a) for a in ("72", "60", "48", "120")]
    untagged = ["The answer is 72.", "#### 72", "<answer>60</answer>", "I think 48"]
    return tagged + untagged


def test_correctness_on_the_classic_example():
    completions = _classic()
    scores = correctness(prompts=[""] * 8, completions=completions, answer=["72"] * 8)
    # Tagged: only 72 is right. Untagged: "#### 72" is GSM8K's format and counts; plain prose does not.
    assert scores == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0]


def test_correctness_is_numeric_aware_and_uses_math_verify():
    completions = [
        "<answer>72.0</answer>",
        "<answer>1,000</answer>",
        "<answer>\\frac{1}{2}</answer>",
        "<answer>$72</answer>",
        "<answer>seventy-two</answer>",
    ]
    answers = ["72", "1000", "0.5", "72", "72"]
    assert correctness([""] * 5, completions, answer=answers) == [1.0, 1.0, 1.0, 1.0, 0.0]
    # A GSM8K reference ("... #### 72") is reduced to its final answer; a missing reference gives None.
    assert correctness([""] * 2, ["<answer>72</answer>"] * 2, answer=["so 48+24 #### 72", None]) == [
        1.0,
        None,
    ]


def test_digit_hard_soft_and_mark_on_the_classic_example():
    completions = _classic()
    assert digit([""] * 8, completions) == [1.0] * 4 + [0.0, 1.0, 1.0, 0.0]
    assert hard_format([""] * 8, completions) == [1.0] * 4 + [0.0] * 4
    assert soft_format([""] * 8, [*completions, "noise <think>a</think> x <answer>1</answer> tail"])[-1] == 1.0
    assert hard_format([""], ["noise <think>a</think><answer>1</answer>"]) == [0.0]
    assert mark([""] * 8, completions) == [1.0] * 4 + [0.0, 0.0, 0.5, 0.0]
    assert mark([""], ["<think><think></think>"]) == [0.25]


def test_rewards_accept_trl_conversational_completions():
    chat = [[{"role": "assistant", "content": TAGGED.format(reasoning="r", answer="72")}]]
    assert correctness([[]], chat, answer=["72"]) == [1.0]
    assert hard_format([[]], chat) == [1.0]


def test_extract_answer_takes_the_last_answer_tag():
    assert extract_answer("<answer>1</answer> then <answer> 2 </answer>") == "2"
    assert extract_answer("no answer") is None


def test_overlong_penalty_is_dapo_soft_punishment():
    assert overlong_penalty(80, 100, 20) == 0.0  # up to max - buffer: no penalty
    assert overlong_penalty(85, 100, 20) == pytest.approx(-0.25)  # (80 - 85) / 20
    assert overlong_penalty(95, 100, 20) == pytest.approx(-0.75)  # (80 - 95) / 20
    assert overlong_penalty(100, 100, 20) == pytest.approx(-1.0)
    assert overlong_penalty(101, 100, 20) == -1.0
    overlong = make_overlong(buffer=20)
    assert overlong([""] * 2, ["", ""], [[0] * 80, [0] * 90], max_completion_length=[100, 100]) == [0.0, -0.5]
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(1, 10, 0)


def test_validate_rewards():
    values = validate_rewards("f", [1, None, 0.5, True], 4)
    assert values[0] == 1.0 and math.isnan(values[1]) and values[2:] == [0.5, 1.0]
    with pytest.raises(RewardError, match="returned 2 rewards for 3 completions"):
        validate_rewards("f", [1.0, 2.0], 3)
    with pytest.raises(RewardError, match="str among its rewards"):
        validate_rewards("f", ["1"], 1)
    with pytest.raises(RewardError, match="infinite"):
        validate_rewards("f", [math.inf], 1)


async def test_trl_documentation_functions_run_unchanged():
    text_batch = RewardBatch(
        prompts=["p", "p"],
        completions=["\\boxed{4}", "short"],
        completion_ids=[[1], [2]],
        columns={"ground_truth": ["4", "4"]},
    )
    chat_batch = RewardBatch(
        prompts=[[], []],
        completions=[
            [{"role": "assistant", "content": "<think>a</think><answer>b</answer>"}],
            [{"role": "assistant", "content": "nope"}],
        ],
        completion_ids=[[1], []],
        columns={},
    )
    functions = {
        name: trl_style(name, load_reward_function(f"tests.support.trl_doc_rewards:{name}"), in_thread=True)
        for name in ("reward_len", "format_reward_func", "reward_func", "async_reward", "broken_reward")
    }
    text = await score_batch([functions["reward_len"], functions["reward_func"]], text_batch)
    np.testing.assert_allclose(text, [[-11.0, 1.0], [-15.0, 0.0]])
    chat = await score_batch(
        [functions["format_reward_func"], functions["async_reward"], functions["broken_reward"]], chat_batch
    )
    assert chat[:, 0].tolist() == [1.0, 0.0]
    assert chat[0, 1] == 0.5 and math.isnan(chat[1, 1])  # async; None -> NaN
    assert np.isnan(chat[:, 2]).all()  # a failing function gives NaN, never 0
    assert functions["broken_reward"].stats.errors == 1
    assert "always fails" in functions["broken_reward"].stats.last_error


def test_plugin_paths_are_checked():
    with pytest.raises(ValueError, match="module:function"):
        load_reward_function("no_colon")
    with pytest.raises(ValueError, match="cannot import"):
        load_reward_function("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="no callable"):
        load_reward_function("tests.support.trl_doc_rewards:missing")


def test_circuit_breaker_opens_half_opens_lets_one_trial_through_and_closes(caplog):
    now = [0.0]
    breaker = CircuitBreaker("judge", threshold=2, reset_s=10, clock=lambda: now[0])
    caplog.set_level(logging.WARNING, logger="shared.resilience")
    assert breaker.before_call() is False
    breaker.failure("group g1: HTTP 503; body 'boom'")
    assert breaker.refresh() == "closed"
    breaker.failure("group g2: ConnectError: refused")
    assert breaker.state == "open" and breaker.seconds_until_trial() == 10
    with pytest.raises(CircuitOpenError, match=r"breaker open after 2 consecutive failures.*ConnectError"):
        breaker.before_call()
    now[0] = 10.0
    assert breaker.refresh() == "half_open"
    assert breaker.before_call() is True  # the trial
    with pytest.raises(CircuitOpenError):
        breaker.before_call()  # only one trial at a time
    breaker.failure("group g3: ReadTimeout: no answer within timeout_s=1", trial=True)
    assert breaker.state == "open" and breaker.trips == 2
    now[0] = 20.0
    trial = breaker.before_call()
    breaker.success(trial)
    assert breaker.state == "closed" and breaker.failures == 0
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert [m.split(" (")[0] for m in messages] == [
        "reward judge: breaker open",
        "reward judge: breaker half-open",
        "reward judge: breaker open",
        "reward judge: breaker half-open",
        "reward judge: breaker closed",
    ]
    assert "last error: group g2: ConnectError: refused" in messages[0]
    assert "last error: group g3: ReadTimeout" in messages[-1]


def test_retry_delay_backs_off_tries_at_the_breakers_trial_and_keeps_the_deadline():
    assert [retry_delay(a, 1.0, 30.0, None, 1e9) for a in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    assert retry_delay(6, 1.0, 30.0, until_trial_s=2.5, remaining_s=100.0) == 2.5  # open: at the trial
    assert retry_delay(0, 1.0, 30.0, until_trial_s=12.0, remaining_s=100.0) == 12.0
    assert retry_delay(5, 1.0, 30.0, until_trial_s=None, remaining_s=3.5) == 3.5


async def test_required_and_optional_failures_are_reported_with_the_group_and_where(caplog):
    batch = RewardBatch(["p"], ["x"], [[1]], {}, group_id="g-42")
    broken = trl_style("broken", load_reward_function("tests.support.trl_doc_rewards:broken_reward"), in_thread=True)
    result = await run_function(broken, batch)
    assert isinstance(result, RewardFailure) and result.group_id == "g-42"
    assert result.detail.startswith("RuntimeError: this plugin always fails (at trl_doc_rewards.py:")
    assert "in broken_reward" in result.detail
    assert "group g-42" in caplog.text and "a bug in the function, the scorer stops" in caplog.text
    assert "Traceback" in caplog.text  # a function's first bug carries the traceback
    optional = trl_style("opt", lambda completions, **kw: [1.0, 2.0], in_thread=False, required=False)
    result = await run_function(optional, batch)
    assert "returned 2 rewards for 1 completions" in result.detail
    assert "its rewards are NaN for this group" in caplog.text


def _raising_on(calls: set[int], exc: Exception):
    """A TRL-style function that raises ``exc`` on the given call numbers (1-based) and answers 1.0 otherwise."""
    count = [0]

    def function(completions, **kwargs):
        count[0] += 1
        if count[0] in calls:
            raise exc
        return [1.0] * len(completions)

    return function


@pytest.mark.parametrize(
    ("exc", "bug"),
    [
        (KeyError("answer"), True),
        (TypeError("expected string or bytes-like object, got 'list'"), True),
        (ConnectionError("judge still loading"), False),
        (TimeoutError(), False),
        (httpx.ConnectError("refused"), False),
        (httpx.HTTPStatusError("503", request=httpx.Request("POST", "http://j"), response=httpx.Response(503)), False),
    ],
)
async def test_a_python_functions_exception_is_a_bug_unless_it_is_an_outage(exc, bug):
    batch = RewardBatch(["p"], ["x"], [[1]], {}, group_id="g")
    function = trl_style("f", _raising_on({1}, exc), in_thread=False)
    failure = await run_function(function, batch)
    assert isinstance(failure, RewardFailure) and failure.bug is bug
    assert function.stats.bugs == int(bug) and function.stats.errors == 1
    assert function.stats.as_metrics("f")["rewards/f/bugs"] == int(bug)


async def test_wrong_answers_are_bugs_of_python_functions_but_not_of_http_plugins():
    batch = RewardBatch(["p"], ["x"], [[1]], {}, group_id="g")
    python = trl_style("py", lambda completions, **kw: [1.0, 2.0], in_thread=False)
    assert (await run_function(python, batch)).bug
    plugin = RewardFunction("http", _plugin_that_raises)  # what an HTTP plugin's call looks like
    assert not (await run_function(plugin, batch)).bug


async def _plugin_that_raises(batch):
    raise RewardError("HTTP 200 with 2 rewards for 1 items")


async def test_a_bugs_traceback_is_logged_once_per_function(caplog):
    batch = RewardBatch(["p"], ["x"], [[1]], {}, group_id="g")
    function = trl_style("buggy", _raising_on({1, 3, 4}, ValueError("bad row")), in_thread=False, required=False)
    caplog.set_level(logging.WARNING, logger="services.scorer.rewards.functions")
    results = [await run_function(function, batch) for _ in range(4)]
    assert [isinstance(r, RewardFailure) for r in results] == [True, False, True, True]
    records = [r for r in caplog.records if "reward buggy" in r.getMessage()]
    assert [r.levelno for r in records] == [logging.ERROR, logging.WARNING, logging.WARNING]
    assert [r.exc_info is not None for r in records] == [True, False, False]  # once, not after each success
    assert "its rewards are NaN for this group (required = false)" in records[0].getMessage()
    assert "(3 so far)" in records[-1].getMessage() and function.stats.bugs == 3


async def test_a_required_rewards_bug_stops_scoring_instead_of_holding_the_group():
    """An exception in a required Python reward is a bug: the loop raises at once (the scorer exits) rather
    than holding the group for max_reward_wait_s like an outage; an outage is still held and retried."""
    rollout = make_rollout(make_task(group_size=2))
    buggy = trl_style("buggy", _raising_on({1, 2, 3}, ValueError("bad row")), in_thread=False)
    loop = ScoringLoop(None, None, [buggy], [1.0], AdvantageSpec(), drop_zero_std=False, max_in_flight=1)
    with pytest.raises(RewardBugError, match=r"required reward buggy on group .*ValueError: bad row.*set required"):
        await loop.score_rewards(rollout)
    assert buggy.stats.calls == 1
    flaky = trl_style("flaky", _raising_on({1, 2}, ConnectionError("judge loading")), in_thread=False)
    loop = ScoringLoop(
        None, None, [flaky], [1.0], AdvantageSpec(), drop_zero_std=False, max_in_flight=1, retry_backoff_s=0.01
    )
    assert (await loop.score_rewards(rollout)).tolist() == [[1.0], [1.0]] and flaky.stats.calls == 3


def test_intake_state_follows_required_breakers_only():
    now = [0.0]
    required = trl_style("req", lambda **kw: [], in_thread=False)
    optional = trl_style("opt", lambda **kw: [], in_thread=False, required=False)
    for function in (required, optional):
        function.breaker = CircuitBreaker(function.name, threshold=1, reset_s=5, clock=lambda: now[0])
    assert intake_state([required, optional]) == ("closed", [])
    optional.breaker.failure("down")
    assert intake_state([required, optional]) == ("closed", [])
    required.breaker.failure("group g: HTTP 502; empty body")
    state, reasons = intake_state([required, optional])
    assert state == "open" and reasons[0].startswith("reward req: breaker open after 1 consecutive failures")
    now[0] = 5.0
    assert intake_state([required, optional])[0] == "half_open"


def test_reward_spec_validation_messages():
    with pytest.raises(ValidationError, match="unknown reward 'corectness': built-ins are correctness"):
        RewardSpec(name="corectness")
    with pytest.raises(ValidationError, match="must start with http:// or https://"):
        RewardSpec(name="judge", url="ftp://host/score")
    with pytest.raises(ValidationError, match="takes no parameter buffer"):
        RewardSpec(name="mark", params={"buffer": 3})
    with pytest.raises(ValidationError, match="repeated: mark"):
        ScorerSettings(rewards=[RewardSpec(name="mark"), RewardSpec(name="mark")])
    with pytest.raises(ValidationError, match=r"BNPO needs the combined reward inside \[reward_min, reward_max\]"):
        ScorerSettings(estimator="bnpo", rewards=[RewardSpec(name="mark"), RewardSpec(name="correctness")])
    ScorerSettings(estimator="bnpo", reward_max=2.0, rewards=[RewardSpec(name="mark"), RewardSpec(name="correctness")])


def test_reward_batch_follows_trl_and_prepends_the_prefill():
    task = make_task(
        group_size=2,
        prompt=(ChatMessage(role="user", content="2+3?"), ChatMessage(role="assistant", content="<think>")),
    )
    rollout = make_rollout(task)
    batch = reward_batch(rollout)
    assert batch.completions[0] == [{"role": "assistant", "content": "<think>" + rollout.completions[0].text}]
    assert batch.columns["answer"] == ["5", "5"]
    assert batch.columns["max_completion_length"] == [32, 32]
    text_batch = reward_batch(make_rollout(make_task(group_size=2, prompt="plain")))
    assert text_batch.prompts == ["plain", "plain"] and isinstance(text_batch.completions[0], str)


def test_scored_group_combines_marks_zero_std_and_keeps_nan():
    rollout = make_rollout(make_task(group_size=4))
    per_func = np.array([[1, np.nan], [0, np.nan], [1, np.nan], [0, np.nan]], dtype=np.float32)
    group = scored_group(rollout, ["a", "b"], [2.0, 1.0], per_func, AdvantageSpec(), drop_zero_std=True)
    assert group.rewards.tolist() == [2.0, 0.0, 2.0, 0.0]
    assert not group.zero_std and not group.dropped
    assert group.metrics["rewards/a/mean"] == 0.5 and math.isnan(group.metrics["rewards/b/mean"])
    flat = np.ones((4, 2), dtype=np.float32)
    same = scored_group(rollout, ["a", "b"], [1.0, 1.0], flat, AdvantageSpec(), drop_zero_std=True)
    assert same.zero_std and same.dropped and same.advantages.tolist() == [0.0] * 4


def test_plugin_auth_settings_resolve_and_never_show_in_the_logged_settings(monkeypatch):
    monkeypatch.setenv("JUDGE_TOKEN", "env-secret-1")
    specs = [
        RewardSpec(name="a", url="http://judge/score", bearer_token="inline-secret-2"),
        RewardSpec(name="b", url="http://judge/score", bearer_token_env="JUDGE_TOKEN"),
        RewardSpec(name="c", url="http://judge/score", headers={"X-Api-Key": "header-secret-3"}),
    ]
    assert specs[0].request_headers() == {"Authorization": "Bearer inline-secret-2"}
    assert specs[1].request_headers() == {"Authorization": "Bearer env-secret-1"}
    assert specs[2].request_headers() == {"X-Api-Key": "header-secret-3"}
    logged = str(ScorerSettings(rewards=specs).masked())
    for secret in ("env-secret-1", "inline-secret-2", "header-secret-3"):
        assert secret not in logged
    assert "JUDGE_TOKEN" in logged  # the variable's name is not a secret
    unset = RewardSpec(name="d", url="http://judge/score", bearer_token_env="NO_SUCH_VAR_XYZ")  # valid file
    assert "'NO_SUCH_VAR_XYZ', which is not set" in " ".join(ScorerSettings(rewards=[unset]).start_problems())
    assert ScorerSettings(rewards=specs).start_problems() == []
    with pytest.raises(ValidationError, match="not both"):
        RewardSpec(name="d", url="http://judge/score", bearer_token="x", bearer_token_env="JUDGE_TOKEN")
    with pytest.raises(ValidationError, match="an Authorization header and a bearer token"):
        RewardSpec(name="d", url="http://judge/score", bearer_token="x", headers={"authorization": "y"})
    with pytest.raises(ValidationError, match="for HTTP plugins"):
        RewardSpec(name="digit", bearer_token="x")
    with pytest.raises(ValidationError, match="raise retry_backoff_max_s"):
        ScorerSettings(retry_backoff_s=60, retry_backoff_max_s=30)
    assert RewardSpec(name="digit").required and ScorerSettings().max_reward_wait_s >= 600


def test_the_config_catalogue_names_exactly_the_built_ins_the_scorer_implements():
    from services.scorer.rewards.builtin import BUILTINS
    from shared.config.scorer import BUILTIN_PARAMS, BUILTIN_RANGES

    assert set(BUILTIN_RANGES) == set(BUILTINS), "name every built-in in shared/config/scorer.py BUILTIN_RANGES"
    assert set(BUILTIN_PARAMS) <= set(BUILTINS)
