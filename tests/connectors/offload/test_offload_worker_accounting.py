"""The offload connector's worker side, step by step: what it moves, reports and counts.

Driven through the connector's worker hooks on a CPU KV cache (the mover copies
synchronously there), so every job has finished by the time the step is polled.
"""

from __future__ import annotations

import torch

from connectors.offload.connector import OffloadingConnector
from connectors.offload.records import (
    OffloadingConnectorMetadata,
    OffloadWorkerMetadata,
    TransferJobSpec,
)
from kvconnector_core.connector import KVConnectorConfig, KVConnectorRole
from kvconnector_core.testing import make_kv_cache_config, make_kv_caches


def _worker(num_cpu_blocks: int = 8) -> tuple[OffloadingConnector, dict[str, torch.Tensor]]:
    kv = make_kv_cache_config()
    cfg = KVConnectorConfig(name="cpu_offload", extra_config={"num_cpu_blocks": num_cpu_blocks})
    worker = OffloadingConnector(cfg, KVConnectorRole.WORKER, kv)
    caches = make_kv_caches(kv)
    gen = torch.Generator().manual_seed(0)
    for t in caches.values():  # distinct contents per block, so a wrong block is visible
        t.copy_(torch.randint(-1000, 1000, t.shape, generator=gen).to(t.dtype))
    worker.register_kv_caches(caches)
    return worker, caches


def _step(
    worker: OffloadingConnector,
    meta: OffloadingConnectorMetadata,
    finished: set[str] = frozenset(),  # type: ignore[assignment]
):
    """One worker step; returns (transfer results, load error blocks, stats, worker meta)."""
    worker.bind_connector_metadata(meta)
    worker.handle_preemptions(meta)
    worker.start_load_kv()
    worker.wait_for_save()
    out = (
        worker.get_transfer_results(set(finished)),
        worker.get_block_ids_with_load_errors(),
        worker.get_kv_connector_stats(),
        worker.build_connector_worker_meta(),
    )
    worker.clear_connector_metadata()
    return out


def _block(caches: dict[str, torch.Tensor], block: int) -> list[torch.Tensor]:
    return [t[block].clone() for t in caches.values()]


def test_blocks_stored_then_loaded_come_back_and_every_byte_is_counted_once() -> None:
    worker, caches = _worker()
    block_bytes = sum(t[0].numel() * t.element_size() for t in caches.values())
    want = {b: _block(caches, b) for b in (1, 2, 5)}
    # Step 1 plans two stores; they are submitted when step 2 binds its plan.
    _step(
        worker,
        OffloadingConnectorMetadata(
            stores=[TransferJobSpec(0, "a", [1, 2], [0, 1]), TransferJobSpec(1, "b", [5], [4])]
        ),
    )
    _, _, stats, meta = _step(worker, OffloadingConnectorMetadata())
    assert meta == OffloadWorkerMetadata(done_job_ids=[0, 1])
    assert stats is not None and stats["bytes_stored"] == 3 * block_bytes
    assert "bytes_loaded" not in stats
    # Scattered targets: the CPU slots go back into other GPU blocks, pairwise in order.
    results, errors, stats, meta = _step(
        worker, OffloadingConnectorMetadata(loads=[TransferJobSpec(2, "c", [10, 7, 12], [4, 0, 1])])
    )
    assert results.finished_recving == {"c"} and not results.failed_recving and errors == set()
    assert meta == OffloadWorkerMetadata(done_job_ids=[2])
    assert stats is not None and stats["bytes_loaded"] == 3 * block_bytes
    assert "bytes_stored" not in stats
    for target, source in ((10, 5), (7, 1), (12, 2)):
        assert all(
            torch.equal(a, b) for a, b in zip(_block(caches, target), want[source], strict=True)
        )
    # Nothing moved since: no stats, no report.
    _, _, stats, meta = _step(worker, OffloadingConnectorMetadata())
    assert stats is None and meta is None


def test_a_failed_load_is_reported_once_with_its_blocks() -> None:
    worker, _ = _worker(num_cpu_blocks=2)
    # CPU slot 9 does not exist
    results, errors, stats, meta = _step(
        worker, OffloadingConnectorMetadata(loads=[TransferJobSpec(0, "r", [3, 4], [1, 9])])
    )
    assert results.finished_recving == {"r"} and results.failed_recving == {"r"}
    assert errors == {3, 4}
    assert meta == OffloadWorkerMetadata(failed_job_ids=[0])
    assert stats is None  # nothing was moved
    results, errors, _, meta = _step(worker, OffloadingConnectorMetadata())
    assert not results.finished_recving and not results.failed_recving
    assert errors == set() and meta is None
    assert not worker.has_pending_work()


def test_a_finished_request_is_reported_sent_once_its_stores_are_done() -> None:
    """A delayed free: the request's last stores are submitted at once (no later step is
    coming to submit them), and the request is reported in finished_sending exactly once."""
    worker, _ = _worker()
    plan = OffloadingConnectorMetadata(
        stores=[TransferJobSpec(0, "r", [1], [0])], delayed_free_req_ids=["r"]
    )
    results, _, _, meta = _step(worker, plan, finished={"r"})
    assert results.finished_sending == {"r"}
    assert meta == OffloadWorkerMetadata(done_job_ids=[0])
    results, _, _, _ = _step(worker, OffloadingConnectorMetadata())
    assert results.finished_sending == set()
    assert not worker.has_pending_work()


def test_a_delayed_free_waits_for_a_store_still_unsubmitted_of_another_request() -> None:
    """Only the finished request's stores are forced out early: another request's store
    still goes out when the next plan is bound, and is not lost."""
    worker, caches = _worker()
    plan = OffloadingConnectorMetadata(
        stores=[TransferJobSpec(0, "done", [1], [0]), TransferJobSpec(1, "running", [2], [1])],
        delayed_free_req_ids=["done"],
    )
    results, _, _, meta = _step(worker, plan, finished={"done"})
    assert results.finished_sending == {"done"}
    assert meta == OffloadWorkerMetadata(done_job_ids=[0])
    assert worker.has_pending_work()  # the other store waits for the next step
    _, _, _, meta = _step(worker, OffloadingConnectorMetadata())
    assert meta == OffloadWorkerMetadata(done_job_ids=[1])
    assert not worker.has_pending_work()


def test_a_preempted_requests_store_is_copied_before_its_blocks_can_be_rewritten() -> None:
    """vLLM calls handle_preemptions before it binds the step's plan: the preempted
    request's store queued in the last step must be copied right there, since the engine
    may hand its blocks to another request in this very step."""
    worker, caches = _worker()
    want = _block(caches, 3)
    _step(worker, OffloadingConnectorMetadata(stores=[TransferJobSpec(0, "p", [3], [2])]))
    worker.handle_preemptions(OffloadingConnectorMetadata(preempted_req_ids=["p"]))
    for t in caches.values():
        t[3] = 0  # the block is rewritten by its next owner
    _step(worker, OffloadingConnectorMetadata(preempted_req_ids=["p"]))
    _step(worker, OffloadingConnectorMetadata(loads=[TransferJobSpec(1, "q", [9], [2])]))
    assert all(torch.equal(a, b) for a, b in zip(_block(caches, 9), want, strict=True))


class _SlowCompletions:
    """Wraps the mover: a job is reported finished one poll later than it could be (a
    DMA still running)."""

    def __init__(self, real) -> None:
        self.real, self.held = real, []

    def __getattr__(self, name: str):
        return getattr(self.real, name)

    def get_finished(self):
        out, self.held = self.held, self.real.get_finished()
        return out


def test_a_finished_request_is_not_reported_sent_while_its_store_runs() -> None:
    worker, _ = _worker()
    worker.worker_side.mover = _SlowCompletions(worker.worker_side.mover)
    plan = OffloadingConnectorMetadata(
        stores=[TransferJobSpec(0, "r", [1], [0])], delayed_free_req_ids=["r"]
    )
    results, _, _, meta = _step(worker, plan, finished={"r"})
    assert results.finished_sending == set() and meta is None  # its blocks are still being read
    results, _, _, meta = _step(worker, OffloadingConnectorMetadata())
    assert results.finished_sending == {"r"} and meta == OffloadWorkerMetadata(done_job_ids=[0])


def test_shutdown_copies_the_stores_still_queued() -> None:
    worker, _ = _worker()
    _step(worker, OffloadingConnectorMetadata(stores=[TransferJobSpec(0, "r", [6], [3])]))
    mover = worker.worker_side.mover
    worker.shutdown()
    # CPU sub-block 3 holds GPU block 6, plane by plane.
    assert all(
        torch.equal(cpu[3], gpu[6])
        for gpu, cpu in zip(mover.layout.planes, mover.cpu_planes, strict=True)
    )
