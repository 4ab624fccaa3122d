"""One logging set-up and small Prometheus helpers for every service.

Metric names follow TRL where it has a name for the same figure (``reward_std``, ``clip_ratio/low_mean``);
Prometheus does not allow ``/`` in names, so :func:`prometheus_name` maps ``reward/std`` to
``asyncgrpo_reward_std`` when a flat metrics dict is exported as gauges.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(service)s] %(message)s"


class _ServiceFilter(logging.Filter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def filter(self, record: logging.LogRecord) -> bool:
        record.service = self.service
        return True


def setup_logging(service: str, level: str = "INFO") -> None:
    """Log to stderr with the service name on every line; quiet the chattiest libraries."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT))
    handler.addFilter(_ServiceFilter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("httpx", "httpcore", "urllib3", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLevelName(level)))


def prometheus_name(name: str, namespace: str = "asyncgrpo") -> str:
    """``clip_ratio/low_mean`` -> ``asyncgrpo_clip_ratio_low_mean`` (a valid Prometheus name)."""
    return f"{namespace}_{re.sub(r'[^a-zA-Z0-9_]', '_', name)}"


class MetricsGauges:
    """Exports a flat ``{name: float}`` dict (the services' metric vocabulary) as Prometheus gauges."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._gauges: dict[str, Gauge] = {}

    def update(self, metrics: Mapping[str, float]) -> None:
        for name, value in metrics.items():
            gauge = self._gauges.get(name)
            if gauge is None:
                gauge = Gauge(prometheus_name(name), f"{name} (last value)", registry=self.registry)
                self._gauges[name] = gauge
            gauge.set(float(value))


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
        for name, value in self._counters().items():
            yield CounterMetricFamily(prometheus_name(name), name, value=float(value))
        for name, value in self._gauges().items():
            yield GaugeMetricFamily(prometheus_name(name), name, value=float(value))
