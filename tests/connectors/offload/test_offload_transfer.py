"""Worker-side block mover: byte-exact round trips on CPU (CI) and CUDA (where present)."""

from __future__ import annotations

import ctypes
import random
import threading

import pytest
import torch

from connectors.offload.transfer import (
    KVBlockMover,
    build_block_layout,
    chunk_to_sub_block_ids,
    coalesce_runs,
)
from connectors.offload.transfer.copy_plan import CopyPlan, run_starts
from connectors.offload.transfer.jobs import Job
from connectors.offload.transfer.layout import _plane_of

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=[
        pytest.mark.cuda,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    ]),
]
ALL_METHODS = ["auto", "pitched", "batched", "coalesced", "per_block", "gather"]
METHODS = pytest.mark.parametrize("method", ALL_METHODS, ids=ALL_METHODS)
CUDA_ONLY = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

NUM_BLOCKS, NUM_LAYERS, BLOCK_SIZE, HEADS, HEAD = 12, 3, 4, 2, 8


def cross_layer_cache(device: str, num_blocks: int = NUM_BLOCKS) -> tuple[torch.Tensor, dict]:
    """The engine's layout: one tensor, per-layer views handed to the connector."""
    gen = torch.Generator().manual_seed(1234)
    base = torch.randn(num_blocks, NUM_LAYERS, 2, BLOCK_SIZE, HEADS, HEAD, generator=gen)
    base = base.to(device=device, dtype=torch.bfloat16)
    return base, {f"layer.{i}": base[:, i] for i in range(NUM_LAYERS)}


def snapshot(views: dict) -> list[torch.Tensor]:
    return [v.clone() for v in views.values()]


def test_layout_recovers_cross_layer_block() -> None:
    base, views = cross_layer_cache("cpu")
    shuffled = dict(reversed(list(views.items())))  # dict order must not matter
    layout = build_block_layout(shuffled)
    assert layout.cross_layer and len(layout.planes) == 1
    plane = layout.planes[0]
    assert plane.shape == (NUM_BLOCKS, base[0].numel() * 2)
    assert torch.equal(plane[5], base[5].contiguous().view(torch.uint8).flatten())


def test_layout_falls_back_to_per_layer_planes() -> None:
    layers = {f"l{i}": torch.randn(NUM_BLOCKS, 2, BLOCK_SIZE, HEADS, HEAD) for i in range(3)}
    layout = build_block_layout(layers)
    assert not layout.cross_layer and len(layout.planes) == 3
    # a layout where a block is not one chunk is refused with a clear message
    bad = {"x": torch.randn(2, NUM_BLOCKS, BLOCK_SIZE).transpose(0, 1)}
    with pytest.raises(ValueError, match="contiguous chunk"):
        build_block_layout(bad)


@pytest.mark.parametrize(("factor", "n", "expected"), [
    (1, 3, [4, 7, 1]),
    (3, 6, [12, 13, 14, 21, 22, 23]),
    (3, 4, [14, 21, 22, 23]),  # starts mid-chunk: skip 2 of the first chunk
], ids=["f1", "f3", "f3-mid-chunk"])
def test_chunk_to_sub_block_ids(factor: int, n: int, expected: list[int]) -> None:
    chunks = [4, 7, 1] if factor == 1 else [4, 7]
    assert chunk_to_sub_block_ids(chunks, factor, n) == expected


def test_chunk_to_sub_block_ids_rejects_mismatch() -> None:
    with pytest.raises(ValueError, match="cannot hold exactly"):
        chunk_to_sub_block_ids([1, 2], 3, 7)


def test_coalesce_runs() -> None:
    assert coalesce_runs([3, 4, 5, 9, 10, 2], [0, 1, 2, 3, 4, 8]) == [
        (3, 0, 3),
        (9, 3, 2),
        (2, 8, 1),
    ]
    assert coalesce_runs([], []) == []


@pytest.mark.parametrize("device", DEVICES)
@METHODS
@pytest.mark.parametrize("factor", [1, 3], ids=["factor1", "factor3"])
def test_round_trip_is_byte_exact(device: str, method: str, factor: int) -> None:
    """GPU -> CPU -> GPU moves exactly the chosen blocks and leaves the others alone."""
    base, views = cross_layer_cache(device)
    mover = KVBlockMover(views, num_cpu_blocks=4 * factor, method=method)
    assert mover.layout.cross_layer
    # factor 3: 5 GPU blocks in 2 chunks, so the transfer starts mid-chunk
    src_gpu = [7, 2, 3, 4, 11, 0][: 5 if factor == 3 else 4]
    chunks = [2, 0] if factor == 3 else [1, 2, 3, 0]
    cpu_ids = chunk_to_sub_block_ids(chunks, factor, len(src_gpu))
    original = base.clone()
    mover.submit_store(1, src_gpu, cpu_ids)
    mover.wait()
    assert [(r.job_id, r.success, r.is_store) for r in mover.get_finished()] == [(1, True, True)]
    # Overwrite the whole device cache, then load the blocks into other places.
    base.fill_(-7.0)
    dst_gpu = [5, 6, 8, 1, 9, 10][: len(src_gpu)]
    mover.submit_load(2, cpu_ids, dst_gpu)
    mover.wait()
    (result,) = mover.get_finished()
    assert result.success and not result.is_store
    assert result.num_bytes == len(src_gpu) * mover.layout.block_bytes
    for s, d in zip(src_gpu, dst_gpu, strict=True):
        assert torch.equal(base[d].view(torch.int16), original[s].view(torch.int16))
    untouched = [b for b in range(NUM_BLOCKS) if b not in dst_gpu]
    assert bool((base[untouched] == -7.0).all())


@pytest.mark.parametrize("device", DEVICES)
@METHODS
def test_per_layer_fallback_round_trip(device: str, method: str) -> None:
    gen = torch.Generator().manual_seed(7)
    layers = {
        f"l{i}": torch.randn(NUM_BLOCKS, 2, BLOCK_SIZE, HEADS, HEAD, generator=gen).to(device)
        for i in range(3)
    }
    original = {name: t.clone() for name, t in layers.items()}
    mover = KVBlockMover(layers, num_cpu_blocks=5, method=method)
    assert len(mover.layout.planes) == 3
    mover.submit_store(1, [9, 10, 4], [0, 1, 2])
    mover.wait()
    for t in layers.values():
        t.zero_()
    mover.submit_load(2, [2, 0, 1], [3, 5, 6])
    mover.wait()
    assert [r.success for r in mover.get_finished()] == [True, True]
    for name, t in layers.items():
        for s, d in ((4, 3), (9, 5), (10, 6)):
            assert torch.equal(t[d], original[name][s])
        assert not t[[0, 1, 2, 4, 7, 8, 9, 10, 11]].any()


def test_out_of_range_ids_fail_the_job_not_the_caller() -> None:
    _, views = cross_layer_cache("cpu")
    mover = KVBlockMover(views, num_cpu_blocks=2)
    mover.submit_store(1, [0, 1, 2], [0, 1, 2])  # CPU id 2 does not exist
    mover.submit_load(2, [0], [NUM_BLOCKS])  # device id out of range
    mover.submit_store(3, [0], [1])
    results = {r.job_id: r.success for r in mover.get_finished()}
    assert results == {1: False, 2: False, 3: True}
    assert mover.num_pending == 0


def test_exception_during_copy_fails_only_that_job(monkeypatch: pytest.MonkeyPatch) -> None:
    _, views = cross_layer_cache("cpu")
    mover = KVBlockMover(views, num_cpu_blocks=4)
    real_copy = mover.copier._copy

    def broken(job: Job, *args: object) -> None:
        if job.job_id == 2:
            raise RuntimeError("DMA engine on fire")
        real_copy(job, *args)

    monkeypatch.setattr(mover.copier, "_copy", broken)
    mover.submit_store(1, [0], [0])
    mover.submit_store(2, [1], [1])
    mover.submit_load(3, [0], [2])
    assert [(r.job_id, r.success) for r in mover.get_finished()] == [
        (1, True),
        (2, False),
        (3, True),
    ]


def test_invalid_arguments() -> None:
    _, views = cross_layer_cache("cpu")
    with pytest.raises(ValueError, match="unknown transfer method 'dma'"):
        KVBlockMover(views, 4, method="dma")
    with pytest.raises(ValueError, match="num_cpu_blocks"):
        KVBlockMover(views, 0)
    assert KVBlockMover(views, 1).method == "auto"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_store_waits_for_compute_stream() -> None:
    """A store submitted right after a slow kernel must see that kernel's writes."""
    base, views = cross_layer_cache("cuda", num_blocks=64)
    mover = KVBlockMover(views, num_cpu_blocks=64)
    assert mover.cpu_buffer.is_pinned()
    torch.cuda._sleep(50_000_000)  # keep the compute stream busy
    base.fill_(3.0)
    mover.submit_store(1, list(range(64)), list(range(64)))
    mover.wait()
    assert mover.get_finished()[0].success
    expected = torch.full_like(base[0], 3.0).cpu().view(torch.uint8).flatten()
    assert all(torch.equal(mover.cpu_planes[0][i], expected) for i in range(64))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("raw", [True, False], ids=["cudaMemcpyAsync", "Tensor.copy_"])
def test_both_copy_primitives_are_byte_exact_on_cuda(raw: bool) -> None:
    """The ctypes cudaMemcpyAsync path and the Tensor.copy_ fallback move identical bytes."""
    base, views = cross_layer_cache("cuda")
    mover = KVBlockMover(views, num_cpu_blocks=4, method="coalesced", raw_memcpy=raw)
    assert (mover.copier.memcpy is not None) is raw
    original = base.clone()
    mover.submit_store(1, [7, 2, 3, 4], [0, 1, 2, 3])
    mover.wait()  # the store stream reads what fill_ below would overwrite
    base.fill_(-7.0)
    mover.submit_load(2, [0, 1, 2, 3], [5, 6, 8, 1])
    mover.wait()
    assert all(r.success for r in mover.get_finished())
    for s, d in zip([7, 2, 3, 4], [5, 6, 8, 1], strict=True):
        assert torch.equal(base[d].view(torch.int16), original[s].view(torch.int16))


def test_raw_memcpy_requires_a_cuda_cache() -> None:
    """Asking for the CUDA runtime copy path on a CPU cache is a clear error."""
    _, views = cross_layer_cache("cpu")
    with pytest.raises(ValueError, match="needs a CUDA KV cache"):
        KVBlockMover(views, num_cpu_blocks=4, raw_memcpy=True)


# ------------------------------------------------------------------ batched descriptors
def run_descriptors(dsts: torch.Tensor, srcs: torch.Tensor, sizes: torch.Tensor) -> None:
    """Execute copy descriptors on CPU memory, as cudaMemcpyBatchAsync would on a device."""
    assert dsts.dtype == srcs.dtype == sizes.dtype == torch.int64
    assert dsts.is_contiguous() and srcs.is_contiguous() and sizes.is_contiguous()
    for d, s, n in zip(dsts.tolist(), srcs.tolist(), sizes.tolist(), strict=True):
        ctypes.memmove(d, s, n)


def test_run_starts_matches_coalesce_runs() -> None:
    g, c = [3, 4, 5, 9, 10, 2, 3], [0, 1, 2, 3, 4, 8, 8]
    gs, cs, n = run_starts(torch.tensor(g), torch.tensor(c))
    assert list(zip(gs.tolist(), cs.tolist(), n.tolist(), strict=True)) == coalesce_runs(g, c)
    gs, cs, n = run_starts(torch.tensor([6]), torch.tensor([0]))
    assert (gs.tolist(), cs.tolist(), n.tolist()) == ([6], [0], [1])


def _descriptor_round_trip(planes_owner: dict, mover: KVBlockMover) -> None:
    """Store then load through descriptors executed with memmove; compare with copy_."""
    original = {k: v.clone() for k, v in planes_owner.items()}
    src_gpu, cpu_ids = [7, 8, 9, 2, 0], [1, 2, 3, 0, 4]  # one run of 3 plus two singles
    g, c = torch.tensor(src_gpu), torch.tensor(cpu_ids)
    run_descriptors(*mover.copier.plan.descriptors(g, c, is_store=True))
    for plane, cpu_plane in zip(mover.layout.planes, mover.cpu_planes, strict=True):
        for gi, ci in zip(src_gpu, cpu_ids, strict=True):
            assert torch.equal(cpu_plane[ci], plane[gi])
    for t in planes_owner.values():
        t.fill_(-3.0)
    dst_gpu = [1, 2, 3, 11, 5]
    run_descriptors(*mover.copier.plan.descriptors(torch.tensor(dst_gpu), c, is_store=False))
    for name, t in planes_owner.items():
        for s, d in zip(src_gpu, dst_gpu, strict=True):
            assert torch.equal(t[d].view(torch.int16), original[name][s].view(torch.int16))
        others = [b for b in range(NUM_BLOCKS) if b not in dst_gpu]
        assert bool((t[others] == -3.0).all())


def test_batched_descriptors_move_exact_bytes_cross_layer() -> None:
    """The addresses given to cudaMemcpyBatchAsync copy exactly the right rows (engine layout)."""
    base, views = cross_layer_cache("cpu")
    mover = KVBlockMover(views, num_cpu_blocks=5)
    dsts, _, sizes = mover.copier.plan.descriptors(
        torch.tensor([7, 8, 9, 2]), torch.tensor([1, 2, 3, 0]), is_store=True
    )
    row = mover.layout.planes[0].shape[1]
    assert sizes.tolist() == [3 * row, row]  # the run 7-8-9 -> 1-2-3 is one copy
    assert dsts.tolist()[0] == mover.cpu_planes[0][1].data_ptr()
    _descriptor_round_trip({"base": base}, mover)


def test_batched_descriptors_move_exact_bytes_per_layer() -> None:
    """vLLM's layout: one descriptor per (plane, run), every plane addressed correctly."""
    gen = torch.Generator().manual_seed(3)
    layers = {
        f"l{i}": torch.randn(NUM_BLOCKS, 2, BLOCK_SIZE, HEADS, HEAD, generator=gen).to(
            torch.bfloat16
        )
        for i in range(4)
    }
    mover = KVBlockMover(layers, num_cpu_blocks=5)
    assert len(mover.layout.planes) == 4
    dsts, _, _ = mover.copier.plan.descriptors(
        torch.tensor([7, 8, 9, 2]), torch.tensor([1, 2, 3, 0]), is_store=True
    )
    assert dsts.numel() == 4 * 2
    _descriptor_round_trip(layers, mover)


def test_batched_descriptors_copy_row_by_row_when_rows_have_gaps() -> None:
    """A plane whose rows are not back to back (e.g. padded blocks) never gets a multi-row copy."""
    padded = torch.randn(NUM_BLOCKS, 2 * 256).to(torch.bfloat16)
    view = padded[:, :256]  # each block dense, but followed by a gap of the same size
    layout_plane = _plane_of(view)
    assert layout_plane.stride(0) > layout_plane.shape[1]
    cpu = torch.zeros(5, layout_plane.shape[1], dtype=torch.uint8)
    plan = CopyPlan([layout_plane], [cpu])
    dsts, srcs, sizes = plan.descriptors(
        torch.tensor([7, 8, 9]), torch.tensor([1, 2, 3]), is_store=True
    )
    assert sizes.tolist() == [layout_plane.shape[1]] * 3
    run_descriptors(dsts, srcs, sizes)
    for g, c in ((7, 1), (8, 2), (9, 3)):
        assert torch.equal(cpu[c], layout_plane[g])
    assert not cpu[[0, 4]].any()


def test_ids_are_checked_before_any_copy() -> None:
    """Mismatched lengths and nested ids fail the job with a message naming them."""
    _, views = cross_layer_cache("cpu")
    mover = KVBlockMover(views, num_cpu_blocks=4)
    mover.submit_store(1, [0, 1], [0])
    mover.submit_store(2, [[0, 1]], [[0, 1]])
    mover.submit_store(3, [], [])  # empty jobs succeed and move nothing
    results = {r.job_id: r.success for r in mover.get_finished()}
    assert results == {1: False, 2: False, 3: True}


@CUDA_ONLY
@pytest.mark.parametrize("layout", ["cross-layer", "per-layer"])
def test_batched_memcpy_is_byte_exact_on_cuda(layout: str) -> None:
    """cudaMemcpyBatchAsync (where the runtime has it) moves exactly the chosen blocks."""
    base, views = cross_layer_cache("cuda")
    if layout == "per-layer":
        views = {k: v.contiguous() for k, v in views.items()}
    mover = KVBlockMover(views, num_cpu_blocks=6, method="batched")
    if not mover.batched_available:
        pytest.skip("no cudaMemcpyBatchAsync in this CUDA runtime (needs 12.8+)")
    original = {k: v.clone() for k, v in views.items()}
    mover.submit_store(1, [7, 8, 9, 2, 0], [1, 2, 3, 0, 5])
    mover.wait()
    for v in views.values():
        v.fill_(-7.0)
    mover.submit_load(2, [1, 2, 3, 0, 5], [4, 5, 6, 11, 10])
    mover.wait()
    assert all(r.success for r in mover.get_finished())
    for k, v in views.items():
        for s, d in zip([7, 8, 9, 2, 0], [4, 5, 6, 11, 10], strict=True):
            assert torch.equal(v[d].view(torch.int16), original[k][s].view(torch.int16))
        assert bool((v[[1, 3, 7]] == -7.0).all())


# ------------------------------------------------------------------ issue thread
@pytest.mark.parametrize("method", ["auto", "batched", "gather"])
def test_issue_thread_round_trip_is_byte_exact(method: str) -> None:
    """Copies issued from the background thread move the same bytes as inline ones."""
    base, views = cross_layer_cache("cpu")
    mover = KVBlockMover(views, num_cpu_blocks=4, method=method, issue_thread=True)
    original = base.clone()
    mover.submit_store(1, [7, 2, 3, 4], [0, 1, 2, 3])
    mover.wait()
    base.fill_(-7.0)
    mover.submit_load(2, [0, 1, 2, 3], [5, 6, 8, 1])
    mover.wait()
    results = mover.get_finished()
    assert [(r.job_id, r.success) for r in results] == [(1, True), (2, True)]
    assert all(r.issue_seconds is not None for r in results)
    for s, d in zip([7, 2, 3, 4], [5, 6, 8, 1], strict=True):
        assert torch.equal(base[d].view(torch.int16), original[s].view(torch.int16))
    mover.shutdown()


def test_get_finished_waits_until_the_issue_thread_has_issued(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A job still queued on the issue thread is neither lost nor left behind.

    get_finished waits for the thread (releasing the GIL), so a caller polling in a tight
    loop cannot starve it: on an H100 an engine spun 10,000 empty steps waiting for loads.
    """
    _, views = cross_layer_cache("cpu")
    mover = KVBlockMover(views, num_cpu_blocks=4, issue_thread=True)
    release, entered = threading.Event(), threading.Event()
    real_copy = mover.copier._copy

    def slow_copy(job: Job, *args: object) -> None:
        entered.set()
        assert release.wait(10)
        real_copy(job, *args)

    monkeypatch.setattr(mover.copier, "_copy", slow_copy)
    mover.submit_store(1, [0], [0])
    mover.submit_store(2, [0, 1], [0])  # fails in the caller
    assert entered.wait(10)
    timer = threading.Timer(0.2, release.set)
    timer.start()
    results = mover.get_finished()
    assert release.is_set()  # it returned only after the thread issued job 1
    assert [(r.job_id, r.success) for r in results] == [(1, True), (2, False)]
    assert mover.num_pending == 0
    timer.join()
    mover.shutdown()
    assert not any(t.name == f"kv-transfer-issue-{id(mover):x}" for t in threading.enumerate())


# ------------------------------------------------------------------ pitched (2D) copies
def spaced_layers(device: str, num_layers: int = 4) -> tuple[torch.Tensor, dict]:
    """Per-layer tensors carved from one allocation: equally spaced planes."""
    gen = torch.Generator().manual_seed(5)
    whole = torch.randn(num_layers, NUM_BLOCKS, 2, BLOCK_SIZE, HEADS, HEAD, generator=gen)
    whole = whole.to(device=device, dtype=torch.bfloat16)
    return whole, {f"l{i}": whole[i] for i in range(num_layers)}


def run_2d_copies(copies: list[tuple[int, int, int, int, int, int]]) -> None:
    """Execute 2D copy descriptors on CPU memory, as cudaMemcpy2DAsync would."""
    for dst, dpitch, src, spitch, width, height in copies:
        assert width <= min(dpitch, spitch)
        for r in range(height):
            ctypes.memmove(dst + r * dpitch, src + r * spitch, width)


def test_pitched_copies_move_exact_bytes_for_equally_spaced_layers() -> None:
    """One 2D copy per run covers that run in every layer, and nothing else."""
    whole, layers = spaced_layers("cpu")
    mover = KVBlockMover(layers, num_cpu_blocks=5)
    assert mover.copier.plan.pitch is not None
    original = whole.clone()
    g, c = torch.tensor([7, 8, 9, 2, 0]), torch.tensor([1, 2, 3, 0, 4])
    copies = mover.copier.plan.pitched_copies(g, c, is_store=True)
    assert [(w, h) for *_, w, h in copies] == [
        (3 * mover.layout.planes[0].shape[1], 4),
        (mover.layout.planes[0].shape[1], 4),
        (mover.layout.planes[0].shape[1], 4),
    ]
    run_2d_copies(copies)
    whole.fill_(-3.0)
    run_2d_copies(
        mover.copier.plan.pitched_copies(torch.tensor([1, 2, 3, 11, 5]), c, is_store=False)
    )
    for s_, d in zip([7, 8, 9, 2, 0], [1, 2, 3, 11, 5], strict=True):
        assert torch.equal(whole[:, d].view(torch.int16), original[:, s_].view(torch.int16))
    others = [b for b in range(NUM_BLOCKS) if b not in (1, 2, 3, 11, 5)]
    assert bool((whole[:, others] == -3.0).all())


def test_no_pitch_for_unevenly_spaced_layers() -> None:
    """Separately allocated layers with uneven gaps keep per-plane descriptors."""
    whole = torch.zeros(5, NUM_BLOCKS, 64, dtype=torch.uint8)
    layers = [whole[0], whole[1], whole[3]]  # gaps of 1 and 2 plane sizes
    mover = KVBlockMover(layers, num_cpu_blocks=2)
    assert mover.copier.plan.pitch is None
    with pytest.raises(ValueError, match="equally spaced"):
        mover.copier.plan.pitched_copies(torch.tensor([0]), torch.tensor([0]), is_store=True)


@CUDA_ONLY
@pytest.mark.parametrize("method", ["pitched", "auto"])
def test_pitched_copies_are_byte_exact_on_cuda(method: str) -> None:
    """cudaMemcpy2DAsync over equally spaced layers moves exactly the chosen blocks."""
    whole, layers = spaced_layers("cuda")
    mover = KVBlockMover(layers, num_cpu_blocks=6, method=method)
    assert mover.copier.memcpy_2d is not None
    original = whole.clone()
    mover.submit_store(1, [7, 8, 9, 2, 0], [1, 2, 3, 0, 5])
    mover.wait()
    whole.fill_(-7.0)
    mover.submit_load(2, [1, 2, 3, 0, 5], [4, 5, 6, 11, 10])
    mover.wait()
    assert all(r.success for r in mover.get_finished())
    for s_, d in zip([7, 8, 9, 2, 0], [4, 5, 6, 11, 10], strict=True):
        assert torch.equal(whole[:, d].view(torch.int16), original[:, s_].view(torch.int16))
    assert bool((whole[:, [1, 3, 7]] == -7.0).all())
    mover.shutdown()


def test_no_pitch_for_equally_spaced_planes_in_separate_allocations() -> None:
    """A 2D copy never spans allocations, even evenly spaced ones (H100: error 1)."""
    row, blocks = 64, NUM_BLOCKS
    memory = bytearray(3 * blocks * row)  # three back-to-back tensors with their own storage
    planes = [
        torch.frombuffer(
            memory, dtype=torch.uint8, offset=i * blocks * row, count=blocks * row
        ).view(blocks, row)
        for i in range(3)
    ]
    assert (
        planes[1].data_ptr() - planes[0].data_ptr() == planes[2].data_ptr() - planes[1].data_ptr()
    )
    mover = KVBlockMover(planes, num_cpu_blocks=2)
    assert mover.copier.plan.pitch is None
    # the same spacing inside one allocation does get 2D copies
    one = torch.frombuffer(memory, dtype=torch.uint8).view(3, blocks, row)
    assert KVBlockMover(list(one.unbind(0)), num_cpu_blocks=2).copier.plan.pitch is not None


@CUDA_ONLY
def test_failed_runtime_copy_fails_the_job_and_leaves_torch_usable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A failed ctypes copy fails its job and does not surface later in torch's kernels."""
    whole, layers = spaced_layers("cuda")
    mover = KVBlockMover(layers, num_cpu_blocks=6, method="pitched", issue_thread=False)
    real = mover.copier.plan.pitched_copies

    def bad(g: torch.Tensor, c: torch.Tensor, is_store: bool) -> list:
        dst, dpitch, src, spitch, width, height = real(g, c, is_store)[0]
        return [(dst, dpitch, src, spitch, dpitch + 1, height)]  # width > pitch: invalid

    monkeypatch.setattr(mover.copier.plan, "pitched_copies", bad)
    mover.submit_store(1, [3], [0])
    mover.wait()
    assert [r.success for r in mover.get_finished()] == [False]
    x = torch.arange(10, device="cuda")
    assert int(torch.index_select(x, 0, x[:3]).sum().item()) == 3  # no stale "invalid argument"
    torch.cuda.synchronize()


@CUDA_ONLY
def test_wait_releases_staging_memory_of_finished_jobs() -> None:
    """A gather job's staging buffers go back to the allocator at wait(), not at get_finished()."""
    _, layers = spaced_layers("cuda", num_layers=3)
    mover = KVBlockMover(layers, num_cpu_blocks=6, method="gather")
    mover.submit_store(1, [7, 2, 9], [0, 1, 2])
    mover.wait()
    assert all(not job.keep_alive for job in mover._jobs)
    assert [r.success for r in mover.get_finished()] == [True]
    mover.shutdown()


def _host_layouts() -> dict[str, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(99)
    cross = torch.randn(NUM_BLOCKS, NUM_LAYERS, 2, BLOCK_SIZE, HEADS, HEAD, generator=gen)
    odd = torch.randint(0, 255, (NUM_BLOCKS, 4, 5), generator=gen, dtype=torch.uint8)
    return {
        "cross-layer": {f"l{i}": cross[:, i] for i in range(NUM_LAYERS)},
        "per-layer": {
            f"l{i}": torch.randn(NUM_BLOCKS, 2, BLOCK_SIZE, HEAD, generator=gen) for i in range(3)
        },
        # Rows of 5 bytes: no int64 view, the gather runs on bytes.
        "odd rows": {f"l{i}": odd[:, i] for i in (0, 2)},
        # Every other layer of one tensor: planes with gaps between their rows.
        "strided": {f"l{i}": cross[:, i] for i in (0, 2)},
    }


@pytest.mark.parametrize("layout", list(_host_layouts()))
@pytest.mark.parametrize("method", ["auto", "coalesced", "per_block"])
def test_scattered_jobs_on_a_cpu_cache_are_byte_exact(layout: str, method: str) -> None:
    """Scattered ids on a CPU cache (gathered per plane, or copied run by run) move exactly
    the chosen rows, whatever the row size and plane spacing."""
    layers = _host_layouts()[layout]
    rng = random.Random(5)
    for trial in range(6):
        mover = KVBlockMover(layers, num_cpu_blocks=20, method=method)
        n = rng.randrange(1, NUM_BLOCKS + 1)
        src = rng.sample(range(NUM_BLOCKS), n)
        slots = rng.sample(range(20), n)
        before = {name: t.clone() for name, t in layers.items()}
        mover.submit_store(1, src, slots)
        dst = rng.sample(range(NUM_BLOCKS), n)
        mover.submit_load(2, slots, dst)
        mover.wait()
        assert [(r.job_id, r.success) for r in mover.get_finished()] == [(1, True), (2, True)]
        for name, t in layers.items():
            expected = before[name].clone()
            for s, d in zip(src, dst, strict=True):
                expected[d] = before[name][s]
            assert torch.equal(t.view(torch.uint8), expected.view(torch.uint8)), (layout, trial)
            t.copy_(before[name])  # the next trial starts from the same cache


def test_the_transfer_engine_imports_nothing_of_the_scheduler_side() -> None:
    """The worker's transfer subpackage stays importable with torch alone: it pulls in none
    of the offload package's msgspec modules (settings, records, manager)."""
    import subprocess
    import sys

    code = (
        "import sys, kvconnector_core; before = set(sys.modules); "
        "import connectors.offload.transfer; "
        "print(sorted(m for m in set(sys.modules) - before "
        "if m.startswith('connectors.offload.') and '.transfer' not in m))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
