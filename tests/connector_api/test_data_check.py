"""The data kit: it passes a correct data-moving connector and fails each planted bug."""

from __future__ import annotations

import pytest

from kvconnector_core.connector.config import KVConnectorConfig
from kvconnector_core.errors import ConfigError
from kvconnector_core.testing import (
    DataCheck,
    FaultSettings,
    HookFault,
    data_check_workloads,
    fault_injection_config,
    run_data_check,
    run_failed_load_check,
)

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
    ("zero_last_byte", "block_aligned"),
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
        if workload.is_hybrid:
            continue  # the reference connector handles one group: refused there (test_hybrid)
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
    """The scheduler-side CPU offload connector's ``get_kv_connector_stats`` does not raise
    (its stats live on the worker side); an AttributeError there would be logged with a
    traceback at the end of every run."""
    from kvconnector_core.connector.base import KVConnectorRole
    from kvconnector_core.plugins.registry import create_connector
    from kvconnector_core.testing import make_kv_cache_config

    config = KVConnectorConfig(name="cpu_offload", extra_config={"num_cpu_blocks": 8})
    connector = create_connector(config, KVConnectorRole.SCHEDULER, make_kv_cache_config())
    assert connector.get_kv_connector_stats() is None


# -- hybrid models, workload names, faults, report wording ------------------------------------


def test_hybrid_workload_catches_a_one_group_connector_that_claims_hybrid_support() -> None:
    """A connector that declares ``supports_multiple_kv_cache_groups`` but moves group 0 only
    passes every one-group workload; the ``hybrid`` workload names the unloaded group."""
    cfg = KVConnectorConfig(
        name="FalseHybridReferenceConnector", module_path="_reference_connector"
    )
    assert run_data_check(cfg, "block_aligned").ok
    report = run_data_check(cfg, "hybrid")
    assert not report.ok
    assert "KV rows" in report.problems[0], str(report)
    assert any(p.startswith("request 'r") and "output" in p for p in report.problems), str(report)


def test_layer_types_runs_any_workload_on_a_hybrid_model() -> None:
    report = run_data_check(
        KVConnectorConfig(name="cpu_offload", extra_config={"num_cpu_blocks": 64}),
        "block_aligned",
        layer_types=("full", "sliding:8"),
    )
    assert report.ok, str(report)
    assert report.checked is not None and report.checked.metrics.bytes_stored > 0
    with pytest.raises(ConfigError, match="one KV cache group"):
        run_data_check(reference(), "block_aligned", layer_types=("full", "sliding:8"))


def test_run_data_check_takes_a_workload_name() -> None:
    """A workload given by name runs; a misspelt name is a ConfigError naming the valid one."""
    report = run_data_check(reference(), "eviction")
    assert report.ok and report.workload == "eviction"
    with pytest.raises(ConfigError, match="'evict'.*eviction"):
        run_data_check(reference(), "evict")


_OFFLOAD = KVConnectorConfig(name="cpu_offload", extra_config={"num_cpu_blocks": 64})


@pytest.mark.parametrize(
    "faults",
    [
        FaultSettings(store_failure_rate=0.3),
        FaultSettings(load_failure_rate=0.3, store_failure_rate=0.2),
        FaultSettings(raise_in=(HookFault(hook="start_load_kv", rate=0.2),)),
    ],
    ids=["stores", "loads_and_stores", "start_load_kv_raises"],
)
def test_injected_faults_are_not_the_connectors_errors(faults: FaultSettings) -> None:
    """An injected failed store (a raise from wait_for_save) is not reported as 'the connector
    raised': only raises beyond the injected ones are problems, and the row and output checks
    still run."""
    report = run_data_check(fault_injection_config(_OFFLOAD, faults), "repeated_prefixes")
    assert report.ok, str(report)
    assert report.injected_raises > 0
    assert report.checked is not None
    assert sum(report.checked.metrics.connector_errors.values()) == report.injected_raises


def test_own_raises_still_count_under_fault_injection() -> None:
    cfg = fault_injection_config(
        reference(raise_in_lookup=True), FaultSettings(store_failure_rate=0.3)
    )
    report = run_data_check(cfg, "repeated_prefixes")
    assert any(
        "the connector raised" in p and "get_num_new_matched_tokens" in p for p in report.problems
    ), str(report)


def test_fault_injection_still_catches_wrong_data() -> None:
    """With the planted bug the reference connector serves saves computed in a step whose
    sync load failed: with start_load_kv raising, DataCheck under faults names the rows."""
    cfg = fault_injection_config(
        reference(bug="serve_failed_load_stores"),
        FaultSettings(raise_in=(HookFault(hook="start_load_kv", rate=0.2),)),
    )
    report = run_data_check(cfg, "repeated_prefixes")
    assert not report.ok
    assert "KV rows" in report.problems[0], str(report)


def test_partly_written_block_is_named_as_such() -> None:
    """A block with 3 rows still poisoned and 1 rewritten is not reported as 'holds other
    values': the report says how many rows were never written."""
    cfg = reference(bug="partial_last_block", claim_whole_prompt=False)
    report = run_data_check(cfg, "full_prompt_hit")
    assert not report.ok
    first = report.problems[0]
    assert "never written" in first or "written only in part" in first, first


def test_kit_asks_lookups_twice_and_catches_an_answer_that_changes_on_hits() -> None:
    """DataCheck repeats every lookup, hits included, so a lookup with side effects on hits
    fails (asking twice on a fresh miss only would let it pass)."""
    cfg = KVConnectorConfig(
        name="OneShotLookupReferenceConnector", module_path="_reference_connector"
    )
    report = run_data_check(cfg, "block_aligned")
    assert any("when asked again at once" in p for p in report.problems), str(report)


def test_kit_reports_an_async_answer_without_the_declaration() -> None:
    cfg = KVConnectorConfig(
        name="UndeclaredAsyncReferenceConnector",
        module_path="_reference_connector",
        extra_config={"load_async": True},
    )
    report = run_data_check(cfg, "block_aligned")
    assert any("does not declare supports_async_load" in p for p in report.problems), str(report)


def test_kit_catches_a_lookup_that_counts_hits() -> None:
    """A lookup that counts hits in its stats (answers unchanged) fails: the kit compares runs
    with lookups asked once and twice."""

    class Probe(DataCheck):
        connector_config = KVConnectorConfig(
            name="HitCountingReferenceConnector", module_path="_reference_connector"
        )

    with pytest.raises(AssertionError, match="stats counters differ.*lookup_hits"):
        Probe().test_lookups_are_repeatable()

    class Clean(DataCheck):
        connector_config = reference()

    Clean().test_lookups_are_repeatable()


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_cpu_offload_serves_hits_on_the_hybrid_workload(blocks_per_chunk: int) -> None:
    """The ``hybrid`` workload's 8-token window groups store every chunk a prefill step
    computed, not only those still in the window (then only r4, which extends r0 past its
    end, would hit: 24 tokens). Every repeat hits up to one block before its last token:
    r2 (r0's 24 tokens again) 20, r3 (r1's 19 tokens + 9) 16, r4 24, r5 (r1 again) 16."""
    cfg = KVConnectorConfig(
        name="cpu_offload",
        extra_config={"num_cpu_blocks": 64, "blocks_per_chunk": blocks_per_chunk},
    )
    report = run_data_check(cfg, "hybrid")
    assert report.ok, str(report)
    assert report.checked is not None and report.checked.metrics.connector_hit_tokens == 76


@pytest.mark.parametrize(
    "connector",
    [
        _OFFLOAD,
        KVConnectorConfig(
            name="MultiConnector",
            extra_config={
                "connectors": [{"name": "cpu_offload", "extra_config": {"num_cpu_blocks": 64}}]
            },
        ),
    ],
    ids=["offload", "multi"],
)
def test_quarantine_caused_by_injected_raises_is_not_the_connectors_error(
    connector: KVConnectorConfig,
) -> None:
    """With start_load_kv raising on every call the guard quarantines the connector; its
    'quarantined' counter is not counted as one raise more than injected, so a correct
    connector passes (no "only N of these raises were injected faults")."""
    cfg = fault_injection_config(
        connector, FaultSettings(raise_in=(HookFault(hook="start_load_kv", rate=1.0),))
    )
    report = run_data_check(cfg, "repeated_prefixes")
    assert report.checked is not None
    errors = report.checked.metrics.connector_errors
    assert errors.get("quarantined") == 1 and errors["start_load_kv"] == report.injected_raises, (
        errors
    )
    assert report.ok, str(report)


def test_failed_load_check_catches_serving_the_stores_of_a_failed_load_step() -> None:
    """A connector that keeps the stores of a step whose sync load failed is caught every
    time (random start_load_kv raises catch it for some fault seeds only, 4 of 10 on
    repeated_prefixes): run_failed_load_check fails one step with sync loads at a time on
    chained_prefixes, where the next request loads what that step stored."""
    report = run_failed_load_check(reference(bug="serve_failed_load_stores"))
    assert not report.ok
    assert report.injected_raises == 1
    assert "start_load_kv raised (injected) in step" in report.problems[0], str(report)
    assert "KV rows" in report.problems[0], str(report)


@pytest.mark.parametrize(
    "connector",
    [reference(), reference(load_async=True), _OFFLOAD],
    ids=["sync", "async", "offload"],
)
def test_failed_load_check_passes_correct_connectors(connector: KVConnectorConfig) -> None:
    """The correct reference connector forgets the failed step's stores; an async one has no
    step with sync loads (nothing to fail: no fault injected)."""
    report = run_failed_load_check(connector)
    assert report.ok, str(report)
    assert report.injected_raises == (1 if connector.extra_config == {} else 0)
