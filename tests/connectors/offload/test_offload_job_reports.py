"""How the offload connector's scheduler side books the worker's job reports.

A report names job ids; the scheduler side must tolerate a report it already booked (or
of a job it dropped), count one report per worker before completing a job, and release
what a job pinned exactly once.
"""

from __future__ import annotations

import pytest

from connectors.offload.connector import OffloadingConnector
from connectors.offload.records import (
    OffloadingConnectorMetadata,
    OffloadWorkerMetadata,
    TierWriteJob,
    TransferJobSpec,
)
from connectors.offload.scheduler_state import JobRecord, ReqState, group_suffix
from kvconnector_core.connector import KVConnectorConfig, KVConnectorOutput, KVConnectorRole
from kvconnector_core.testing import (
    empty_scheduler_output,
    make_kv_cache_config,
    make_request,
    scheduler_output_for,
)


def _side(world_size: int = 1, num_cpu_blocks: int = 8):
    cfg = KVConnectorConfig(
        name="cpu_offload", extra_config={"num_cpu_blocks": num_cpu_blocks}, world_size=world_size
    )
    return OffloadingConnector(
        cfg, KVConnectorRole.SCHEDULER, make_kv_cache_config()
    ).scheduler_side


def _report(done: list[int] = (), failed: list[int] = ()) -> KVConnectorOutput:  # type: ignore[assignment]
    meta = OffloadWorkerMetadata(done_job_ids=list(done), failed_job_ids=list(failed))
    return KVConnectorOutput(kv_connector_worker_meta=meta)


def _planned_store(side, job_id: int, key: bytes) -> None:
    assert side.manager.prepare_store([key]) is not None
    side.state.jobs[job_id] = JobRecord("r", (key,), is_store=True)  # noqa: SLF001 - a planned store job


def test_a_job_reported_again_is_ignored() -> None:
    side = _side()
    key = b"k" + group_suffix(0)
    _planned_store(side, 0, key)
    side.update_connector_output(_report(done=[0]))
    side.update_connector_output(_report(done=[0]))  # e.g. a late duplicate: no KeyError
    side.update_connector_output(_report(failed=[0]))  # nor does a late failure undo the store
    assert side.manager.lookup([key]) == 1
    assert not side.has_pending_work()


@pytest.mark.parametrize("outcome", ["done", "failed"])
def test_a_finished_store_stops_fencing_its_blocks(outcome: str) -> None:
    """Once a store is reported (either way) the engine may rewrite the windowed blocks
    it read: a later allocation of them makes the worker wait for nothing; a store still
    in flight is still waited for."""
    side = _side()
    for job_id, block in ((0, 5), (1, 6)):
        _planned_store(side, job_id, bytes([job_id]) + group_suffix(0))
        side.state.fence.add(job_id, [block])  # noqa: SLF001 - the store reads a sliding-window block
    side.update_connector_output(_report(**{outcome: [0]}))
    request = make_request(32)
    plan = side.build_connector_meta(scheduler_output_for([(request, ([5, 6],), 0)]))
    assert plan.flush_job_ids == [1]


@pytest.mark.parametrize(("outcome", "visible"), [("done", 1), ("failed", 0)])
def test_chunks_a_load_promoted_from_a_tier_are_visible_only_if_it_worked(
    outcome: str, visible: int
) -> None:
    """A load that promotes tier chunks reads them into reserved CPU slots first; when the
    worker reports the load failed (a tier read failed), those slots hold no valid KV and
    must never be served."""
    side = _side()
    held, promoted = b"h" + group_suffix(0), b"p" + group_suffix(0)
    assert side.manager.prepare_store([held]) is not None
    side.manager.complete_store([held])
    assert side.manager.prepare_store([promoted]) is not None  # the promotion's reserved slot
    side.manager.prepare_load([held])
    side.state.jobs[0] = JobRecord("r", (held,), is_store=False, promoted=(promoted,))  # noqa: SLF001 - a planned load
    side.update_connector_output(_report(**{outcome: [0]}))
    assert side.manager.lookup([promoted]) == visible
    assert side.manager.lookup([held]) == 1
    assert all(entry.ref_cnt == 0 for _, entry in side.manager.policy)  # unpinned either way
    assert not side.has_pending_work()


def test_a_failed_receive_reported_without_its_job_unpins_only_that_requests_load() -> None:
    """The worker may report a receive failed without naming its job (its load was never
    submitted, e.g. start_load_kv raised first): that load's CPU chunks are unpinned, so
    they can be evicted again; another request's load in flight stays pinned."""
    side = _side()
    keys = {rid: bytes(rid, "ascii") + group_suffix(0) for rid in ("r", "s")}
    for job_id, (rid, key) in enumerate(keys.items()):
        assert side.manager.prepare_store([key]) is not None
        side.manager.complete_store([key])
        side.manager.prepare_load([key])
        side.state.jobs[job_id] = JobRecord(rid, (key,), is_store=False)  # noqa: SLF001 - a planned load
    side.update_connector_output(KVConnectorOutput(finished_recving={"r"}, failed_recving={"r"}))
    pins = {key: entry.ref_cnt for key, entry in side.manager.policy}
    assert pins == {keys["r"]: 0, keys["s"]: 1}
    side.update_connector_output(_report(done=[1]))
    assert not side.has_pending_work()


def _held(side, key: bytes) -> None:
    assert side.manager.prepare_store([key]) is not None
    side.manager.complete_store([key])


def _pins(side) -> dict[bytes, int]:
    return {key: entry.ref_cnt for key, entry in side.manager.policy}


def test_a_forgotten_request_loses_its_unsent_load_and_its_stores_in_flight() -> None:
    """forget_requests (the guard's answer to a hook that raised for the request): its
    load not yet sent is dropped and unpinned, and a store of it still in flight fails
    when it completes, so nothing it computed becomes visible; no state is left."""
    side = _side()
    loaded, stored = b"l" + group_suffix(0), b"s" + group_suffix(0)
    _held(side, loaded)
    side.manager.prepare_load([loaded])
    side.state.jobs[0] = JobRecord("r", (loaded,), is_store=False)  # noqa: SLF001 - a planned load
    side.state.pending_loads.append(TransferJobSpec(0, "r", [4], [0]))  # noqa: SLF001 - not sent yet
    _planned_store(side, 1, stored)
    side.state.reqs["r"] = ReqState(make_request(request_id="r"), store_jobs={1})  # noqa: SLF001
    side.forget_requests({"r"})
    assert _pins(side)[loaded] == 0
    assert side.build_connector_meta(empty_scheduler_output()).loads == []
    side.update_connector_output(_report(done=[1]))  # the worker copied it: still never visible
    assert side.manager.lookup([stored]) == 0
    assert not side.state.reqs and not side.has_pending_work()  # noqa: SLF001


def test_a_failed_plan_releases_what_it_named() -> None:
    """plan_failed: a failed plan's loads are unpinned; with its stores failed, its stores
    never become visible, its tier writes' CPU slots are unpinned, the stores in flight of
    its preempted requests fail, and its delayed frees are sent again."""
    side = _side()
    loaded, written, stored, preempted = (bytes([c]) + group_suffix(0) for c in b"lwsp")
    for key in (loaded, written):
        _held(side, key)
        side.manager.prepare_load([key])
    side.state.jobs[0] = JobRecord("a", (loaded,), is_store=False)  # noqa: SLF001
    side.state.jobs[1] = JobRecord("", (written,), is_store=False)  # noqa: SLF001 - a tier write
    _planned_store(side, 2, stored)
    side.state.fence.add(2, [7])  # noqa: SLF001 - the failed store read a sliding-window block
    _planned_store(side, 3, preempted)
    side.state.reqs["p"] = ReqState(make_request(request_id="p"), store_jobs={3})  # noqa: SLF001
    plan = OffloadingConnectorMetadata(
        loads=[TransferJobSpec(0, "a", [4], [0])],
        tier_writes=[TierWriteJob(1, [])],
        stores=[TransferJobSpec(2, "b", [5], [1])],
        preempted_req_ids=["p"],
        delayed_free_req_ids=["d"],
    )
    side.plan_failed(plan, loads_failed=True, stores_failed=True)
    assert _pins(side)[loaded] == 0 and _pins(side)[written] == 0
    assert side.manager.lookup([stored]) == 0 and stored not in _pins(side)  # its slot given back
    # the preempted request's store read rewritten blocks
    side.update_connector_output(_report(done=[3]))
    assert side.manager.lookup([preempted]) == 0
    plan = side.build_connector_meta(scheduler_output_for([(make_request(32), ([7],), 0)]))
    assert plan.delayed_free_req_ids == ["d"]
    assert plan.flush_job_ids == []  # nothing reads block 7 any more


def test_a_finished_request_is_kept_until_its_stores_are_done_and_its_free_is_reported() -> None:
    side = _side()
    key = b"k" + group_suffix(0)
    _planned_store(side, 0, key)
    request = make_request(request_id="r")
    side.state.reqs["r"] = ReqState(request, store_jobs={0})  # noqa: SLF001 - a store in flight
    assert side.request_finished(request, [1]) == (True, None)  # blocks kept while it reads them
    assert side.build_connector_meta(empty_scheduler_output()).delayed_free_req_ids == ["r"]
    side.update_connector_output(_report(done=[0]))
    side.update_connector_output(KVConnectorOutput(finished_sending={"r"}))
    assert side.manager.lookup([key]) == 1
    assert not side.state.reqs and not side.has_pending_work()  # noqa: SLF001


def test_a_resent_delayed_free_reported_meanwhile_is_not_sent_again() -> None:
    side = _side()
    _planned_store(side, 0, b"k" + group_suffix(0))
    request = make_request(request_id="r")
    side.state.reqs["r"] = ReqState(request, store_jobs={0})  # noqa: SLF001 - a store in flight
    assert side.request_finished(request, [1])[0] is True
    plan = side.build_connector_meta(empty_scheduler_output())
    side.plan_failed(plan, loads_failed=False, stores_failed=True)  # its delayed free is due again
    # but was reported meanwhile
    side.update_connector_output(KVConnectorOutput(finished_sending={"r"}))
    assert side.build_connector_meta(empty_scheduler_output()).delayed_free_req_ids == []


@pytest.mark.parametrize("half", [False, True], ids=["aligned", "mid-chunk"])
def test_hits_only_recency_touches_the_whole_chunks_hit_when_the_request_finishes(
    half: bool,
) -> None:
    """Recency "hits_only": at its finish, the whole chunks the request's admission hit
    become the most recent; a chunk it hit only in part (or only stored) keeps its rank."""
    cfg = KVConnectorConfig(
        name="cpu_offload", extra_config={"num_cpu_blocks": 8, "recency": "hits_only"}
    )
    side = OffloadingConnector(
        cfg, KVConnectorRole.SCHEDULER, make_kv_cache_config()
    ).scheduler_side
    ct = side.offload_config.chunk_tokens
    request = make_request(3 * ct + 1, request_id="r")
    hit, partial = (request.block_hashes[c] + group_suffix(0) for c in (0, 1))
    other = b"o" + group_suffix(0)
    for key in (hit, partial, other):  # least recent first
        _held(side, key)
    assert ct >= 2
    side.state.reqs["r"] = ReqState(request, hit_tokens=ct + (ct // 2 if half else 0))  # noqa: SLF001 - its admission's hit
    side.request_finished(request, [1])
    assert [key for key, _ in side.manager.policy] == [partial, other, hit]
