"""Prometheus metrics of kvconnector's engine and of its connectors inside vLLM.

``docs/metrics.md`` lists every series and what it counts.

Primitives:

- :data:`SERIES`, :class:`SeriesSpec`, :class:`MetricSet` -- the series, defined once
  (``series``).
- :func:`record_connector_stats` -- a connector's stats deltas to series updates
  (``connector_stats``); the vLLM adapter's ``build_prom_metrics`` uses it too.
- :class:`EngineMetrics` -- the engine's registry, fed after each step, served over HTTP
  or written as exposition text (``engine_metrics``; ``kvconnector run --metrics-port``,
  ``--metrics``).
"""

from __future__ import annotations

from kvconnector_core.metrics.connector_stats import record_connector_stats
from kvconnector_core.metrics.engine_metrics import EngineMetrics
from kvconnector_core.metrics.series import SERIES, MetricSet, SeriesSpec

__all__ = ["SERIES", "EngineMetrics", "MetricSet", "SeriesSpec", "record_connector_stats"]
