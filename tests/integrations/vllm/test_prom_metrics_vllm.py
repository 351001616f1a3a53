"""The adapter's ``build_prom_metrics`` under vLLM 0.33's own Scheduler: kvconnector's series
on vLLM's Prometheus registry, with vLLM's per-engine labels, a MultiConnector's children
labelled, and values equal to the connector's own stats for the same run."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

pytest.importorskip("vllm.distributed.kv_transfer",
                    reason="vLLM 0.33 is not installed in this environment; run `make test-vllm`")

from _harness import VllmRig, multi, offload, randomized  # noqa: E402
from prometheus_client import REGISTRY  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm  # noqa: E402
from vllm.v1.metrics.prometheus import unregister_vllm_metrics  # noqa: E402

from kvconnector_core.integrations.vllm.prom_metrics import AdapterPromMetrics  # noqa: E402

LABELS = ["model_name", "engine"]
ENGINE = {0: ["opt-test", "0"]}


def _leaves(stats: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in stats.items():
        if isinstance(value, Mapping):
            if key != "gauges":
                out.update(_leaves(value, f"{prefix}{key}."))
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[f"{prefix}{key}"] = value
    return out


def _run(extra: dict[str, Any]) -> tuple[dict[str, float], KVConnectorProm]:
    """Run the randomized workload; feed vLLM's connector metrics what vLLM's scheduler
    hands its stat loggers; sum the wrapped connector's own stats on both sides."""
    unregister_vllm_metrics()
    rig = VllmRig(extra, num_gpu_blocks=40)
    prom = KVConnectorProm(rig.cfg, LABELS, ENGINE)  # vLLM's own: calls build_prom_metrics
    own: dict[str, float] = {}
    for adapter in (rig.connector, *rig.workers):
        side = (adapter.scheduler_side or adapter.worker_side).guard
        forward = side.get_kv_connector_stats

        def spy(forward=forward):
            stats = forward()
            for key, value in _leaves(stats or {}).items():
                own[key] = own.get(key, 0) + value
            return stats

        side.get_kv_connector_stats = spy
    update = rig.scheduler.update_from_output

    def update_and_observe(so, out):
        outputs = update(so, out)
        for eco in outputs.values():
            stats = eco.scheduler_stats
            if stats is not None and stats.kv_connector_stats:
                prom.observe(stats.kv_connector_stats, 0)
        return outputs

    rig.scheduler.update_from_output = update_and_observe
    randomized(rig, seed=7, num_requests=40)
    rig.shutdown()
    return own, prom


def _value(name: str, **labels: str) -> float:
    got = REGISTRY.get_sample_value(name, {"model_name": "opt-test", "engine": "0", **labels})
    return 0.0 if got is None else got


def test_single_connector_series_equal_its_stats():
    """cpu_offload alone: bytes and seconds per direction on vLLM's registry, as the
    connector reported them over the run."""
    own, prom = _run(offload(64))
    assert isinstance(prom.prom_metrics, AdapterPromMetrics)
    for direction, key in (("load", "bytes_loaded"), ("store", "bytes_stored")):
        got = _value("vllm:kvconnector_transfer_bytes_total", connector="cpu_offload",
                     direction=direction)
        assert got == own[key] > 0
    assert _value("vllm:kvconnector_transfer_seconds_sum", connector="cpu_offload",
                  direction="store") == pytest.approx(own["store_seconds"])


def test_multiconnector_children_have_their_own_series():
    """A MultiConnector of two offload children: each child's bytes under its own label,
    equal to that child's stats; the wrapper's sums are not exported as a third label."""
    own, _ = _run(multi(offload(64), offload(32)))
    children = sorted({k.split(".")[1] for k in own if k.startswith("children.")})
    assert len(children) == 2
    for child in children:
        for direction, key in (("load", "bytes_loaded"), ("store", "bytes_stored")):
            got = _value("vllm:kvconnector_transfer_bytes_total", connector=child,
                         direction=direction)
            assert got == own.get(f"children.{child}.{key}", 0)
        assert _value("vllm:kvconnector_transfer_bytes_total", connector=child,
                      direction="store") > 0
    assert _value("vllm:kvconnector_transfer_bytes_total", connector="MultiConnector",
                  direction="store") == 0
