"""Reports that add up: computed + GPU-hit + connector tokens = prompt tokens; a partial load
failure subtracts only the recomputed tokens; a MultiConnector reports per-child stats and
errors."""

from __future__ import annotations

import pytest

from kvconnector_core.connector.config import KVConnectorConfig
from kvconnector_core.engine.engine import Engine
from kvconnector_core.engine.workloads import Trace
from kvconnector_core.testing import data_check_workloads, run_data_check

WORKLOADS = data_check_workloads()


def reference(**extra: object) -> dict[str, object]:
    return {
        "name": "ReferenceConnector",
        "module_path": "_reference_connector",
        "extra_config": extra,
    }


def totals(metrics) -> int:
    return (
        metrics.prefill_tokens_computed
        + metrics.gpu_prefix_hit_tokens
        + metrics.connector_hit_tokens
    )


@pytest.mark.parametrize(
    "workload", ["block_aligned", "full_prompt_hit", "repeated_prefixes", "preemption"]
)
@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"load_async": True},
        {"fail_last_block": True},
        {"fail_last_block": True, "load_async": True},
    ],
    ids=["sync", "async", "sync-partial-failure", "async-partial-failure"],
)
def test_token_counts_add_up_to_prompt_tokens(workload, extra):
    """Computed, GPU-hit and connector tokens add up to the prompt tokens, with and without
    failed loads, and the outputs still match the no-connector run."""
    report = run_data_check(KVConnectorConfig.from_dict(reference(**extra)), WORKLOADS[workload])
    assert report.ok, str(report)
    metrics = report.checked.metrics
    assert totals(metrics) == metrics.num_prompt_tokens


@pytest.mark.parametrize("load_async", [False, True], ids=["sync", "async"])
def test_partial_failure_subtracts_only_the_failed_block(load_async):
    """Every load's last block fails: the blocks before it still count as served by the
    connector (the whole hit is not dropped), exactly one block less per
    failed load than without failures."""
    workload = WORKLOADS["block_aligned"]
    ok = run_data_check(KVConnectorConfig.from_dict(reference(load_async=load_async)), workload)
    failing = run_data_check(
        KVConnectorConfig.from_dict(reference(load_async=load_async, fail_last_block=True)),
        workload,
    )
    assert failing.ok, str(failing)
    recovered = failing.checked.metrics.num_failed_loads_recovered
    assert recovered > 0
    block = workload.block_size
    served = failing.checked.metrics.connector_hit_tokens
    if load_async:
        assert served == ok.checked.metrics.connector_hit_tokens - recovered * block
    else:
        # A step whose synchronous load failed stores nothing (its forward ran on the bad
        # block), so later requests can hit less than one block short per failed load.
        assert 0 < served <= ok.checked.metrics.connector_hit_tokens - recovered * block


def test_multiconnector_report_has_per_child_stats_and_errors():
    """A MultiConnector run reports each child's stats and each child's contained errors."""
    workload = WORKLOADS["block_aligned"]
    multi = KVConnectorConfig(
        name="MultiConnector",
        extra_config={
            "connectors": [
                reference(raise_in_lookup=True),
                {"name": "cpu_offload", "extra_config": {"num_cpu_blocks": 64}},
            ]
        },
    )
    with Engine(workload.engine_config(multi)) as engine:
        metrics = engine.run(Trace(workload.name, list(workload.requests))).metrics
    stats, errors = metrics.connector_stats, metrics.connector_errors
    assert stats["children.OffloadingConnector.bytes_loaded"] == metrics.bytes_loaded > 0
    assert stats["children.ReferenceConnector.bytes_stored"] > 0
    assert errors["ReferenceConnector.get_num_new_matched_tokens"] == len(workload.requests)
    assert totals(metrics) == metrics.num_prompt_tokens


def test_multiconnector_gbps_counts_only_children_that_report_time():
    """Stranger log (docs16): a MultiConnector summed every child's bytes but only the timed
    children's seconds, so a child without load_seconds (the reference connector, or a
    stranger's file connector) made the report's GB/s too high. GB/s now covers the timed
    children only."""
    workload = WORKLOADS["block_aligned"]
    multi = KVConnectorConfig(
        name="MultiConnector",
        extra_config={
            "connectors": [
                reference(),
                {"name": "cpu_offload", "extra_config": {"num_cpu_blocks": 64}},
            ]
        },
    )
    with Engine(workload.engine_config(multi)) as engine:
        metrics = engine.run(Trace(workload.name, list(workload.requests))).metrics
    stats = metrics.connector_stats
    untimed = stats.get("children.ReferenceConnector.bytes_stored", 0)
    assert untimed > 0 and "children.ReferenceConnector.store_seconds" not in stats
    timed, seconds = stats["children.OffloadingConnector.bytes_stored"], metrics.store_seconds
    assert seconds == stats["children.OffloadingConnector.store_seconds"] > 0
    assert metrics.bytes_stored == untimed + timed
    assert metrics.store_gbps == timed / seconds / 1e9
