"""One logging set-up and small Prometheus helpers for every service.

Metric names follow TRL where it has a name for the same figure (``reward_std``, ``clip_ratio/low_mean``);
Prometheus does not allow ``/`` in names, so :func:`prometheus_name` maps ``reward/std`` to
``asyncgrpo_reward_std`` when a flat metrics dict is exported as gauges. A reward function's figure
``rewards/<function>/<figure>`` becomes one family per figure with the function as a label
(:func:`split_labels`): ``asyncgrpo_rewards_mean{function="accuracy"}``.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from shared.redaction import redact

_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(service)s] %(message)s"


class _ServiceFilter(logging.Filter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def filter(self, record: logging.LogRecord) -> bool:
        record.service = self.service
        return True


class RedactingFormatter(logging.Formatter):
    """Every line, tracebacks included, through :func:`shared.redaction.redact`: an exception that quotes a URL
    with its credentials says them nowhere."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


def setup_logging(service: str, level: str = "INFO") -> None:
    """Log to stderr with the service name on every line, redacted; quiet the chattiest libraries."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(RedactingFormatter(_FORMAT))
    handler.addFilter(_ServiceFilter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("httpx", "httpcore", "urllib3", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLevelName(level)))


def prometheus_name(name: str, namespace: str = "asyncgrpo") -> str:
    """``clip_ratio/low_mean`` -> ``asyncgrpo_clip_ratio_low_mean`` (a valid Prometheus name)."""
    return f"{namespace}_{re.sub(r'[^a-zA-Z0-9_]', '_', name)}"


def split_labels(name: str) -> tuple[str, dict[str, str]]:
    """``rewards/accuracy/mean`` -> (``rewards/mean``, {"function": "accuracy"}), and the same under ``eval/``;
    any other name unchanged with no label. The figure is the last segment, so a function name may itself
    hold ``/``."""
    for prefix in ("rewards/", "eval/rewards/"):
        if name.startswith(prefix) and name.count("/") >= prefix.count("/") + 1:
            function, figure = name[len(prefix) :].rsplit("/", 1)
            return f"{prefix}{figure}", {"function": redact(function)}
    return name, {}


def _families(values: Mapping[str, float]) -> dict[str, dict[tuple[str, ...], float]]:
    """Family name -> {label values: value}; the label names are ``("function",)`` or none."""
    families: dict[str, dict[tuple[str, ...], float]] = {}
    for name, value in values.items():
        family, labels = split_labels(name)
        families.setdefault(family, {})[tuple(labels.values())] = float(value)
    return families


class MetricsGauges:
    """Exports a flat ``{name: float}`` dict (the services' metric vocabulary) as Prometheus gauges."""

    def __init__(self, prometheus: CollectorRegistry) -> None:
        self.prometheus = prometheus
        self._gauges: dict[str, Gauge] = {}

    def update(self, metrics: Mapping[str, float]) -> None:
        for name, value in metrics.items():
            family, labels = split_labels(name)
            gauge = self._gauges.get(family)
            if gauge is None:
                gauge = Gauge(prometheus_name(family), f"{family} (last value)", list(labels), registry=self.prometheus)
                self._gauges[family] = gauge
            (gauge.labels(**labels) if labels else gauge).set(float(value))


class CallbackCollector(Collector):
    """Collects counters and gauges read from live objects at scrape time (no double bookkeeping)."""

    def __init__(
        self,
        counters: Callable[[], Mapping[str, float]] = dict,
        gauges: Callable[[], Mapping[str, float]] = dict,
    ) -> None:
        self._counters = counters
        self._gauges = gauges

    def collect(self):
        for kind, values in ((CounterMetricFamily, self._counters()), (GaugeMetricFamily, self._gauges())):
            for family, samples in _families(values).items():
                labelled = [key for key in samples if key]
                metric = kind(prometheus_name(family), family, labels=["function"] if labelled else None)
                for key, value in samples.items():
                    metric.add_metric(list(key), value)
                yield metric
