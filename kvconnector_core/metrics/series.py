"""The Prometheus series kvconnector exports, defined once for its engine and for vLLM.

Every series is declared in :data:`SERIES` (name, type, help text, labels, scope); a
:class:`MetricSet` creates them through the metric classes it is given (prometheus-client's
``Counter``/``Gauge``/``Histogram`` bound to a registry in kvconnector's engine, the classes
vLLM's ``KVConnectorPromMetrics`` hands out inside vLLM) and records values by series name.
``docs/metrics.md`` describes each series; a test keeps that page and :data:`SERIES` in step.

Primitives: :class:`SeriesSpec`, :data:`SERIES`, :data:`TRANSFER_SECONDS_BUCKETS`,
:class:`MetricSet`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

__all__ = ["SERIES", "TRANSFER_SECONDS_BUCKETS", "MetricSet", "SeriesSpec"]

Kind = Literal["counter", "gauge", "histogram"]
Scope = Literal["engine", "connector"]


class SeriesSpec(NamedTuple):
    """One series.

    Attributes:
        name: the metric name without prefix; counters end in ``_total`` (as exposed).
        kind: ``"counter"``, ``"gauge"`` or ``"histogram"``.
        help: what it counts (the exposition's ``# HELP``).
        labels: its own label names (vLLM's per-engine labels come first inside vLLM).
        scope: ``"connector"`` series come from the connector's stats and exist in both
            kvconnector's engine and vLLM; ``"engine"`` series come from kvconnector's
            engine (inside vLLM, vLLM's own metrics count those things).
    """

    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...]
    scope: Scope


TRANSFER_SECONDS_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                            0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Buckets of ``kvconnector_transfer_seconds``: one step's transfer time, 100 us to 10 s."""

_C = ("connector",)

SERIES: tuple[SeriesSpec, ...] = (
    SeriesSpec("kvconnector_prompt_tokens_total", "counter",
               "Prompt tokens placed for the first time, by source: computed by the model, "
               "served from the GPU prefix cache, or loaded by the connector.",
               ("source",), "engine"),
    SeriesSpec("kvconnector_recomputed_tokens_total", "counter",
               "Prompt tokens computed or loaded again after a preemption or a failed load.",
               (), "engine"),
    SeriesSpec("kvconnector_preemptions_total", "counter",
               "Requests preempted (their KV is recomputed or reloaded later).", (), "engine"),
    SeriesSpec("kvconnector_failed_loads_total", "counter",
               "Requests rolled back and recomputed after a failed connector load.",
               (), "engine"),
    SeriesSpec("kvconnector_requests", "gauge",
               "Requests in the scheduler's queues, by queue: waiting, running, or finished "
               "and holding blocks until the connector's stores end (delayed_free).",
               ("queue",), "engine"),
    SeriesSpec("kvconnector_evictions_total", "counter",
               "KV blocks removed from a medium's cache (BlockRemoved events), by medium.",
               ("medium",), "engine"),
    SeriesSpec("kvconnector_kv_events_total", "counter",
               "KV cache events emitted, by event type and medium.",
               ("type", "medium"), "engine"),
    SeriesSpec("kvconnector_event_batches_published_total", "counter",
               "KV event batches sent on the ZeroMQ PUB socket.", (), "engine"),
    SeriesSpec("kvconnector_event_batches_dropped_total", "counter",
               "KV event batches dropped because the publisher's queue was full.",
               (), "engine"),
    SeriesSpec("kvconnector_transfer_bytes_total", "counter",
               "Bytes the connector moved, by direction: load (into GPU blocks) or store "
               "(out of them).", (*_C, "direction"), "connector"),
    SeriesSpec("kvconnector_transfer_seconds", "histogram",
               "Transfer time the connector reported per step (per logging interval in "
               "vLLM), by direction.", (*_C, "direction"), "connector"),
    SeriesSpec("kvconnector_tier_loads_total", "counter",
               "Chunks a secondary tier served (its hits), by tier.", (*_C, "tier"),
               "connector"),
    SeriesSpec("kvconnector_tier_stores_total", "counter",
               "Chunks written to a secondary tier, by tier.", (*_C, "tier"), "connector"),
    SeriesSpec("kvconnector_tier_lookups_total", "counter",
               "Lookups asked of a secondary tier, by tier.", (*_C, "tier"), "connector"),
    SeriesSpec("kvconnector_tier_transfer_bytes_total", "counter",
               "Bytes read from (load) or written to (store) a secondary tier.",
               (*_C, "tier", "direction"), "connector"),
    SeriesSpec("kvconnector_tier_failures_total", "counter",
               "Failed secondary-tier operations, by tier and operation (load, store, lookup).",
               (*_C, "tier", "operation"), "connector"),
    SeriesSpec("kvconnector_tier_stores_dropped_total", "counter",
               "Chunk stores a secondary tier dropped because its write queue was full.",
               (*_C, "tier"), "connector"),
    SeriesSpec("kvconnector_hook_errors_total", "counter",
               "Exceptions a connector raised in a hook, contained by the failure contract.",
               (*_C, "hook"), "connector"),
    SeriesSpec("kvconnector_quarantines_total", "counter",
               "Connector instances (one per role) quarantined after raising in a row.",
               _C, "connector"),
    SeriesSpec("kvconnector_connector_stat_total", "counter",
               "Every other number in the connector's stats, summed, by stats key.",
               (*_C, "stat"), "connector"),
    SeriesSpec("kvconnector_connector_gauge", "gauge",
               "Levels the connector reports under its stats' ``gauges`` key (queue depths, "
               "blocks pinned...), as last reported.", (*_C, "stat"), "connector"),
)
"""Every series; ``docs/metrics.md`` documents each one."""

MetricFactory = Callable[..., Any]


class MetricSet:
    """The series of some scopes, created through the given metric classes.

    Args:
        counter: ``Counter``-like class (``name, documentation, labelnames=...``).
        gauge: ``Gauge``-like class.
        histogram: ``Histogram``-like class (also takes ``buckets=``).
        prefix: put before every name (``"vllm:"`` inside vLLM, whose metric handling
            unregisters its own ``vllm:`` series when a logger is rebuilt).
        base_labels: label names before each series' own (vLLM's per-engine labels).
        scopes: which series to create.
    """

    def __init__(self, counter: MetricFactory, gauge: MetricFactory, histogram: MetricFactory,
                 *, prefix: str = "", base_labels: Sequence[str] = (),
                 scopes: Sequence[Scope] = ("engine", "connector")) -> None:
        self.base_labels = tuple(base_labels)
        self.specs = {s.name: s for s in SERIES if s.scope in scopes}
        self._metrics: dict[str, Any] = {}
        classes = {"counter": counter, "gauge": gauge}
        for spec in self.specs.values():
            # prometheus-client adds ``_total`` to a counter's samples itself.
            name = prefix + spec.name.removesuffix("_total")
            labelnames = [*self.base_labels, *spec.labels]
            if spec.kind == "histogram":
                metric = histogram(name, spec.help, labelnames=labelnames,
                                   buckets=TRANSFER_SECONDS_BUCKETS)
            else:
                metric = classes[spec.kind](name, spec.help, labelnames=labelnames)
            self._metrics[spec.name] = metric

    def _child(self, name: str, base: Sequence[object], labels: Mapping[str, str]) -> Any:
        metric = self._metrics[name]
        values = [*base, *(labels[label] for label in self.specs[name].labels)]
        return metric.labels(*values) if values else metric

    def inc(self, name: str, base: Sequence[object], labels: Mapping[str, str],
            value: float) -> None:
        """Add ``value`` (> 0; others are ignored) to counter ``name``."""
        if value > 0:
            self._child(name, base, labels).inc(value)

    def set(self, name: str, base: Sequence[object], labels: Mapping[str, str],
            value: float) -> None:
        """Set gauge ``name``."""
        self._child(name, base, labels).set(value)

    def observe(self, name: str, base: Sequence[object], labels: Mapping[str, str],
                value: float) -> None:
        """Record one observation of histogram ``name``."""
        self._child(name, base, labels).observe(value)
