"""The data kit: it passes a correct data-moving connector and fails each planted bug."""

from __future__ import annotations

import pytest

from kvconnector_core.connector.config import KVConnectorConfig
from kvconnector_core.testing import DataCheck, data_check_workloads, run_data_check

WORKLOADS = data_check_workloads()


def reference(**extra: object) -> KVConnectorConfig:
    """The reference connector of ``tests/_reference_connector.py`` with ``extra`` settings."""
    return KVConnectorConfig(name="ReferenceConnector", module_path="_reference_connector",
                             extra_config=dict(extra))


class TestReferenceSync(DataCheck):
    """The correct connector, synchronous loads, claims ending mid-block on full hits."""

    connector_config = reference()


class TestReferenceAsync(DataCheck):
    """The correct connector, asynchronous loads, claiming whole prompts."""

    connector_config = reference(load_async=True, claim_whole_prompt=True)


@pytest.mark.parametrize(("bug", "workload"), [
    ("wrong_block", "block_aligned"),
    ("corrupt_value", "repeated_prefixes"),
    ("over_claim", "block_aligned"),
    ("empty_store_claim", "eviction"),
    ("partial_last_block", "full_prompt_hit"),
])
@pytest.mark.parametrize("load_async", [False, True], ids=["sync", "async"])
def test_kit_fails_planted_bug(bug: str, workload: str, load_async: bool) -> None:
    """Each planted bug is reported as KV rows that differ from the no-connector run."""
    report = run_data_check(reference(bug=bug, load_async=load_async), WORKLOADS[workload])
    assert not report.ok
    assert "KV rows" in report.problems[0], str(report)


def test_over_claim_is_reported_as_never_written() -> None:
    """The kit poisons fresh blocks, so a silent over-claim is named as rows never written
    (not left to luck when a reused block happens to hold the same prefix)."""
    report = run_data_check(reference(bug="over_claim"), WORKLOADS["block_aligned"])
    assert not report.ok
    assert "never written" in report.problems[0], str(report)


def test_whole_block_loader_claiming_whole_prompt_is_safe() -> None:
    """Full-prompt-hit rule: a connector that claims a whole block-aligned prompt and loads
    whole blocks (``num_external_tokens // block_size``) gets its own claim back in
    ``update_state_after_alloc`` and loads every block; the engine recomputes the last token.
    (Before the rule, the engine passed ``num_tokens - 1``, so such a connector skipped the
    last block and outputs differed.)"""
    cfg = reference(claim_whole_prompt=True, bug="partial_last_block")
    report = run_data_check(cfg, WORKLOADS["full_prompt_hit"])
    assert report.ok, str(report)
    assert report.checked is not None and report.checked.metrics.connector_hit_tokens > 0


def test_workloads_exercise_the_connector() -> None:
    """Each workload makes the correct connector load something, and the eviction and
    preemption workloads really evict and preempt."""
    for name, workload in WORKLOADS.items():
        report = run_data_check(reference(), workload)
        assert report.ok, str(report)
        metrics = report.checked.metrics
        assert metrics.connector_hit_tokens > 0, name
        if name == "preemption":
            assert metrics.num_preemptions > 0
        if name == "repeated_prefixes":
            assert metrics.gpu_prefix_hit_tokens > 0


class TestCPUOffloadData(DataCheck):
    """The built-in CPU offload connector moves the right data (asynchronous loads)."""

    connector_config = KVConnectorConfig(name="cpu_offload", extra_config={"num_cpu_blocks": 64})


class TestMultiConnectorData(DataCheck):
    """A MultiConnector over the reference connector and the CPU offload connector."""

    connector_config = KVConnectorConfig(name="MultiConnector", extra_config={"connectors": [
        {"name": "ReferenceConnector", "module_path": "_reference_connector"},
        {"name": "cpu_offload", "extra_config": {"num_cpu_blocks": 64, "blocks_per_chunk": 2}},
    ]})


def test_cpu_offload_scheduler_side_stats_do_not_raise() -> None:
    """Regression: the scheduler-side CPU offload connector raised AttributeError in
    ``get_kv_connector_stats`` (its stats live on the worker side), which the engine logged
    with a traceback at the end of every run."""
    from kvconnector_core.connector.base import KVConnectorRole
    from kvconnector_core.connector.registry import create_connector
    from kvconnector_core.testing import make_kv_cache_config

    config = KVConnectorConfig(name="cpu_offload", extra_config={"num_cpu_blocks": 8})
    connector = create_connector(config, KVConnectorRole.SCHEDULER, make_kv_cache_config())
    assert connector.get_kv_connector_stats() is None
