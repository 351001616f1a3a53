"""kvconnector's engine on Prometheus: a collector that reads an engine after each step.

:class:`EngineMetrics` owns a prometheus-client registry holding every series of
:data:`~kvconnector_core.metrics.series.SERIES`. :meth:`EngineMetrics.update` reads the
engine's cumulative counters (the scheduler's token accounting and queues, the connector's
summed stats on both sides, the contained hook errors, the KV events and the event
publisher's counters) and adds what changed since the previous call; called after every
step (``kvconnector run`` does), the transfer-time histograms get one observation per
step. The registry is served over HTTP (:meth:`EngineMetrics.serve`) or written as
exposition text (:meth:`EngineMetrics.write`), both by prometheus-client itself.

Primitives: :class:`EngineMetrics`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvconnector_core.metrics.connector_stats import record_connector_stats
from kvconnector_core.metrics.series import MetricSet

if TYPE_CHECKING:
    from kvconnector_core.engine.engine import Engine

__all__ = ["EngineMetrics"]

_SOURCES = (("computed", "num_prefill_tokens_computed"),
            ("gpu_prefix_cache", "num_gpu_cache_hit_tokens"),
            ("connector", "num_connector_hit_tokens"))
_ENGINE_COUNTERS = (("kvconnector_recomputed_tokens_total", "num_recomputed_tokens"),
                    ("kvconnector_preemptions_total", "num_preemptions"),
                    ("kvconnector_failed_loads_total", "num_failed_loads_recovered"))
_PUBLISHER = (("kvconnector_event_batches_published_total", "sent"),
              ("kvconnector_event_batches_dropped_total", "dropped"))


def _split_gauges(stats: Mapping[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """The engine's folded stats as ``(counters, gauges)``; gauge keys lose their
    ``gauges`` segment (``children.a.gauges.pinned`` -> ``children.a.pinned``)."""
    counters: dict[str, float] = {}
    gauges: dict[str, float] = {}
    for key, value in stats.items():
        parts = key.split(".")
        if "gauges" in parts:
            gauges[".".join(p for p in parts if p != "gauges")] = value
        else:
            counters[key] = value
    return counters, gauges


class EngineMetrics:
    """Every series of kvconnector's engine, on a registry of its own.

    Args:
        registry: where the series go (default: a new ``CollectorRegistry``, so that
            two runs in one process never collide on the global one).
    """

    def __init__(self, registry: Any = None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry() if registry is None else registry
        bound = [functools.partial(cls, registry=self.registry)
                 for cls in (Counter, Gauge, Histogram)]
        self.metrics = MetricSet(*bound)
        self._seen: dict[str, float] = {}

    def _delta(self, key: str, now: float) -> float:
        before = self._seen.get(key, 0)
        self._seen[key] = now
        return now - before

    def _deltas(self, prefix: str, now: Mapping[str, float]) -> dict[str, float]:
        out = {key: self._delta(prefix + key, value) for key, value in now.items()}
        return {key: value for key, value in out.items() if value}

    def update(self, engine: Engine) -> None:
        """Add what changed in ``engine`` since the previous call (call it after a step)."""
        self._update_scheduler(engine)
        name = engine.config.connector.name if engine.config.connector is not None else "none"
        errors = dict(engine.scheduler.stats.connector_errors)
        for hook, count in engine.model_runner.connector_errors.items():
            errors[hook] = errors.get(hook, 0) + count
        error_keys = {f"hook_errors.{hook}": float(n) for hook, n in errors.items()}
        record_connector_stats(self.metrics, (), name, self._deltas("errors.", error_keys), {})
        for side, stats in (("", engine.connector_stats),
                            ("scheduler.", engine.scheduler_connector_stats)):
            counters, gauges = _split_gauges(stats)
            record_connector_stats(self.metrics, (), name, self._deltas(f"stats.{side}", counters),
                                   gauges, stat_prefix=side)
        self._update_events(engine)

    def _update_scheduler(self, engine: Engine) -> None:
        stats = engine.scheduler.stats
        for source, attr in _SOURCES:
            self.metrics.inc("kvconnector_prompt_tokens_total", (), {"source": source},
                             self._delta(attr, getattr(stats, attr)))
        for series, attr in _ENGINE_COUNTERS:
            self.metrics.inc(series, (), {}, self._delta(attr, getattr(stats, attr)))
        sched = engine.scheduler
        for queue, size in (("waiting", len(sched.waiting)), ("running", len(sched.running)),
                            ("delayed_free", len(sched.delayed_free))):
            self.metrics.set("kvconnector_requests", (), {"queue": queue}, size)

    def _update_events(self, engine: Engine) -> None:
        counts = engine.event_counts
        for key, total in counts.items():
            kind, bracket, medium = key.partition("[")
            if bracket:
                medium = medium.rstrip("]")
            else:
                # Events of a type that names no medium (AllBlocksCleared).
                medium = ""
                total -= sum(v for k, v in counts.items() if k.startswith(kind + "["))
            delta = self._delta(f"events.{key}", total)
            self.metrics.inc("kvconnector_kv_events_total", (),
                             {"type": kind, "medium": medium}, delta)
            if kind == "BlockRemoved" and medium:
                self.metrics.inc("kvconnector_evictions_total", (), {"medium": medium}, delta)
        publisher = engine.event_publisher
        if publisher is not None:
            for series, attr in _PUBLISHER:
                self.metrics.inc(series, (), {}, self._delta(attr, getattr(publisher, attr)))

    def exposition(self) -> str:
        """The registry in Prometheus's text exposition format."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()

    def write(self, path: str | Path) -> None:
        """Write :meth:`exposition` to ``path`` (atomically, by prometheus-client)."""
        from prometheus_client import write_to_textfile

        write_to_textfile(str(path), self.registry)

    def serve(self, port: int, host: str = "127.0.0.1") -> Any:
        """Serve ``/metrics`` on ``host:port`` from a background thread.

        Returns:
            The HTTP server; ``shutdown()`` and ``server_close()`` stop it.

        Raises:
            OSError: the address cannot be bound (e.g. the port is taken).
        """
        from prometheus_client import start_http_server

        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server
