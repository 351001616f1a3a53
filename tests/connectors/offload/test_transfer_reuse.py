"""The mover's reused resources and its issue thread on a CPU cache.

CPU (CI): the issue thread's path on a CPU KV cache (copies made on the thread, off the
caller's), the gather index written into a given buffer. CUDA (where present): staged
copies reusing one direction's staging memory, index buffers and events across jobs of
different sizes, with many jobs in flight at once.
"""

from __future__ import annotations

import array
import queue
import threading
import types

import pytest
import torch
from test_offload_staged import carved_planes, cpu_plan, per_layer_caches, store_then_load
from test_offload_transfer import CUDA_ONLY, cross_layer_cache

from connectors.offload.transfer import KVBlockMover
from connectors.offload.transfer import issue_thread as _issuer
from connectors.offload.transfer import staging as _staged
from connectors.offload.transfer.copy_plan import cpu_runs, estimate_joint_runs, scan_runs

LAYOUTS = ["cross-layer", "per-layer"]


def caches(layout: str, device: str) -> dict:
    return cross_layer_cache(device)[1] if layout == "cross-layer" else per_layer_caches(device)


def issue_thread_name(mover: KVBlockMover) -> str:
    return f"kv-transfer-issue-{id(mover):x}"


# ------------------------------------------------------------------ id scans
@pytest.mark.parametrize("seed", range(6))
def test_cpu_runs_and_the_joint_estimate_agree_with_the_full_scan(seed: int) -> None:
    """The CPU runs alone equal the full scan's; the estimate is exact up to 16 blocks."""
    gen = torch.Generator().manual_seed(seed)
    n = 1 + seed * 3
    gpu = torch.randperm(40, generator=gen)[:n].tolist()
    cpu = sorted(torch.randperm(30, generator=gen)[:n].tolist())
    gpu[: n // 2] = range(5, 5 + n // 2)  # a joint run where the CPU ids run too
    joint, runs = scan_runs(gpu, cpu)
    assert cpu_runs(cpu) == runs
    assert estimate_joint_runs(gpu, cpu) == joint


@pytest.mark.parametrize("ids", [
    list(range(7, 263)),  # one run: the fast path
    [*range(7, 130), 131, *range(130, 131), *range(132, 263)],  # right ends, one swap inside
    [5, 4, 6, 7],  # right span, wrong order
    [3],
], ids=["one-run", "swap-inside", "unordered", "single"])
def test_cpu_runs_of_arrays_and_lists_match_the_full_scan(ids: list[int]) -> None:
    """A job whose ends look like one run is one run only if every id follows the last."""
    expected = scan_runs(ids, ids)[1]
    assert cpu_runs(ids) == expected
    assert cpu_runs(array.array("q", ids)) == expected
    assert (len(expected) == 1) == (ids == list(range(ids[0], ids[0] + len(ids))))


def test_joint_estimate_of_long_jobs_tells_runs_from_scattered_ids() -> None:
    scattered = torch.randperm(4096, generator=torch.Generator().manual_seed(1))[:256].tolist()
    consecutive = list(range(256))
    assert estimate_joint_runs(scattered, consecutive) == 256
    assert estimate_joint_runs(list(range(100, 356)), consecutive) == 1
    # one break in the first 16 pairs: about 256 / 16 runs
    ids = [*range(8), *range(50, 298)]
    assert 16 <= estimate_joint_runs(ids, consecutive) <= 20


# ------------------------------------------------------------------ gather index
def test_gather_index_into_a_given_buffer_matches_a_new_one() -> None:
    memory, planes = carved_planes()
    plan = cpu_plan(planes, memory, torch.zeros(3, 7, 64, dtype=torch.uint8), None)
    ids = torch.tensor([7, 2, 9, 4])
    out = torch.full((plan.index_length(4) + 5,), -1, dtype=torch.int64)
    got = plan.gather_index(ids, out=out[:plan.index_length(4)])
    assert got.data_ptr() == out.data_ptr()
    assert got.tolist() == plan.gather_index(ids).tolist()
    assert plan.index_length(4) == 3 * 4
    assert out[12:].tolist() == [-1] * 5  # nothing written past the job's entries


# ------------------------------------------------------------------ issue thread, CPU cache
@pytest.mark.parametrize("layout", LAYOUTS)
def test_issue_thread_on_cpu_many_jobs_in_flight_are_byte_exact(layout: str) -> None:
    """Stores and loads queued back to back on the thread land byte-exact, reported in order."""
    views = caches(layout, "cpu")
    original = {k: v.clone() for k, v in views.items()}
    mover = KVBlockMover(views, num_cpu_blocks=8, issue_thread=True)
    assert mover._issuer is not None
    mover.submit_store(1, [7, 2, 9], [0, 1, 2])
    mover.submit_store(2, [4, 11], [5, 3])
    mover.submit_store(3, [0], [99])  # out of range: fails on the thread, not in the caller
    results = []
    while len(results) < 3:  # a caller polling get_finished, as the worker does
        results += mover.get_finished()
    assert [(r.job_id, r.success, r.is_store) for r in results] == [
        (1, True, True), (2, True, True), (3, False, True)]
    assert all(r.issue_seconds is not None and r.seconds is not None for r in results)
    for v in views.values():
        v.fill_(-7.0)
    mover.submit_load(4, [0, 1, 2], [1, 3, 5])
    mover.submit_load(5, [5, 3], [6, 8])
    mover.wait()
    assert [(r.job_id, r.success) for r in mover.get_finished()] == [(4, True), (5, True)]
    for k, v in views.items():
        for s, d in ((7, 1), (2, 3), (9, 5), (4, 6), (11, 8)):
            assert torch.equal(v[d].view(torch.int16), original[k][s].view(torch.int16))
        assert bool((v[[0, 2, 4, 7, 9, 10, 11]] == -7.0).all())
    mover.shutdown()


def test_issue_thread_on_cpu_wait_for_some_jobs_and_shutdown() -> None:
    """wait(ids) returns once those jobs are done; shutdown finishes the rest, stops the thread."""
    base, views = cross_layer_cache("cpu")
    mover = KVBlockMover(views, num_cpu_blocks=4, issue_thread=True)
    assert any(t.name == issue_thread_name(mover) for t in threading.enumerate())
    mover.submit_store(1, [3], [0])
    mover.submit_store(2, [5], [1])
    mover.wait([2])
    assert torch.equal(mover.cpu_planes[0][1], mover.layout.planes[0][5])
    mover.submit_store(3, [6, 7], [2, 3])
    mover.shutdown()
    assert not any(t.name == issue_thread_name(mover) for t in threading.enumerate())
    assert [(r.job_id, r.success) for r in mover.get_finished()] == [
        (1, True),
        (2, True),
        (3, True),
    ]
    assert torch.equal(mover.cpu_planes[0][3], mover.layout.planes[0][7])
    # After shutdown a job is still carried out (on the caller's thread).
    mover.submit_load(4, [2], [0])
    assert [(r.job_id, r.success) for r in mover.get_finished()] == [(4, True)]
    assert torch.equal(base[0], base[6])


def test_a_waiter_issues_a_job_the_delayed_thread_has_not_begun(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The issue thread's start delay never delays a job that a caller waits for."""
    _, views = cross_layer_cache("cpu")
    mover = KVBlockMover(views, num_cpu_blocks=4, issue_thread=True)
    assert mover._issuer is not None
    mover._issuer.delay = 2.0  # longer than the test: the thread sleeps through it
    issuers: list[str] = []
    real_copy = mover.copier._copy

    def recording_copy(*args: object) -> None:
        issuers.append(threading.current_thread().name)
        real_copy(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(mover.copier, "_copy", recording_copy)
    mover.submit_store(1, [3], [0])
    mover.wait()  # returns at once: this thread issued the job
    assert issuers == [threading.current_thread().name]
    assert [(r.job_id, r.success) for r in mover.get_finished()] == [(1, True)]
    assert torch.equal(mover.cpu_planes[0][0], mover.layout.planes[0][3])
    mover._issuer.close(join=False)  # the sleeping thread finds the job claimed, then stops


class _AlwaysBlockingQueue(queue.SimpleQueue):  # type: ignore[type-arg]
    """Every get goes the way of a thread woken from idle (never ``get_nowait``)."""

    def get_nowait(self):  # type: ignore[no-untyped-def]
        raise queue.Empty


def test_issue_thread_drops_stale_work_before_its_start_delay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Work a waiting caller already did is dropped at once: no delay, no call."""
    slept: list[float] = []
    monkeypatch.setattr(_issuer, "time", types.SimpleNamespace(sleep=slept.append))
    monkeypatch.setattr(_issuer.queue, "SimpleQueue", _AlwaysBlockingQueue)
    thread = _issuer.IssueThread(torch.device("cpu"), name="stale-test", delay=0.25)
    ran: list[str] = []
    thread.submit(lambda: ran.append("stale"), lambda: True)
    thread.submit(lambda: ran.append("fresh"), lambda: False)
    thread.submit(lambda: ran.append("unchecked"))
    thread.close()
    assert ran == ["fresh", "unchecked"]
    assert slept == [0.25, 0.25]  # woken twice for work to do, never for the stale item


# ------------------------------------------------------------------ CUDA: reused staging
@CUDA_ONLY
def test_staged_jobs_reuse_buffers_and_stay_byte_exact_with_many_in_flight() -> None:
    """Jobs of growing size, both directions, none waited for until the end."""
    views = per_layer_caches("cuda", num_layers=4)
    mover = KVBlockMover(views, num_cpu_blocks=12, method="gather")
    assert mover.copier.staging is not None
    original = {k: v.clone() for k, v in views.items()}
    mover.submit_store(1, [7, 2], [0, 1])
    mover.wait()
    staging = mover.copier.staging[True]._staging
    assert staging is not None
    mover.submit_store(2, [9, 4], [2, 3])  # same size: the same staging memory
    mover.wait()
    assert mover.copier.staging[True]._staging is staging
    mover.submit_store(3, [11, 0, 5, 6, 1], [4, 5, 6, 7, 8])  # larger: grown
    mover.wait()
    assert [r.success for r in mover.get_finished()] == [True, True, True]
    grown = mover.copier.staging[True]._staging
    assert grown is not None and grown.shape[0] == 4 * 5
    # Loads of all of them back to back, into other blocks, after overwriting the cache.
    cpu_ids = list(range(9))
    src = [7, 2, 9, 4, 11, 0, 5, 6, 1]
    dst = [0, 1, 2, 3, 4, 5, 6, 7, 8]
    for v in views.values():
        v.fill_(-7.0)
    for job, (c, d) in enumerate(zip(cpu_ids, dst, strict=True)):
        mover.submit_load(10 + job, [c], [d])
    mover.submit_load(30, cpu_ids[:4], [9, 10, 11, 8])  # a larger load after the small ones
    mover.wait()
    assert all(r.success for r in mover.get_finished())
    for k, v in views.items():
        for s, d in zip(src[:8], dst[:8], strict=True):
            assert torch.equal(v[d].view(torch.int16), original[k][s].view(torch.int16))
        for s, d in zip(src[:4], [9, 10, 11, 8], strict=True):
            assert torch.equal(v[d].view(torch.int16), original[k][s].view(torch.int16))
    mover.shutdown()


@CUDA_ONLY
def test_events_are_reused_across_jobs() -> None:
    """A reported job's timing events go back to the pool; the next jobs take them."""
    _, views = cross_layer_cache("cuda")
    mover = KVBlockMover(views, num_cpu_blocks=4)
    for job in range(3):
        mover.submit_store(job, [job], [job])
        mover.wait()
        assert [r.success for r in mover.get_finished()] == [True]
    free = mover._timing_events._free
    assert len(free) == 2  # one start and one end event, reused by every job
    assert len(mover._ready_events._free) == 1
    mover.shutdown()


@CUDA_ONLY
@pytest.mark.parametrize("layout", LAYOUTS)
def test_batched_job_with_a_head_is_byte_exact(layout: str) -> None:
    """A batched job long enough for its first blocks to go out ahead of the rest."""
    base, views = cross_layer_cache("cuda", num_blocks=80)
    if layout == "per-layer":
        views = {k: v.contiguous() for k, v in views.items()}
    mover = KVBlockMover(views, num_cpu_blocks=40, method="batched")
    if not mover.batched_available:
        pytest.skip("no cudaMemcpyBatchAsync in this CUDA runtime (needs 12.8+)")
    assert mover.copier.head_blocks and 40 >= 4 * mover.copier.head_blocks
    original = {k: v.clone() for k, v in views.items()}
    src = torch.randperm(80, generator=torch.Generator().manual_seed(3))[:40].tolist()
    src[3:6] = [70, 71, 72]  # a run across the head's end (blocks 0-7 of the job)
    src[6:9] = [73, 74, 75]
    cpu = list(range(40))
    mover.submit_store(1, src, cpu)
    mover.wait()
    for v in views.values():
        v.fill_(-7.0)
    dst = list(range(40, 80))
    mover.submit_load(2, cpu, dst)
    mover.wait()
    assert [r.success for r in mover.get_finished()] == [True, True]
    for k, v in views.items():
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(v[d].view(torch.int16), original[k][s].view(torch.int16))
        assert bool((v[:40] == -7.0).all())


@CUDA_ONLY
def test_staged_job_in_many_stages_reuses_stage_views(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small stages (so a small job has several): byte-exact, and the views made once."""
    monkeypatch.setattr(_staged, "_STAGE_BYTES", 1024)
    views = per_layer_caches("cuda", num_layers=6)
    mover = KVBlockMover(views, num_cpu_blocks=8, method="gather")
    if mover.copier.gather_plan is None or mover.copier.gather_plan.source is None:
        pytest.skip("the allocator placed these layers at no common row multiple")
    assert len(_staged.group_planes(6, 5 * mover.layout.block_bytes)) > 1
    buffers = mover.copier.staging[True]
    store_then_load(mover, views, [7, 2, 9, 4, 11], [1, 2, 5, 6, 7], [0, 3, 5, 6, 10])
    ((key, views_of_job),) = buffers._views.items()
    mover.submit_store(3, [1, 3, 5, 8, 10], [0, 1, 2, 3, 4])
    mover.wait()
    assert [r.success for r in mover.get_finished()] == [True]
    assert buffers._views.get(key) is views_of_job  # same job size: the same views, not new ones
    mover.shutdown()
