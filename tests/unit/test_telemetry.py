"""Prometheus export: reward-function names are a ``function`` label, not part of the metric name."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from shared.telemetry import CallbackCollector, MetricsGauges, split_labels


def _exposition(prometheus: CollectorRegistry) -> list[str]:
    return [line for line in generate_latest(prometheus).decode().splitlines() if not line.startswith("#")]


def test_split_labels_takes_the_function_out_of_reward_figures():
    assert split_labels("rewards/accuracy/mean") == ("rewards/mean", {"function": "accuracy"})
    assert split_labels("rewards/my.mod:judge/v2/errors") == ("rewards/errors", {"function": "my.mod:judge/v2"})
    assert split_labels("clip_ratio/low_mean") == ("clip_ratio/low_mean", {})
    assert split_labels("reward_std") == ("reward_std", {})
    assert split_labels("eval/rewards/correctness/mean") == ("eval/rewards/mean", {"function": "correctness"})
    assert split_labels("eval/reward") == ("eval/reward", {})


def test_callback_collector_exports_one_family_per_figure_with_a_function_label():
    prometheus = CollectorRegistry()
    counters = {"rewards/judge/errors": 3, "rewards/format/errors": 1, "scorer/group_retries": 2}
    gauges = {"rewards/judge/breaker_open": 1.0, "scorer/groups_held": 0.0}
    prometheus.register(CallbackCollector(lambda: counters, lambda: gauges))
    assert _exposition(prometheus) == [
        'asyncgrpo_rewards_errors_total{function="judge"} 3.0',
        'asyncgrpo_rewards_errors_total{function="format"} 1.0',
        "asyncgrpo_scorer_group_retries_total 2.0",
        'asyncgrpo_rewards_breaker_open{function="judge"} 1.0',
        "asyncgrpo_scorer_groups_held 0.0",
    ]


def test_metrics_gauges_label_the_reward_functions():
    prometheus = CollectorRegistry()
    gauges = MetricsGauges(prometheus)
    gauges.update({"rewards/accuracy/mean": 0.5, "rewards/format/mean": 0.25, "reward": 0.75})
    gauges.update({"rewards/accuracy/mean": 1.0})
    assert _exposition(prometheus) == [
        'asyncgrpo_rewards_mean{function="accuracy"} 1.0',
        'asyncgrpo_rewards_mean{function="format"} 0.25',
        "asyncgrpo_reward 0.75",
    ]
