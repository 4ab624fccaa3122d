"""The demo's report: training correctness and held-out accuracy read back from metrics.jsonl, the goals it
checks (a missed goal is named with its numbers), and the PNG; the tool-use demo's (``demo --tools``) tool-call
frequency and its goals, and its configuration as the run directory's copy."""

from __future__ import annotations

import json

import pytest

from services.launcher.demo import GOAL_EVAL_GAIN, WINDOW, read_result
from tests.support.processes import ROOT


def _metrics(tmp_path, correctness: list[float], evaluations: dict[int, float], calls=(), eval_calls=None):
    records = []
    for step, value in enumerate(correctness, start=1):
        records.append(
            {"step": step, "reward": 0.9 * value, "rewards/correctness/mean": value, "rewards/hard_format/mean": 1}
        )
        if calls:
            records[-1]["tools/call_frequency"] = calls[step - 1]
    for step, accuracy in evaluations.items():
        records.append({"step": step, "eval/rewards/correctness/mean": accuracy, "eval/prompts": 100})
        if eval_calls:
            records[-1]["eval/tools/call_frequency"] = eval_calls[step]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_a_run_that_learned_meets_both_goals(tmp_path):
    correctness = [0.3] * WINDOW + [0.5] * 5 + [0.6] * WINDOW
    result = read_result(_metrics(tmp_path, correctness, {0: 0.60, 25: 0.80}))
    assert result.steps == list(range(1, 26))
    assert result.train_gain() == pytest.approx((0.3, 0.6))
    assert result.eval_gain() == (0.60, 0.80)
    assert sorted(result.parts) == ["correctness", "hard_format"]
    assert result.missed_goals() == []


def test_a_run_that_learned_only_the_format_misses_them_with_its_numbers(tmp_path):
    correctness = [0.3] * WINDOW + [0.35] * WINDOW
    result = read_result(_metrics(tmp_path, correctness, {0: 0.60, 20: 0.60 + GOAL_EVAL_GAIN - 0.01}))
    missed = result.missed_goals()
    assert len(missed) == 2
    assert "held-out accuracy 0.600 -> 0.740" in missed[0]
    assert f"first {WINDOW} steps 0.300, last {WINDOW} 0.350" in missed[1]


def test_a_run_without_evaluations_or_with_too_few_steps_misses_them(tmp_path):
    result = read_result(_metrics(tmp_path, [0.1, 0.9], {}))
    assert len(result.missed_goals()) == 2  # no accuracy to compare, and 2 steps are not two windows


def test_the_plot_is_written(tmp_path):
    from services.launcher.demo import plot

    result = read_result(_metrics(tmp_path, [0.2, 0.4, 0.5], {0: 0.5, 3: 0.7}))
    plot(result, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_tool_demo_meets_its_goals_on_accuracy_and_training_tool_calls(tmp_path):
    steps = 2 * WINDOW
    calls = [0.3] * WINDOW + [0.9] * WINDOW
    result = read_result(_metrics(tmp_path, [0.1] * steps, {0: 0.0, steps: 0.2}, calls))
    assert result.tool_calls == calls and result.eval_tool_calls == {}
    assert result.tool_gain() == pytest.approx((0.3, 0.9, "training"))
    assert result.missed_goals(tools=True) == []
    assert len(result.missed_goals()) == 1  # the single-turn demo's training-correctness goal is not the tools'


def test_the_tool_demo_misses_when_tool_calls_do_not_rise_or_accuracy_does_not(tmp_path):
    steps = 2 * WINDOW
    flat = read_result(_metrics(tmp_path, [0.1] * steps, {0: 0.0, steps: 0.3}, [0.5] * steps))
    [missed] = flat.missed_goals(tools=True)
    assert "tool-call frequency (training) 0.500 -> 0.500" in missed
    short = read_result(_metrics(tmp_path, [0.1] * 4, {0: 0.0, 4: 0.3}, [0.1, 0.2, 0.8, 0.9]))
    assert "over at least" in short.missed_goals(tools=True)[0]  # 4 steps are not two windows
    no_gain = read_result(_metrics(tmp_path, [0.1] * steps, {0: 0.0, steps: 0.1}, [0.1] * 10 + [0.9] * 10))
    assert no_gain.missed_goals(tools=True) == ["held-out accuracy 0.000 -> 0.100: the goal is a gain of +0.15"]


def test_held_out_tool_calls_are_used_where_the_evaluation_records_them(tmp_path):
    steps = 2 * WINDOW
    metrics = _metrics(tmp_path, [0.1] * steps, {0: 0.0, 10: 0.1, steps: 0.4}, [0.9] * 10 + [0.1] * 10,
                       eval_calls={0: 0.2, 10: 0.5, steps: 0.6})  # fmt: skip
    result = read_result(metrics)
    assert result.tool_gain() == (0.2, 0.6, "held-out")
    assert result.missed_goals(tools=True) == []  # the training figure fell; the held-out one decides


def test_the_tool_plot_is_written(tmp_path):
    from services.launcher.demo import plot_tools

    result = read_result(_metrics(tmp_path, [0.2, 0.4, 0.5], {0: 0.0, 3: 0.3}, [0.1, 0.5, 0.7], {0: 0.0, 3: 0.8}))
    plot_tools(result, tmp_path / "tools.png")
    assert (tmp_path / "tools.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("argv", "config", "tools"),
    [
        (["demo"], ROOT / "configs" / "demo-cpu.toml", False),
        (["demo", "--tools"], ROOT / "configs" / "demo-tools-cpu.toml", True),
        (["demo", "--tools", "--config", "mine.toml"], "mine.toml", True),
    ],
)
def test_the_cli_runs_the_demo_it_is_asked_for(monkeypatch, argv, config, tools):
    """``make demo`` and ``make demo-tools`` (the run itself takes minutes: its entry point is recorded)."""
    from pathlib import Path

    from services.launcher import cli

    calls = []
    monkeypatch.setattr(cli, "run_demo", lambda *args, **kwargs: calls.append((args, kwargs)) or 7)
    assert cli.main(argv) == 7
    assert calls == [((Path(config), None), {"tools": tools, "quick": False})]
