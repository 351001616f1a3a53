"""Pipelined gather: scattered small device rows <-> dense staging <-> CPU, on two streams.

Why: in the per-layer layout (vLLM's) a block is one 64 KiB row per layer, and the copy
engines lose a fixed cost on every row they move (H100: one batched DMA per row reaches
0.74x of the contiguous pinned copy). Gathering a group of planes' scattered rows into a
dense staging buffer with a kernel turns them into a few large DMAs. The kernel for group
``k + 1`` runs on the kernel stream while the DMA of group ``k`` runs on the DMA stream,
so the copy engines stay busy. Loads run the other way: DMA group ``k`` into staging, then
scatter it, while the DMA of group ``k + 1`` proceeds.

What makes it fast (measured on an H100, 256 scattered blocks of 2 MiB): the mechanism alone
reaches 0.96-0.98x of the contiguous copy each way (``benchmarks/probes/probe_transfer_limits.py``),
the mover's default 0.94-0.97x (``benchmarks/probes/probe_roundrobin.py``), where the first version
of this module reached 0.85x:

* the kernels move wide words, not bytes (``index_select`` on complex128 or int64 views):
  a byte-wise gather of 512 MiB took milliseconds, long enough to stall the pipeline
  (16-byte and 8-byte words measure the same, ~2.3 TB/s read + write);
* where every plane's rows sit at whole multiples of the row size from the lowest plane
  (true of large allocations), one *span* view covers all planes, so a group of planes is
  one gather kernel and one 2D DMA (rows = planes) instead of one kernel and one DMA per
  plane (with the changes below, the issue thread's time per 64-block job fell from 1.4-2.2
  to 0.6-0.8 ms);
* stages of ~32 MiB (up to 8), the first and the last one shorter (``taper``): nothing
  overlaps a store's first gather or a load's last scatter;
* nothing is allocated per job (:class:`StagingBuffers`): the staging memory, the pinned
  index buffer, the device index and the events that order the two streams are kept per
  direction and reused, since every allocation before the first DMA delays it;
* only the first stage's own work comes before the first DMA: a store uploads its block
  ids alone and gathers stage 0 on the DMA stream itself, by id, plane by plane; the span
  index is computed and uploaded (on the kernel stream) after that DMA is queued. A load
  moves stage 0 into staging first, then uploads its index on the DMA stream, behind stage 0
  (on the kernel stream the upload queued on the copy engine behind every stage's DMA, and
  every scatter ran after the last DMA: 0.4 ms of tail, loads 0.92-0.93x instead of
  0.955-0.96x).

The span view aliases device memory by address (``__cuda_array_interface__``); only the
rows of the registered planes are ever indexed, so memory between allocations is never
read or written.

Primitives: :class:`GatherPlan`, :func:`plan_gather`, :func:`group_planes`,
:func:`staged_copy` (the pipeline); :class:`StagingBuffers` (one direction's reused
memory); :func:`span_layout`, :func:`cpu_pitch`, :func:`staging_copies` (the geometry
between staging and the CPU tier).
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from connectors.offload.transfer import cudart as _cudart

__all__ = ["GatherPlan", "StagingBuffers", "cpu_pitch", "group_planes", "plan_gather",
           "span_layout", "staged_copy", "staging_copies"]

# Bytes moved per pipeline stage (one group of planes), and the most stages of a job.
# H100, bare mechanism, 512 MiB: 16 stages 0.975-0.98x, 8 stages 0.979-0.98x, 4 stages
# 0.97x of the contiguous copy; each stage costs the issuing thread a handful of calls
# (GIL time the engine's step competes for), so 8 stages of >= 32 MiB.
_STAGE_BYTES = 32 << 20
_MAX_GROUPS = 8
# The widest element the gather / scatter kernels move (bytes): complex128 is the only
# 16-byte dtype that indexing ops copy as one element. Fewer, wider elements mean fewer
# threads and index computations per byte (SM time taken from the model's kernels).
_WORD_BYTES = 16
# Taper: the first and last stages hold fewer planes (see group_planes).
_TAPER = True


def group_planes(num_planes: int, job_bytes: int, *, taper: bool = False) -> list[range]:
    """Split the planes into pipeline stages of about ``_STAGE_BYTES`` each (1 to 8).

    With ``taper``, where there are at least three stages, the first and the last hold a
    quarter of a stage's planes (at least one) and the others share the rest: nothing
    overlaps a store's first gather or a load's last scatter, so they are made short.
    """
    groups = max(1, min(_MAX_GROUPS, num_planes, job_bytes // _STAGE_BYTES))
    per = -(-num_planes // groups)
    end = max(1, per // 4)
    if not taper or groups < 3 or num_planes < 2 * end + 1:
        return [range(i, min(i + per, num_planes)) for i in range(0, num_planes, per)]
    inner = num_planes - 2 * end
    per = -(-inner // (groups - 2))
    middle = [range(i, min(i + per, num_planes - end)) for i in range(end, num_planes - end, per)]
    return [range(end), *middle, range(num_planes - end, num_planes)]


@dataclass(frozen=True, slots=True)
class GatherPlan:
    """What a staged copy needs, prepared once at registration.

    Attributes:
        row: bytes of one row (one block of one plane).
        word: element type the kernels move: complex128 (16 bytes) or int64 where rows
            and addresses allow, else uint8.
        planes: the device planes as ``(num_blocks, row / word)`` views.
        source: the span view covering every plane (rows of ``row`` bytes), or None.
        first_row, rows_per_block: int64 ``(planes, 1)`` row arithmetic into ``source``.
        cpu_pitch: bytes between consecutive CPU planes when one 2D copy may move a
            group (planes equally spaced in one allocation, dense rows); else None.
        cpu_planes: the CPU planes (uint8 ``(num_cpu_blocks, row)``), pairwise with ``planes``.
        taper: shorter first and last stages (see :func:`group_planes`).
    """

    row: int
    word: torch.dtype
    planes: tuple[torch.Tensor, ...]
    source: torch.Tensor | None
    first_row: torch.Tensor | None
    rows_per_block: torch.Tensor | None
    cpu_pitch: int | None
    cpu_planes: tuple[torch.Tensor, ...]
    taper: bool = False

    def gather_index(self, gpu_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows to gather, plane-major: ``planes * n`` int64 (span rows), or the block ids.

        Args:
            out: where to write it (``index_length(n)`` int64), instead of a new tensor.
        """
        if self.source is None or self.first_row is None or self.rows_per_block is None:
            if out is None:
                return gpu_ids
            return out.copy_(gpu_ids)
        if out is None:
            return (self.first_row + gpu_ids.view(1, -1) * self.rows_per_block).view(-1)
        torch.addcmul(self.first_row, gpu_ids.view(1, -1), self.rows_per_block,
                      out=out.view(len(self.planes), -1))
        return out

    def index_length(self, n: int) -> int:
        """Entries of :meth:`gather_index` for a job of ``n`` blocks."""
        return n * len(self.planes) if self.source is not None else n


class _Span:
    """``__cuda_array_interface__`` for raw device memory (torch.as_tensor builds a view)."""

    def __init__(self, ptr: int, rows: int, words: int, word: torch.dtype) -> None:
        code = "<i8" if word == torch.int64 else "|u1"
        self.__cuda_array_interface__ = {"shape": (rows, words), "typestr": code,
                                         "data": (ptr, False), "version": 2, "strides": None}


def _word(gpu_planes: Sequence[torch.Tensor], ptrs: Sequence[int], strides: Sequence[int],
          widest: int) -> torch.dtype:
    """The widest element (at most ``widest`` bytes) that every row, address and stride fits."""
    for size, dtype in ((16, torch.complex128), (8, torch.int64)):
        if size <= widest and all(p.shape[1] % size == 0 for p in gpu_planes) and all(
                x % size == 0 for x in (*ptrs, *strides)):
            return dtype
    return torch.uint8


def plan_gather(gpu_planes: Sequence[torch.Tensor], cpu_planes: Sequence[torch.Tensor],
                max_pitch: int, *, word_bytes: int | None = None, taper: bool | None = None
                ) -> GatherPlan:
    """Prepare staged copies for these planes (uint8 ``(blocks, row)``, pairwise).

    Args:
        max_pitch: the largest pitch a 2D copy accepts (0: no 2D copies).
        word_bytes: the widest element the kernels may move (16, 8 or 1; default 16).
        taper: shorter first and last stages (default True).
    """
    rows = {p.shape[1] for p in gpu_planes}
    row = rows.pop() if len(rows) == 1 else 0
    ptrs = [p.data_ptr() for p in gpu_planes]
    strides = [p.stride(0) for p in gpu_planes]
    word = _word(gpu_planes, ptrs, strides, _WORD_BYTES if word_bytes is None else word_bytes)
    planes = tuple(p.view(word) for p in gpu_planes)
    source = first = steps = None
    span = None
    if row and len(gpu_planes) > 1 and gpu_planes[0].is_cuda:
        span = span_layout(ptrs, strides, row, gpu_planes[0].shape[0])
    if span is not None:
        base, first_rows, step_rows, total = span
        wide = word != torch.uint8  # the span is made of int64 words, then viewed as ``word``
        view = torch.int64 if wide else torch.uint8
        words = row // 8 if wide else row
        source = torch.as_tensor(_Span(base, total, words, view),
                                 device=gpu_planes[0].device).view(word)
        first = torch.tensor(first_rows, dtype=torch.int64).view(-1, 1)
        steps = torch.tensor(step_rows, dtype=torch.int64).view(-1, 1)
    return GatherPlan(row or gpu_planes[0].shape[1], word, planes, source, first, steps,
                      cpu_pitch(cpu_planes, max_pitch), tuple(cpu_planes),
                      _TAPER if taper is None else taper)


Runs = Sequence[tuple[int, int, int]]


def staged_copy(plan: GatherPlan, is_store: bool, gpu_ids: torch.Tensor,
                cpu_runs: Runs | Callable[[], Runs], dma_stream: torch.cuda.Stream,
                kernel_stream: torch.cuda.Stream, memcpy: _cudart.Memcpy | None,
                memcpy_2d: _cudart.Memcpy2D | None, keep_alive: list[torch.Tensor],
                buffers: StagingBuffers | None = None) -> None:
    """Queue a staged transfer; on return the DMA stream is ordered after all of it.

    Args:
        plan: from :func:`plan_gather`.
        is_store: device -> CPU when True.
        gpu_ids: int64 CPU tensor of device block ids, one per staging row.
        cpu_runs: ``(staging_row, cpu_id, length)`` runs of consecutive CPU ids, or a
            function returning them (called once, where they are first needed: a store
            computes them while its first gather kernel runs).
        dma_stream: the job's stream (already ordered after the model's work).
        kernel_stream: a second stream for the gather / scatter kernels.
        memcpy, memcpy_2d: the runtime's copies by ctypes (None: ``Tensor.copy_``).
        keep_alive: receives tensors that must outlive the job (the index and staging
            tensors where ``buffers`` is None, else buffers that a job outgrew).
        buffers: the direction's reusable buffers (the caller holds ``buffers.lock``);
            None: allocate them for this job (the first versions' way, kept to measure).
    """
    n, device = gpu_ids.numel(), plan.planes[0].device
    groups = group_planes(len(plan.planes), n * plan.row * len(plan.planes), taper=plan.taper)
    fence = buffers.fence if buffers is not None else None
    job = _StagedJob(plan, gpu_ids, n, groups, dma_stream, kernel_stream, memcpy, memcpy_2d,
                     keep_alive, buffers, fence)
    runs_of = cpu_runs if callable(cpu_runs) else (lambda: cpu_runs)
    # Nothing but the first stage's own work comes before the first DMA: a store gathers
    # stage 0 on the DMA stream itself (ordered after the job's start with no
    # cross-stream wait), a load moves stage 0 into staging before anything else. The
    # kernel stream joins after that and runs the other stages' kernels beside the DMAs.
    # The current stream is set once per phase: ``torch.cuda.stream(...)`` per stage cost
    # more host time than the kernels' launches.
    previous = torch.cuda.current_stream(device.index)
    try:
        if is_store:
            _stage_store(job, runs_of)
        else:
            _stage_load(job, runs_of)
    finally:
        torch.cuda.set_stream(previous)
        # The job ends after its last kernel, also when a call above raised: the kernels
        # it queued still run, and the next job of the direction reuses the staging memory.
        dma_stream.wait_event(_record(kernel_stream, fence))
        if buffers is not None:
            buffers.end_job(dma_stream)


@dataclass(slots=True)
class _StagedJob:
    """The fixed arguments of one staged transfer (see :func:`staged_copy`)."""

    plan: GatherPlan
    gpu_ids: torch.Tensor
    n: int
    groups: list[range]
    dma_stream: torch.cuda.Stream
    kernel_stream: torch.cuda.Stream
    memcpy: _cudart.Memcpy | None
    memcpy_2d: _cudart.Memcpy2D | None
    keep_alive: list[torch.Tensor]
    buffers: StagingBuffers | None
    fence: torch.cuda.Event | None

    def staging(self) -> torch.Tensor:
        """The staging rows of the whole job."""
        return _staging(self.plan, len(self.plan.planes) * self.n, self.buffers, self.keep_alive)

    def index(self, stream: torch.cuda.Stream) -> torch.Tensor:
        """The gather index, uploaded on ``stream`` (the current stream)."""
        return _index(self.plan, self.gpu_ids, stream, self.buffers, self.keep_alive)

    def views(self, idx: torch.Tensor, staging: torch.Tensor
              ) -> Sequence[tuple[torch.Tensor, torch.Tensor] | None]:
        return _views(self.plan, self.groups, self.n, idx, staging, self.buffers)

    def move(self, k: int, idx: torch.Tensor, staging: torch.Tensor,
             rows_of: tuple[torch.Tensor, torch.Tensor] | None, *, gather: bool) -> None:
        _move(self.plan, self.groups[k], self.n, idx, staging, rows_of, gather=gather)

    def dma(self, k: int, runs: Runs, staging: torch.Tensor, *, to_cpu: bool) -> None:
        _dma(self.plan, self.groups[k], self.n, runs, staging, self.dma_stream, self.memcpy,
             self.memcpy_2d, to_cpu=to_cpu)


def _stage_store(job: _StagedJob, runs_of: Callable[[], Runs]) -> None:
    """Device -> staging -> CPU: stage 0 on the DMA stream, the rest beside the DMAs."""
    plan, buffers = job.plan, job.buffers
    torch.cuda.set_stream(job.dma_stream)
    staging = job.staging()
    if (buffers is not None and buffers.ids_first and plan.source is not None
            and len(job.groups) > 1):
        # Stage 0 gathered plane by plane with the block ids alone: the span index
        # (a tensor op and a larger upload) waits until the first DMA is queued.
        n = job.n
        ids = buffers.upload_ids(plan, job.gpu_ids, job.dma_stream, job.keep_alive)
        for p in job.groups[0]:
            torch.index_select(plan.planes[p], 0, ids, out=staging[p * n:(p + 1) * n])
        runs = _first_store_dma(job, staging, runs_of)
        idx = job.index(job.kernel_stream)
        views = job.views(idx, staging)
    else:
        idx = job.index(job.dma_stream)
        views = job.views(idx, staging)
        job.move(0, idx, staging, views[0], gather=True)
        runs = _first_store_dma(job, staging, runs_of)
    for k in range(1, len(job.groups)):
        job.move(k, idx, staging, views[k], gather=True)
        job.dma_stream.wait_event(_record(job.kernel_stream, job.fence))
        job.dma(k, runs, staging, to_cpu=True)


def _first_store_dma(job: _StagedJob, staging: torch.Tensor, runs_of: Callable[[], Runs]
                     ) -> Runs:
    """Queue stage 0's DMA once it is gathered; the kernel stream goes on from there."""
    ready = _record(job.dma_stream, job.fence)  # stage 0 gathered: later kernels may start
    runs = runs_of()
    job.dma(0, runs, staging, to_cpu=True)
    job.kernel_stream.wait_event(ready)
    torch.cuda.set_stream(job.kernel_stream)
    return runs


def _stage_load(job: _StagedJob, runs_of: Callable[[], Runs]) -> None:
    """CPU -> staging -> device: stage 0's DMA first, each scatter after its DMA."""
    runs = runs_of()
    staging = job.staging()
    job.dma(0, runs, staging, to_cpu=False)
    if job.buffers is None or job.buffers.load_index_on_dma_stream:
        # The index goes up on the DMA stream, right behind stage 0. Uploaded on the
        # kernel stream, it queued on the copy engine behind every stage's DMA, so
        # every scatter ran after the last DMA (seen on an H100: 0.4 ms of tail).
        torch.cuda.set_stream(job.dma_stream)
        idx = job.index(job.dma_stream)
        job.kernel_stream.wait_event(_record(job.dma_stream, job.fence))
        torch.cuda.set_stream(job.kernel_stream)
    else:
        job.kernel_stream.wait_event(_record(job.dma_stream, job.fence))
        torch.cuda.set_stream(job.kernel_stream)
        idx = job.index(job.kernel_stream)
    views = job.views(idx, staging)
    job.move(0, idx, staging, views[0], gather=False)
    for k in range(1, len(job.groups)):
        job.dma(k, runs, staging, to_cpu=False)
        job.kernel_stream.wait_event(_record(job.dma_stream, job.fence))
        job.move(k, idx, staging, views[k], gather=False)


def _index(plan: GatherPlan, gpu_ids: torch.Tensor, stream: torch.cuda.Stream,
           buffers: StagingBuffers | None, keep_alive: list[torch.Tensor]) -> torch.Tensor:
    """The gather index on the device, uploaded on ``stream`` (the current stream)."""
    if buffers is not None:
        return buffers.upload_index(plan, gpu_ids, stream, keep_alive)
    idx = plan.gather_index(gpu_ids).pin_memory().to(plan.planes[0].device, non_blocking=True)
    keep_alive.append(idx)  # allocated on the current stream, released after the job
    return idx


def _staging(plan: GatherPlan, rows: int, buffers: StagingBuffers | None,
             keep_alive: list[torch.Tensor]) -> torch.Tensor:
    if buffers is not None:
        return buffers.staging(rows, keep_alive)
    staging = torch.empty((rows, plan.planes[0].shape[1]), dtype=plan.word,
                          device=plan.planes[0].device)
    keep_alive.append(staging)
    return staging


def _views(plan: GatherPlan, groups: Sequence[range], n: int, idx: torch.Tensor,
           staging: torch.Tensor, buffers: StagingBuffers | None
           ) -> Sequence[tuple[torch.Tensor, torch.Tensor] | None]:
    if buffers is not None and plan.source is not None:
        return buffers.stage_views(groups, n, idx, staging)
    return [None] * len(groups)


def _move(plan: GatherPlan, group: range, n: int, idx: torch.Tensor, staging: torch.Tensor,
          rows_of: tuple[torch.Tensor, torch.Tensor] | None, *, gather: bool) -> None:
    """Gather a group's rows into staging (or scatter them back): one kernel over the span.

    ``rows_of``: the group's index and staging rows, where already sliced.
    """
    if plan.source is not None:
        if rows_of is None:
            rows = slice(group.start * n, group.stop * n)
            rows_of = (idx[rows], staging[rows])
        index, part = rows_of
        if gather:
            torch.index_select(plan.source, 0, index, out=part)
        else:
            plan.source.index_copy_(0, index, part)
        return
    for p in group:
        part = staging[p * n:(p + 1) * n]
        if gather:
            torch.index_select(plan.planes[p], 0, idx, out=part)
        else:
            plan.planes[p].index_copy_(0, idx, part)


def _record(stream: torch.cuda.Stream, event: torch.cuda.Event | None = None) -> torch.cuda.Event:
    """Record ``event`` (a new one if None) on ``stream``.

    One event serves every record / wait pair: ``wait_event`` orders the waiting stream
    after the record made before it, and a later record does not change that.
    """
    if event is None:
        event = torch.cuda.Event()
    event.record(stream)
    return event


def _dma(plan: GatherPlan, group: range, n: int, cpu_runs: Sequence[tuple[int, int, int]],
         staging: torch.Tensor, stream: torch.cuda.Stream, memcpy: _cudart.Memcpy | None,
         memcpy_2d: _cudart.Memcpy2D | None, *, to_cpu: bool) -> None:
    if memcpy is None:  # no runtime by ctypes: tensor copies, one per plane and run
        as_bytes = staging.view(torch.uint8)
        with torch.cuda.stream(stream):
            for p in group:
                for s, c, k in cpu_runs:
                    dev = as_bytes[p * n + s:p * n + s + k]
                    host = plan.cpu_planes[p][c:c + k]
                    (host.copy_(dev, non_blocking=True) if to_cpu
                     else dev.copy_(host, non_blocking=True))
        return
    handle = stream.cuda_stream
    for dst, dpitch, src, spitch, width, height in staging_copies(
            plan, group, n, cpu_runs, staging.data_ptr(), to_cpu=to_cpu):
        if height > 1 and memcpy_2d is not None:
            _check(memcpy_2d(dst, dpitch, src, spitch, width, height, handle), "cudaMemcpy2DAsync")
            continue
        for r in range(height):
            _check(memcpy(dst + r * dpitch, src + r * spitch, width, handle), "cudaMemcpyAsync")


def _check(rc: int, name: str) -> None:
    if rc != 0:
        _cudart.clear_error()
        msg = f"{name} returned CUDA error {rc}"
        raise RuntimeError(msg)


# ------------------------------------------------ reusable staging memory and geometry
_HOST_SLOTS = 8  # pinned index buffers per direction, used in turn


class StagingBuffers:
    """One direction's staging memory, index buffers and stream-ordering events, reused.

    Why: allocating a pinned index, a device index and the staging memory per job, and a
    CUDA event per stage, cost host time before the job's first DMA (the transfer's
    latency) and on the issue thread (which the engine's step competes with for the GIL).

    Safety without extra waits: a direction's jobs run on its two streams only, each job
    begins with the kernel stream waiting for the DMA stream and ends with the DMA stream
    waiting for the kernel stream, so the next job's first write into staging (a gather
    kernel, or a load's DMA) is ordered after the previous job's last read of it, and
    likewise for the device index. A pinned index buffer is rewritten only after the job
    that last uploaded it has ended (an event recorded at the job's end, by
    :meth:`end_job`, so that nothing but the upload itself precedes the first DMA).
    Jobs of one direction must be issued one at a time: :attr:`lock`.

    Args:
        device: the CUDA device of the KV cache.
        plan: the direction's gather plan (row size and word type of the staging memory).
        memcpy: ``cudaMemcpyAsync`` by ctypes for the index upload (None: ``Tensor.copy_``,
            which costs tens of microseconds more before the first DMA: the dispatcher and
            the caching host allocator's own event record).
        ids_first: a store gathers its first stage by block id (:meth:`upload_ids`) and
            computes and uploads the span index only after its first DMA is queued.
        load_index_on_dma_stream: a load uploads its index on the DMA stream, right after
            its first DMA (else on the kernel stream, where it waits for every DMA).
    """

    def __init__(self, device: torch.device, plan: GatherPlan, memcpy: _cudart.Memcpy | None = None,
                 *, ids_first: bool = True, load_index_on_dma_stream: bool = True) -> None:
        self.device = device
        self.memcpy = memcpy
        self.ids_first = ids_first
        self.load_index_on_dma_stream = load_index_on_dma_stream
        self.lock = threading.Lock()
        self.fence = torch.cuda.Event()  # every record/wait pair between the two streams
        self._words, self._word = plan.planes[0].shape[1], plan.word
        self._staging: torch.Tensor | None = None
        self._staging_rows: torch.Tensor | None = None
        self._device_index: torch.Tensor | None = None
        # Pinned index buffers (rows of one allocation) used in turn, each with the event
        # recorded at the end of the last job that used it: a job waits only for the job
        # of _HOST_SLOTS jobs ago (long done), never for the previous one, which may sit
        # behind the model's work.
        self._host: torch.Tensor | None = None
        self._uploaded = [torch.cuda.Event() for _ in range(_HOST_SLOTS)]
        self._used = [False] * _HOST_SLOTS
        self._turn = 0
        self._pending: int | None = None  # the slot uploaded by the job being issued
        # Per job size: each stage's (index rows, staging rows) views, made once (two
        # slicing calls per stage and job otherwise); dropped when a buffer is replaced.
        self._views: dict[tuple[int, int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        # Per (slot, length[, ids]): the pinned and device slices of an upload, made once.
        self._index_views: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    def stage_views(self, groups: Sequence[range], n: int, index: torch.Tensor,
                    staging: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per stage, its rows of the span index and of staging (plane-major, ``n`` per plane)."""
        key = (index.data_ptr(), staging.data_ptr(), n)
        views = self._views.get(key)
        if views is None or len(views) != len(groups):
            views = [(index[g.start * n:g.stop * n], staging[g.start * n:g.stop * n])
                     for g in groups]
            if len(self._views) > 64:  # many job sizes: start over rather than grow
                self.clear_views()
            self._views[key] = views
        return views

    def clear_views(self) -> None:
        """Forget the cached views (a buffer was replaced, or too many job sizes)."""
        self._views.clear()
        self._index_views.clear()

    def staging(self, rows: int, keep_alive: list[torch.Tensor]) -> torch.Tensor:
        """``rows`` staging rows; grown (never shrunk) when a job needs more.

        A replaced buffer goes to ``keep_alive``: jobs still in flight may use it.
        """
        if self._staging is None or self._staging.shape[0] < rows:
            if self._staging is not None:
                keep_alive.append(self._staging)
            self._staging = torch.empty((rows, self._words), dtype=self._word, device=self.device)
            self.clear_views()
            self._staging_rows = None
        if self._staging_rows is None or self._staging_rows.shape[0] != rows:
            self._staging_rows = self._staging[:rows]  # the same job size: the same view
        return self._staging_rows

    def _job_slot(self, length: int, n: int, keep_alive: list[torch.Tensor]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """The job's pinned row and device buffer, each ``length + n`` int64 (index, then ids).

        The first call of a job takes the next slot (waiting, rarely, until the job that
        last used it has ended); later calls of the same job get the same slot.
        """
        need = length + n
        host, device_buffer = self._host, self._device_index
        if host is None or host.shape[1] < need:
            if host is not None:
                keep_alive.append(host)
            host = self._host = torch.empty((_HOST_SLOTS, need), dtype=torch.int64, pin_memory=True)
            self._used = [False] * _HOST_SLOTS
            self._index_views.clear()
            self._pending = None
        if device_buffer is None or device_buffer.numel() < need:
            if device_buffer is not None:
                keep_alive.append(device_buffer)
            device_buffer = self._device_index = torch.empty(need, dtype=torch.int64,
                                                             device=self.device)
            self.clear_views()
        if self._pending is None:
            slot = self._turn % _HOST_SLOTS
            self._turn += 1
            if self._used[slot]:
                self._uploaded[slot].synchronize()  # the job that last used it has ended
            self._used[slot] = True
            self._pending = slot
        return host[self._pending], device_buffer

    def _upload(self, host: torch.Tensor, device: torch.Tensor, stream: torch.cuda.Stream) -> None:
        if self.memcpy is None:
            with torch.cuda.stream(stream):
                device.copy_(host, non_blocking=True)
            return
        rc = self.memcpy(device.data_ptr(), host.data_ptr(), 8 * host.numel(), stream.cuda_stream)
        if rc != 0:
            msg = f"cudaMemcpyAsync of the gather index returned CUDA error {rc}"
            raise RuntimeError(msg)

    def upload_ids(self, plan: GatherPlan, gpu_ids: torch.Tensor, stream: torch.cuda.Stream,
                   keep_alive: list[torch.Tensor]) -> torch.Tensor:
        """The job's device block ids alone on the device (``n`` int64), copied on ``stream``.

        Why: a store's first stage can gather its planes by block id (one kernel per
        plane) before the span index is computed and uploaded, which then happens after
        the first DMA is queued.
        """
        n = gpu_ids.numel()
        length = plan.index_length(n)
        host, device_buffer = self._job_slot(length, n, keep_alive)
        key = (self._pending or 0, length, n)
        views = self._index_views.get(key)
        if views is None:
            views = self._index_views[key] = (host[length:length + n],
                                              device_buffer[length:length + n])
        host_ids, ids = views
        ctypes.memmove(host_ids.data_ptr(), gpu_ids.data_ptr(), 8 * n)
        self._upload(host_ids, ids, stream)
        return ids

    def upload_index(self, plan: GatherPlan, gpu_ids: torch.Tensor, stream: torch.cuda.Stream,
                     keep_alive: list[torch.Tensor]) -> torch.Tensor:
        """The job's gather index on the device, copied on ``stream`` from a pinned buffer."""
        n = gpu_ids.numel()
        length = plan.index_length(n)
        host, device_buffer = self._job_slot(length, n, keep_alive)
        key = (self._pending or 0, length)
        views = self._index_views.get(key)
        if views is None:  # the two slices, made once per buffer and length
            views = self._index_views[key] = (host[:length], device_buffer[:length])
        host_part, index = views
        plan.gather_index(gpu_ids, out=host_part)
        self._upload(host_part, index, stream)
        return index

    def end_job(self, stream: torch.cuda.Stream) -> None:
        """Mark the job's pinned index buffer free once ``stream`` reaches this point.

        Called where the job ends (after its last kernel and copy), on its DMA stream:
        the upload, which ran on one of the job's streams, lies before that point.
        """
        slot, self._pending = self._pending, None
        if slot is not None:
            self._uploaded[slot].record(stream)


def span_layout(ptrs: Sequence[int], strides: Sequence[int], row: int, num_blocks: int
                ) -> tuple[int, list[int], list[int], int] | None:
    """Where one array of ``row``-byte rows starting at the lowest plane covers every plane.

    Args:
        ptrs, strides: each plane's address and row stride, in bytes.
        row: bytes of one row (every plane's).
        num_blocks: rows per plane.

    Returns:
        ``(base, first_row, rows_per_block, total_rows)``: block ``b`` of plane ``p`` is
        row ``first_row[p] + b * rows_per_block[p]`` of the span; None when some plane
        does not sit at a whole number of rows from ``base``.
    """
    base = min(ptrs)
    if any((p - base) % row or s % row for p, s in zip(ptrs, strides, strict=True)):
        return None
    first = [(p - base) // row for p in ptrs]
    steps = [s // row for s in strides]
    total = max(f + (num_blocks - 1) * k + 1 for f, k in zip(first, steps, strict=True))
    return base, first, steps, total


def cpu_pitch(cpu_planes: Sequence[torch.Tensor], max_pitch: int) -> int | None:
    """Bytes between consecutive CPU planes when one 2D copy may move a group of them
    (planes equally spaced in one allocation, dense rows, pitch <= ``max_pitch``); else None."""
    if len(cpu_planes) < 2 or len({p.untyped_storage().data_ptr() for p in cpu_planes}) != 1:
        return None
    row = cpu_planes[0].shape[1]
    if any(p.shape[1] != row or p.stride(0) != row for p in cpu_planes):
        return None
    ptrs = [p.data_ptr() for p in cpu_planes]
    pitch = ptrs[1] - ptrs[0]
    if pitch <= 0 or pitch > max_pitch or any(b - a != pitch for a, b in itertools.pairwise(ptrs)):
        return None
    return pitch


def staging_copies(plan: GatherPlan, group: range, n: int, cpu_runs: Sequence[tuple[int, int, int]],
                   staging_ptr: int, *, to_cpu: bool) -> list[tuple[int, int, int, int, int, int]]:
    """``(dst, dpitch, src, spitch, width, height)`` per copy between staging and CPU.

    Staging holds ``n`` rows per plane, plane-major. One copy per CPU run covers every
    plane of the group (rows = planes) where :attr:`GatherPlan.cpu_pitch` allows, else one
    per plane (height 1).
    """
    row, out = plan.row, []
    span = [group] if plan.cpu_pitch is not None else [range(p, p + 1) for p in group]
    for planes in span:
        first = planes.start
        cpu_plane = plan.cpu_planes[first]
        for s, c, k in cpu_runs:
            dev = staging_ptr + (first * n + s) * row
            host = cpu_plane.data_ptr() + c * cpu_plane.stride(0)
            copy = ((host, plan.cpu_pitch or k * row, dev, n * row) if to_cpu
                    else (dev, n * row, host, plan.cpu_pitch or k * row))
            out.append((*copy, k * row, len(planes)))
    return out
