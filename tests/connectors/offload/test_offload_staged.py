"""Staged (gather) copies and batched lanes: the arithmetic on CPU, byte-exact moves on CUDA."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
from test_offload_transfer import CUDA_ONLY, NUM_BLOCKS, cross_layer_cache, run_2d_copies

from connectors.offload.transfer import KVBlockMover
from connectors.offload.transfer.copy_plan import run_starts, scan_runs
from connectors.offload.transfer.jobs import Job
from connectors.offload.transfer.staging import (
    GatherPlan,
    group_planes,
    plan_gather,
    span_layout,
    staging_copies,
)

ROW = 64


def carved_planes(order: tuple[int, ...] = (2, 0, 1), gap: int = 2) -> tuple[torch.Tensor, list]:
    """Planes carved from one byte buffer, ``gap`` rows apart, listed out of address order."""
    stride = NUM_BLOCKS + gap
    memory = torch.randint(
        0,
        255,
        (len(order) * stride * ROW,),
        dtype=torch.uint8,
        generator=torch.Generator().manual_seed(9),
    )
    planes = [
        memory[i * stride * ROW : (i * stride + NUM_BLOCKS) * ROW].view(NUM_BLOCKS, ROW)
        for i in order
    ]
    return memory, planes


def test_span_layout_addresses_every_plane_by_row() -> None:
    memory, planes = carved_planes()
    base, first, steps, total = span_layout(
        [p.data_ptr() for p in planes], [p.stride(0) for p in planes], ROW, NUM_BLOCKS
    )
    stride = NUM_BLOCKS + 2
    assert (base, first, steps) == (memory.data_ptr(), [2 * stride, 0, stride], [1, 1, 1])
    assert total == 2 * stride + NUM_BLOCKS
    # a plane that is not a whole number of rows from the lowest one: no span
    assert span_layout([0, ROW * 5 + 8], [ROW, ROW], ROW, NUM_BLOCKS) is None
    # rows with gaps (stride 3 rows) are addressed with a step
    assert span_layout([0, 100 * ROW], [3 * ROW, ROW], ROW, 4)[1:] == ([0, 100], [3, 1], 104)


@pytest.mark.parametrize(
    ("planes", "job_bytes", "expected"),
    [
        (32, 512 << 20, [4] * 8),  # 256 blocks of 2 MiB: 8 stages (the most)
        (32, 128 << 20, [8] * 4),  # 64 blocks: 4 stages of 32 MiB
        (32, 1 << 20, [32]),  # a small job: one stage, nothing to overlap
        (3, 1 << 30, [1, 1, 1]),  # never more stages than planes
    ],
    ids=["256-blocks", "64-blocks", "small", "few-planes"],
)
def test_group_planes(planes: int, job_bytes: int, expected: list[int]) -> None:
    groups = group_planes(planes, job_bytes)
    assert [len(g) for g in groups] == expected
    assert [p for g in groups for p in g] == list(range(planes))


@pytest.mark.parametrize(
    ("planes", "job_bytes", "expected"),
    [
        (32, 512 << 20, [1, 5, 5, 5, 5, 5, 5, 1]),  # 256 blocks: short first and last stage
        (32, 128 << 20, [2, 14, 14, 2]),  # 64 blocks
        (32, 64 << 20, [16, 16]),  # two stages: nothing to taper
        (3, 1 << 30, [1, 1, 1]),
        (80, 512 << 20, [2, 13, 13, 13, 13, 13, 11, 2]),  # uneven middle
    ],
    ids=["256-blocks", "64-blocks", "two-stages", "few-planes", "80-planes"],
)
def test_group_planes_tapered(planes: int, job_bytes: int, expected: list[int]) -> None:
    """Short end stages: what nothing overlaps (a store's first gather, a load's last scatter)."""
    groups = group_planes(planes, job_bytes, taper=True)
    assert [len(g) for g in groups] == expected
    assert [p for g in groups for p in g] == list(range(planes))


def cpu_plan(
    planes: list, memory: torch.Tensor, cpu: torch.Tensor, pitch: int | None
) -> GatherPlan:
    """A GatherPlan over CPU memory (the span is a plain view), as plan_gather makes on CUDA."""
    base, first, steps, total = span_layout(
        [p.data_ptr() for p in planes], [p.stride(0) for p in planes], ROW, NUM_BLOCKS
    )
    assert base == memory.data_ptr()
    return GatherPlan(
        ROW,
        torch.uint8,
        tuple(planes),
        memory[: total * ROW].view(total, ROW),
        torch.tensor(first).view(-1, 1),
        torch.tensor(steps).view(-1, 1),
        pitch,
        tuple(cpu.unbind(0)),
    )


@pytest.mark.parametrize("two_d", [True, False], ids=["2d-per-group", "per-plane"])
def test_staged_arithmetic_round_trip_is_byte_exact(two_d: bool) -> None:
    """Gather index + staging copies store exactly the chosen rows, and load them back."""
    memory, planes = carved_planes()
    original = [p.clone() for p in planes]
    cpu = torch.zeros(3, 7, ROW, dtype=torch.uint8)
    plan = cpu_plan(planes, memory, cpu, 7 * ROW if two_d else None)
    gpu = torch.tensor([7, 2, 9, 4, 11])
    runs = [(0, 1, 2), (2, 4, 3)]  # staging rows 0-1 -> CPU 1-2, rows 2-4 -> CPU 4-6
    staging = torch.index_select(plan.source, 0, plan.gather_index(gpu))
    copies = staging_copies(plan, range(3), 5, runs, staging.data_ptr(), to_cpu=True)
    # one 2D copy per run over the group's 3 planes, or one copy per plane and run
    assert [h for *_, h in copies] == ([3] * len(runs) if two_d else [1] * (3 * len(runs)))
    run_2d_copies(copies)
    cpu_ids = [1, 2, 4, 5, 6]
    for p, plane in enumerate(planes):
        for g, c in zip(gpu.tolist(), cpu_ids, strict=True):
            assert torch.equal(cpu[p, c], plane[g])
    assert not cpu[:, [0, 3]].any()
    # load into other device blocks: CPU -> staging by the same descriptors, then scatter
    back = torch.zeros_like(staging)
    run_2d_copies(staging_copies(plan, range(3), 5, runs, back.data_ptr(), to_cpu=False))
    for plane in planes:
        plane.zero_()
    dst = torch.tensor([0, 3, 5, 6, 10])
    plan.source.index_copy_(0, plan.gather_index(dst), back)
    for p, plane in enumerate(planes):
        for s, d in zip(gpu.tolist(), dst.tolist(), strict=True):
            assert torch.equal(plane[d], original[p][s])
        assert not plane[[b for b in range(NUM_BLOCKS) if b not in dst.tolist()]].any()


def test_one_2d_copy_per_run_covers_a_group_of_planes() -> None:
    memory, planes = carved_planes()
    cpu = torch.zeros(3, 7, ROW, dtype=torch.uint8)
    plan = cpu_plan(planes, memory, cpu, 7 * ROW)
    staging = torch.index_select(plan.source, 0, plan.gather_index(torch.tensor([7, 2])))
    copies = staging_copies(plan, range(3), 2, [(0, 3, 2)], staging.data_ptr(), to_cpu=True)
    assert copies == [(cpu[0, 3].data_ptr(), 7 * ROW, staging.data_ptr(), 2 * ROW, 2 * ROW, 3)]
    run_2d_copies(copies)
    for p, plane in enumerate(planes):
        assert torch.equal(cpu[p, 3], plane[7]) and torch.equal(cpu[p, 4], plane[2])


def test_plan_gather_on_cpu_planes_uses_words_and_no_span() -> None:
    """Kernels move 16-byte words where rows allow, else 8-byte, else bytes; the span view
    exists on CUDA only."""
    _, planes = carved_planes()
    cpu = torch.zeros(3, 7, ROW, dtype=torch.uint8)
    plan = plan_gather(planes, list(cpu.unbind(0)), max_pitch=1 << 30)
    assert plan.word == torch.complex128 and plan.source is None and plan.taper
    assert plan.planes[0].shape == (NUM_BLOCKS, ROW // 16)
    assert plan.cpu_pitch == 7 * ROW
    # pitch too large
    assert plan_gather(planes, list(cpu.unbind(0)), max_pitch=ROW).cpu_pitch is None
    assert plan_gather(planes, list(cpu.unbind(0)), 0, word_bytes=8).word == torch.int64
    rows_of_8 = torch.zeros(NUM_BLOCKS, 24, dtype=torch.uint8)  # 24 bytes: 8 divides, 16 does not
    assert plan_gather([rows_of_8], [torch.zeros(2, 24, dtype=torch.uint8)], 0).word == torch.int64
    odd = torch.zeros(NUM_BLOCKS, 12, dtype=torch.uint8)
    assert plan_gather([odd], [torch.zeros(2, 12, dtype=torch.uint8)], 0).word == torch.uint8


@pytest.mark.parametrize("word_bytes", [16, 8])
def test_wide_words_gather_and_scatter_rows_bit_exact(word_bytes: int) -> None:
    """Rows moved as complex128 (or int64) elements keep every bit, NaN patterns included."""
    memory, planes = carved_planes()
    memory.view(torch.int64)[::3] = -1  # all-ones words: NaN patterns of float64
    cpu = torch.zeros(3, 7, ROW, dtype=torch.uint8)
    plan = plan_gather(planes, list(cpu.unbind(0)), 0, word_bytes=word_bytes)
    gpu = torch.tensor([7, 2, 9])
    for p, plane in enumerate(plan.planes):
        rows = torch.index_select(plane, 0, gpu)
        assert torch.equal(rows.view(torch.uint8), planes[p][gpu])
        target = torch.zeros_like(plane)
        target.index_copy_(0, gpu, rows)
        assert torch.equal(target.view(torch.uint8)[gpu], planes[p][gpu])


def per_layer_caches(device: str, num_layers: int = 4) -> dict:
    gen = torch.Generator().manual_seed(11)
    return {
        f"l{i}": torch.randn(NUM_BLOCKS, 2, 4, 2, 8, generator=gen).to(device, torch.bfloat16)
        for i in range(num_layers)
    }


def store_then_load(
    mover: KVBlockMover, views: dict, src: list[int], cpu: list[int], dst: list[int]
) -> None:
    """Store ``src`` to ``cpu``, overwrite the cache with -7, load ``cpu`` into ``dst``; check."""
    original = {k: v.clone() for k, v in views.items()}
    mover.submit_store(1, src, cpu)
    mover.wait()
    for v in views.values():
        v.fill_(-7.0)
    mover.submit_load(2, cpu, dst)
    mover.wait()
    assert [r.success for r in mover.get_finished()] == [True, True]
    untouched = [b for b in range(NUM_BLOCKS) if b not in dst]
    for k, v in views.items():
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(v[d].view(torch.int16), original[k][s].view(torch.int16))
        assert bool((v[untouched] == -7.0).all())
    mover.shutdown()


@CUDA_ONLY
@pytest.mark.parametrize("span", [True, False], ids=["span", "per-plane-kernels"])
def test_gather_is_byte_exact_on_cuda(span: bool) -> None:
    """Staged copies of separately allocated layers, one kernel per group or per plane."""
    layers = per_layer_caches("cuda")
    mover = KVBlockMover(layers, num_cpu_blocks=8, method="gather")
    assert (
        mover.copier.gather_plan is not None and mover.copier.gather_plan.word == torch.complex128
    )
    if not span:
        mover.copier.gather_plan = dataclasses.replace(mover.copier.gather_plan, source=None)
    elif mover.copier.gather_plan.source is None:
        pytest.skip("the allocator placed these layers at no common row multiple")
    store_then_load(mover, layers, [7, 2, 9, 4, 11], [1, 2, 5, 6, 7], [0, 3, 5, 6, 10])


@CUDA_ONLY
def test_batched_job_split_over_lanes_is_byte_exact() -> None:
    """A batched job long enough to be split over the DMA lanes moves exactly its blocks."""
    _, views = cross_layer_cache("cuda")
    mover = KVBlockMover(views, num_cpu_blocks=10, method="batched")
    if not mover.batched_available:
        pytest.skip("no cudaMemcpyBatchAsync in this CUDA runtime (needs 12.8+)")
    # 9 copies on 4 lanes: parts of 3, 3 and 3, and no empty fourth part (an empty
    # batch call would fail the job with "invalid argument")
    store_then_load(
        mover,
        views,
        [11, 0, 9, 2, 7, 4, 5, 1, 3],
        [9, 7, 5, 3, 1, 0, 2, 4, 6],
        [0, 2, 4, 6, 8, 10, 1, 3, 5],
    )


@pytest.mark.parametrize(
    ("gpu", "cpu"),
    [
        ([3, 4, 5, 9, 10, 2], [0, 1, 2, 3, 4, 8]),  # joint runs 3-5, 9-10; CPU runs 0-4, 8
        ([7, 2, 9, 4], [0, 1, 2, 3]),  # scattered device ids into one CPU run
        ([5], [9]),
        ([1, 2, 3], [4, 6, 7]),  # consecutive device ids, broken CPU run
    ],
    ids=["mixed", "scattered", "single", "cpu-break"],
)
def test_scan_runs_matches_run_starts(gpu: list[int], cpu: list[int]) -> None:
    """The issue path's one-pass scan agrees with the tensor version it replaced."""
    joint, runs = scan_runs(gpu, cpu)
    assert joint == run_starts(torch.tensor(gpu), torch.tensor(cpu))[2].numel()
    starts = run_starts(torch.arange(len(cpu)), torch.tensor(cpu))
    assert runs == list(zip(*(t.tolist() for t in starts), strict=True))


def test_a_waiting_caller_issues_a_job_the_thread_has_not_begun(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """wait() issues a still-queued job itself instead of waiting for the issue thread."""
    _, views = cross_layer_cache("cpu")
    mover = KVBlockMover(views, num_cpu_blocks=4, issue_thread=True)
    release, entered = threading.Event(), threading.Event()
    real_copy = mover.copier._copy
    issuers: list[tuple[int, str]] = []

    def slow_copy(job: Job, *args: object) -> None:
        issuers.append((job.job_id, threading.current_thread().name))
        if job.job_id == 1:
            entered.set()
            assert release.wait(10)
        real_copy(job, *args)

    monkeypatch.setattr(mover.copier, "_copy", slow_copy)
    mover.submit_store(1, [0], [0])
    assert entered.wait(10)  # the thread is busy with job 1
    mover.submit_store(2, [1], [1])
    mover.wait([2])  # returns without job 1: this thread issued job 2
    assert not release.is_set()
    assert issuers[1] == (2, threading.current_thread().name)
    release.set()
    mover.wait()
    assert sorted((r.job_id, r.success) for r in mover.get_finished()) == [(1, True), (2, True)]
    assert [i for i, _ in issuers] == [1, 2]  # job 2 was not issued a second time
    mover.shutdown()


@pytest.mark.parametrize("is_store", [True, False], ids=["store", "load"])
def test_single_plane_descriptors_match_the_tensor_version(is_store: bool) -> None:
    """The Python-built descriptors of the one-plane layout are exactly the tensor ones."""
    _, views = cross_layer_cache("cpu")
    mover = KVBlockMover(views, num_cpu_blocks=6)
    g, c = [7, 8, 9, 2, 0, 1], [1, 2, 3, 0, 5, 4]  # a run of 3, then single copies
    arrays = mover.copier.plan.single_plane_descriptors(g, c, is_store)
    tensors = mover.copier.plan.descriptors(torch.tensor(g), torch.tensor(c), is_store)
    assert [list(a) for a in arrays] == [t.tolist() for t in tensors]
    assert len(arrays[0]) == 4
    layers = {f"l{i}": torch.zeros(NUM_BLOCKS, 8) for i in range(2)}  # two planes: tensor path
    assert (
        KVBlockMover(layers, num_cpu_blocks=2).copier.plan.single_plane_descriptors([0], [0], True)
        is None
    )
