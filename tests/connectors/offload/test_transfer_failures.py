"""A job that fails after some of its copies were queued (CUDA).

Such a job is reported failed, and its caller then reuses what it named: a failed store's
CPU slots are freed for the next store, a failed load's device blocks are recomputed by
the next forward, and the direction's staging memory serves the next staged job. So the
job must be reported only once every copy or kernel it queued has finished, on every
stream it used; otherwise a copy still queued behind the model's work lands later, into
memory that already belongs to someone else.

The tests keep the device busy (``torch.cuda._sleep`` on the compute stream, which every
job waits for), make one copy call of a job fail halfway, and check that when the job is
reported its streams hold no queued work of it.
"""

from __future__ import annotations

import pytest
import torch
from test_offload_staged import per_layer_caches
from test_offload_transfer import CUDA_ONLY, cross_layer_cache

from connectors.offload.transfer import KVBlockMover
from connectors.offload.transfer import staging as _staged

_BUSY_CYCLES = 2_000_000_000  # ~1 s of device time: the job's copies sit behind it


def _fail_second_call(real, code):  # type: ignore[no-untyped-def]
    calls = []

    def call(*args):  # type: ignore[no-untyped-def]
        calls.append(args)
        return code() if len(calls) == 2 else real(*args)

    return call


def _report_of(mover: KVBlockMover, job_id: int):  # type: ignore[no-untyped-def]
    """Poll until ``job_id`` is reported; return its result."""
    while True:
        for result in mover.get_finished():
            if result.job_id == job_id:
                return result


@CUDA_ONLY
def test_job_failing_after_a_queued_copy_is_reported_after_that_copy() -> None:
    _, views = cross_layer_cache("cuda")
    mover = KVBlockMover(views, num_cpu_blocks=8, method="coalesced", issue_thread=False)
    if mover.copier.memcpy is None:
        pytest.skip("no CUDA runtime library loadable by ctypes (cudaMemcpyAsync)")
    mover.copier.memcpy = _fail_second_call(mover.copier.memcpy, lambda: 1)
    torch.cuda._sleep(_BUSY_CYCLES)
    mover.submit_store(1, [3, 7], [0, 5])  # two runs: the first is queued, the second fails
    result = _report_of(mover, 1)
    assert not result.success
    # Reported: nothing of the job may still be queued on its stream.
    assert mover._streams[True].query()
    torch.cuda.synchronize()
    mover.shutdown()


@CUDA_ONLY
def test_staged_job_failing_midway_is_reported_after_its_kernels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_staged, "_STAGE_BYTES", 1024)  # a small job in several stages
    views = per_layer_caches("cuda", num_layers=6)
    mover = KVBlockMover(views, num_cpu_blocks=8, method="gather", issue_thread=False)
    assert len(_staged.group_planes(6, 5 * mover.layout.block_bytes)) > 1

    real_dma = _staged._dma
    calls = []

    def dma(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 2:  # stage 1's DMA: stage 1's gather kernel is already queued
            msg = "injected copy failure"
            raise RuntimeError(msg)
        return real_dma(*args, **kwargs)

    # A first job of the same size allocates the direction's buffers (an allocation may
    # wait for the device, which would end the busy period before the job is issued).
    mover.submit_store(0, [0, 1, 3, 8, 10], [0, 3, 4, 5, 6])
    mover.wait()
    assert [r.success for r in mover.get_finished()] == [True]
    monkeypatch.setattr(_staged, "_dma", dma)
    torch.cuda._sleep(_BUSY_CYCLES)
    mover.submit_store(1, [7, 2, 9, 4, 11], [1, 2, 5, 6, 7])
    result = _report_of(mover, 1)
    assert not result.success
    assert mover.copier.kernel_streams[True].query()  # its gather kernels are done
    assert mover._streams[True].query()
    monkeypatch.setattr(_staged, "_dma", real_dma)
    torch.cuda.synchronize()
    # The direction's staging memory serves the next job byte-exact.
    original = {k: v.clone() for k, v in views.items()}
    mover.submit_store(2, [1, 3, 5, 8, 10], [0, 1, 2, 3, 4])
    mover.wait()
    assert [r.success for r in mover.get_finished()] == [True]
    for v in views.values():
        v.fill_(-7.0)
    mover.submit_load(3, [0, 1, 2, 3, 4], [0, 2, 4, 6, 8])
    mover.wait()
    assert [r.success for r in mover.get_finished()] == [True]
    for k, v in views.items():
        for s, d in zip([1, 3, 5, 8, 10], [0, 2, 4, 6, 8], strict=True):
            assert torch.equal(v[d].view(torch.int16), original[k][s].view(torch.int16))
    mover.shutdown()


@CUDA_ONLY
def test_batched_job_failing_on_a_lane_is_reported_after_the_other_lanes() -> None:
    _, views = cross_layer_cache("cuda", num_blocks=24)
    mover = KVBlockMover(views, num_cpu_blocks=16, method="batched", issue_thread=False)
    if not mover.batched_available:
        pytest.skip("no cudaMemcpyBatchAsync in this CUDA runtime (needs 12.8+)")
    calls = []
    real = mover.copier.batch_memcpy

    def batch(*args):  # type: ignore[no-untyped-def]
        calls.append(1)
        return 1 if len(calls) == 3 else real(*args)  # lanes 0 and 1 queued, lane 2 fails

    mover.copier.batch_memcpy = batch
    torch.cuda._sleep(_BUSY_CYCLES)
    gpu = [0, 2, 4, 6, 8, 10, 12, 14, 1, 3]  # ten single-block runs: split over the lanes
    mover.submit_store(1, gpu, list(range(10)))
    result = _report_of(mover, 1)
    assert not result.success
    assert len(calls) == 3
    assert all(lane.query() for lane in mover.copier.lanes[True])
    assert mover._streams[True].query()
    torch.cuda.synchronize()
    mover.shutdown()
