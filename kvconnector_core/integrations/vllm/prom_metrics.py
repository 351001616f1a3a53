"""kvconnector's connector series on vLLM's Prometheus registry.

vLLM 0.33 asks the connector class for a ``KVConnectorPromMetrics``
(``build_prom_metrics``), then hands it each logging interval's connector stats: the
adapter's :class:`~kvconnector_core.integrations.vllm.AdapterStats` payload,
``{"counters": {...}, "gauges": {...}}`` summed over the workers and the scheduler side.
:class:`AdapterPromMetrics` creates the ``connector``-scope series of
:data:`~kvconnector_core.metrics.SERIES` through vLLM's metric classes, named
``vllm:kvconnector_...`` (vLLM unregisters its ``vllm:`` series when it rebuilds its
loggers) and labelled with vLLM's per-engine labels (``model_name``, ``engine``) first;
the values are recorded by the same code as in kvconnector's engine
(:func:`~kvconnector_core.metrics.record_connector_stats`), so a MultiConnector's
children get their own ``connector`` label here too.

Primitives: :data:`PREFIX`, :class:`AdapterPromMetrics`, :func:`build_prom_metrics`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

from kvconnector_core.metrics import MetricSet, record_connector_stats

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["PREFIX", "AdapterPromMetrics", "build_prom_metrics"]

PREFIX = "vllm:"
"""Put before every series name inside vLLM."""


class AdapterPromMetrics(KVConnectorPromMetrics):
    """The wrapped connector's series on vLLM's registry.

    Args:
        vllm_config: vLLM's config (its ``kv_transfer_config`` names the connector).
        metric_types: vLLM's metric classes, keyed by prometheus-client's.
        labelnames: vLLM's per-engine label names.
        per_engine_labelvalues: engine index -> those labels' values.
        connector: the ``connector`` label of numbers no MultiConnector child owns.
    """

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type, type],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]],
                 connector: str) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.connector = connector
        self.metrics = MetricSet(self._counter_cls, self._gauge_cls, self._histogram_cls,
                                 prefix=PREFIX, base_labels=labelnames, scopes=("connector",))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Record one interval's stats (an ``AdapterStats.to_dict()`` payload)."""
        base = self.per_engine_labelvalues[engine_idx]
        record_connector_stats(self.metrics, base, self.connector,
                               transfer_stats_data.get("counters", {}),
                               transfer_stats_data.get("gauges", {}))


def build_prom_metrics(vllm_config: VllmConfig, metric_types: dict[type, type],
                       labelnames: list[str],
                       per_engine_labelvalues: dict[int, list[object]]) -> AdapterPromMetrics:
    """What the adapter's ``build_prom_metrics`` returns (vLLM's arguments, unchanged).

    Args:
        vllm_config: vLLM's config.
        metric_types: vLLM's metric classes (``{Gauge: ..., Counter: ..., Histogram: ...}``).
        labelnames: vLLM's per-engine label names.
        per_engine_labelvalues: engine index -> label values.

    Returns:
        The series, registered on vLLM's registry.
    """
    from kvconnector_core.integrations.vllm.config import connector_config_from_vllm

    name = connector_config_from_vllm(vllm_config).name
    return AdapterPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues, name)
