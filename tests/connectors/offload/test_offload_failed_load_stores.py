"""A failed sync load fails the outstanding stores of the requests holding its blocks.

Not only the last plan's stores: under vLLM's async scheduling the next step's plan is
built before a step's report arrives, so the failed step's stores of a request whose
forward ran on never-loaded blocks would otherwise complete and become visible.
"""

from __future__ import annotations

from connectors.offload.connector import OffloadingConnector
from connectors.offload.records import OffloadWorkerMetadata, TransferJobSpec
from connectors.offload.scheduler_state import JobRecord, group_suffix
from kvconnector_core.connector import KVConnectorConfig, KVConnectorOutput, KVConnectorRole
from kvconnector_core.testing import empty_scheduler_output, make_kv_cache_config


def _side():
    cfg = KVConnectorConfig(name="cpu_offload", extra_config={"num_cpu_blocks": 8})
    return OffloadingConnector(
        cfg, KVConnectorRole.SCHEDULER, make_kv_cache_config()
    ).scheduler_side


def _plan_store(conn, job_id: int, key: bytes) -> TransferJobSpec:
    assert conn.manager.prepare_store([key]) is not None
    conn.state.jobs[job_id] = JobRecord("gone", (key,), is_store=True)  # noqa: SLF001
    return TransferJobSpec(job_id, "gone", [5], [0])


def test_sync_scheduling_failed_load_fails_the_steps_store() -> None:
    conn = _side()
    key = b"k" + group_suffix(0)
    _plan_store(conn, 0, key)  # step N's plan
    conn.update_connector_output(KVConnectorOutput(invalid_block_ids={5}))  # step N's report
    conn.update_connector_output(
        KVConnectorOutput(kv_connector_worker_meta=OffloadWorkerMetadata(done_job_ids=[0]))
    )
    assert conn.manager.lookup([key]) == 0


def test_async_scheduling_failed_load_fails_the_steps_store() -> None:
    conn = _side()
    key = b"k" + group_suffix(0)
    _plan_store(conn, 0, key)  # step N's plan
    conn.build_connector_meta(empty_scheduler_output())  # step N+1's plan, built before N's report
    conn.update_connector_output(KVConnectorOutput(invalid_block_ids={5}))  # step N's report
    conn.update_connector_output(
        KVConnectorOutput(kv_connector_worker_meta=OffloadWorkerMetadata(done_job_ids=[0]))
    )
    # Step N's store copied KV computed on a failed load: it must never become visible.
    assert conn.manager.lookup([key]) == 0
