"""The demo's report: training correctness and held-out accuracy read back from metrics.jsonl, the goals it
checks (a missed goal is named with its numbers), and the PNG."""

from __future__ import annotations

import json

import pytest

from services.launcher.demo import GOAL_EVAL_GAIN, WINDOW, read_result


def _metrics(tmp_path, correctness: list[float], evaluations: dict[int, float]):
    records = []
    for step, value in enumerate(correctness, start=1):
        records.append(
            {"step": step, "reward": 0.9 * value, "rewards/correctness/mean": value, "rewards/hard_format/mean": 1}
        )
    for step, accuracy in evaluations.items():
        records.append({"step": step, "eval/rewards/correctness/mean": accuracy, "eval/prompts": 100})
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
