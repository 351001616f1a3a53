"""How the block mover queues one job's copies: the :class:`CopyMethod` it owns.

The mover names a method (``KVBlockMover(method=...)``, see :mod:`.mover`); the copy
method holds what every job of that method needs, prepared once at registration: the
CUDA runtime calls it may use (per-copy, 2D, batched), the copy descriptors' plans, the
staging memory of the gather, the extra DMA streams a batched job is split over. Per
job it picks the path (``auto`` judges the job's rows) and queues the copies on the
stream the mover gives it; on a CPU cache it copies synchronously.

Primitives: :class:`CopyMethod`, :data:`DMA_LANES`, :data:`HEAD_BLOCKS`.
"""

from __future__ import annotations

import array
import functools

import torch

from connectors.offload.transfer import cudart
from connectors.offload.transfer.copy_plan import CopyPlan, cpu_runs, estimate_joint_runs, scan_runs
from connectors.offload.transfer.jobs import Job, as_tensor, coalesce_runs
from connectors.offload.transfer.layout import BlockLayout
from connectors.offload.transfer.staging import GatherPlan, StagingBuffers, plan_gather, staged_copy

__all__ = ["DMA_LANES", "HEAD_BLOCKS", "CopyMethod"]

SMALL_ROW_BYTES = 256 * 1024  # below this a DMA per row is launch-bound: gather instead
DMA_LANES = 4  # streams per direction that a batched job is split over
HEAD_BLOCKS = 8  # blocks of a batched job queued first, before the rest's descriptors
_HOST_RUNS_PER_GATHER = 2  # CPU cache: more runs than this move as one gather per plane


def _as_words(plane: torch.Tensor) -> torch.Tensor:
    """A uint8 plane as int64 rows where its layout allows (else itself): indexing ops
    move bytes one at a time, words 8 at a time (20 vs 5 us for 8 rows of 4 KiB)."""
    try:
        return plane.view(torch.int64)
    except RuntimeError:
        return plane


class CopyMethod:
    """Queues a job's copies by one method (see the module docstring).

    Args:
        method: ``auto``, ``pitched``, ``batched``, ``coalesced``, ``per_block`` or
            ``gather`` (see :mod:`.mover`).
        layout: the device KV cache as byte planes.
        cpu_planes: per plane, the CPU buffer's ``(num_cpu_blocks, row_bytes)`` view.
        device_index: the CUDA device's index (-1 on CPU).
        raw_memcpy: issue DMA copies through the CUDA runtime (None: when it loads).

    Attributes:
        memcpy / memcpy_2d / batch_memcpy: the runtime's per-copy, 2D (only where the
            pitched method applies) and batched copy calls, None where not available.
        stage_2d: the 2D copy of the staged gather (None without the runtime).
        plan: addresses and strides of every plane on both sides, so that a job only
            adds block offsets (:mod:`.copy_plan`).
        gather_plan / staging: the staged gather's plan and, per direction, its reused
            memory (None: not on CUDA; ``staging`` None: allocate per job, to measure).
        kernel_streams: per direction, the stream of the gather / scatter kernels.
        lanes: per direction, the extra streams a batched job is split over.
        head_blocks: blocks of a batched job issued before the rest (0: none).
        dma_only_bytes: ``auto`` moves scattered small rows of jobs up to this many bytes
            as per-row DMAs (no SM time) instead of gathering them (0: always gather).
        dma_only_loads: False: ``dma_only_bytes`` applies to stores only.

    Raises:
        ValueError: ``raw_memcpy=True`` without a CUDA cache or a loadable runtime.
    """

    def __init__(self, method: str, layout: BlockLayout, cpu_planes: tuple[torch.Tensor, ...],
                 device_index: int, raw_memcpy: bool | None) -> None:
        self.method = method
        self.layout = layout
        self.cpu_planes = cpu_planes
        self.device_index = device_index
        is_cuda = layout.device.type == "cuda"
        self.kernel_streams: dict[bool, torch.cuda.Stream] = {}
        self.lanes: dict[bool, list[torch.cuda.Stream]] = {True: [], False: []}
        if is_cuda:
            device = layout.device
            self.kernel_streams = {d: torch.cuda.Stream(device) for d in (True, False)}
            self.lanes = {d: [torch.cuda.Stream(device) for _ in range(DMA_LANES - 1)]
                          for d in (True, False)}
        self.lane_events: dict[torch.cuda.Stream, torch.cuda.Event] = {}
        self.head_blocks = HEAD_BLOCKS
        self.dma_only_bytes = 0
        self.dma_only_loads = True
        self.plan = CopyPlan(layout.planes, cpu_planes)
        max_pitch = self._runtime_calls(is_cuda, raw_memcpy)
        # A CPU cache's planes as int64 rows for scattered jobs (see copy_host).
        self.host_word_planes = (None if is_cuda else
                                 [(_as_words(g), _as_words(c)) for g, c in
                                  zip(layout.planes, cpu_planes, strict=True)])
        # Staged copies (method gather): prepared here, used on CUDA only.
        self.gather_plan: GatherPlan | None = (
            plan_gather(layout.planes, cpu_planes, max_pitch if self.stage_2d else 0)
            if is_cuda else None)
        # Per direction: staging memory, index buffers and fence events of staged copies,
        # made at the first staged job and reused.
        self.staging: dict[bool, StagingBuffers] | None = (
            {d: StagingBuffers(layout.device, self.gather_plan, self.memcpy)
             for d in (True, False)} if self.gather_plan is not None else None)

    def _runtime_calls(self, is_cuda: bool, raw_memcpy: bool | None) -> int:
        """Load the CUDA runtime's copy calls; the device's largest 2D pitch (0: none)."""
        use_runtime = is_cuda and raw_memcpy is not False
        self.memcpy: cudart.Memcpy | None = cudart.memcpy_async() if use_runtime else None
        if raw_memcpy and self.memcpy is None:
            msg = ("raw_memcpy=True needs a CUDA KV cache" if not is_cuda
                   else "raw_memcpy=True but no CUDA runtime library could be loaded")
            raise ValueError(msg)
        self.batch_memcpy: cudart.BatchMemcpy | None = (
            cudart.batch_memcpy_async() if use_runtime else None)
        self.stage_2d: cudart.Memcpy2D | None = cudart.memcpy_2d_async() if use_runtime else None
        self.memcpy_2d: cudart.Memcpy2D | None = None  # set where the pitched method applies
        if not use_runtime:
            return 0
        limit = cudart.max_pitch(self.device_index)
        pitch = self.plan.pitch
        if pitch is not None and max(pitch[1], pitch[3]) <= limit:
            self.memcpy_2d = self.stage_2d
        return limit

    def copy_cuda(self, job: Job, g_ids: array.array[int], c_ids: array.array[int],
                  stream: torch.cuda.Stream, start: torch.cuda.Event) -> None:
        """Queue a job's copies on ``stream``; ``start`` marks where the job begins on it
        (extra streams wait for it).

        Preference: one 2D copy per run (equally spaced planes), else one batch call for
        the job, else the per-copy methods. A method names the most it may use.
        """
        method = "gather" if self._gathers(job, g_ids, c_ids) else self.method
        if method == "gather" and self.gather_plan is not None:
            self._copy_staged(self.gather_plan, job, g_ids, c_ids, stream)
        elif self.memcpy_2d is not None and method in ("auto", "pitched"):
            self._copy_pitched(self.memcpy_2d, job.is_store, as_tensor(g_ids),
                               as_tensor(c_ids), stream)
        elif self.batch_memcpy is not None and method in ("auto", "pitched", "batched"):
            self._copy_batched(self.batch_memcpy, job.is_store, g_ids, c_ids, stream, start)
        else:
            with torch.cuda.stream(stream):
                self._copy(job, job.is_store, g_ids.tolist(), c_ids.tolist())

    def _gathers(self, job: Job, g_ids: array.array[int], c_ids: array.array[int]) -> bool:
        """``auto``: gather where the DMAs would be small, judged from a sample of the ids,
        and from the full scan only where the sample shows runs (then it matters)."""
        if self.method != "auto" or self.gather_plan is None:
            return False
        planes = self.layout.planes
        if len(planes) == 1 and planes[0].shape[1] >= SMALL_ROW_BYTES:
            return False
        dma_only = (len(g_ids) * self.layout.block_bytes <= self.dma_only_bytes
                    and self.batch_memcpy is not None
                    and (job.is_store or self.dma_only_loads))
        if dma_only:
            return False
        n = len(g_ids)
        return (self._small_rows(n, estimate_joint_runs(g_ids, c_ids))
                or self._small_rows(n, scan_runs(g_ids, c_ids)[0]))

    def _copy_staged(self, plan: GatherPlan, job: Job, g_ids: array.array[int],
                     c_ids: array.array[int], stream: torch.cuda.Stream) -> None:
        buffers = self.staging[job.is_store] if self.staging is not None else None
        args = (plan, job.is_store, as_tensor(g_ids), functools.partial(cpu_runs, c_ids),
                stream, self.kernel_streams[job.is_store], self.memcpy,
                self.stage_2d if self.memcpy is not None else None, job.keep_alive)
        if buffers is None:
            staged_copy(*args)
        else:
            with buffers.lock:  # one job of a direction at a time on its buffers
                staged_copy(*args, buffers)

    def _small_rows(self, num_blocks: int, joint_runs: int) -> bool:
        """True when the job's DMAs would average under 256 KiB (scattered per-layer rows).

        Measured on an H100: the copy engines lose a fixed cost per row, so such jobs
        are gathered on the device first (see :mod:`.staging`).
        """
        planes = self.layout.planes
        return num_blocks * self.layout.block_bytes / (joint_runs * len(planes)) < SMALL_ROW_BYTES

    def _copy_pitched(self, memcpy_2d: cudart.Memcpy2D, is_store: bool, g: torch.Tensor,
                      c: torch.Tensor, stream: torch.cuda.Stream) -> None:
        # One copy-engine operation moves a run of blocks in every plane (rows = planes),
        # where the per-layer layout would otherwise need one small copy per plane.
        handle = stream.cuda_stream
        for dst, dpitch, src, spitch, width, height in self.plan.pitched_copies(g, c, is_store):
            rc = memcpy_2d(dst, dpitch, src, spitch, width, height, handle)
            if rc != 0:
                cudart.clear_error()
                msg = f"cudaMemcpy2DAsync returned CUDA error {rc} ({height} rows of {width} bytes)"
                raise RuntimeError(msg)

    def _copy_batched(self, batch_memcpy: cudart.BatchMemcpy, is_store: bool,
                      g_ids: array.array[int], c_ids: array.array[int],
                      stream: torch.cuda.Stream, start: torch.cuda.Event) -> None:
        # Every plane and run of the job in one runtime call: thousands of DMA copies for
        # the per-layer layout cost one call's host time, and the copy engines see the
        # whole batch at once instead of a trickle of single copies.
        head = self.head_blocks if len(g_ids) >= 4 * self.head_blocks else 0
        if head:
            # The first blocks go out before the descriptors of the rest are built: the
            # copy engines start a few hundred microseconds sooner (H100 machines: 0.4-0.6
            # ms from submission to the first DMA of a 256-block job), which a transfer of
            # ~10 ms otherwise pays in full. A run split here costs one extra copy.
            self._batch_on_lanes(batch_memcpy, is_store, g_ids[:head], c_ids[:head], stream,
                                 [], start)
            g_ids, c_ids = g_ids[head:], c_ids[head:]
        self._batch_on_lanes(batch_memcpy, is_store, g_ids, c_ids, stream, self.lanes[is_store],
                             start)

    def _batch_on_lanes(self, batch_memcpy: cudart.BatchMemcpy, is_store: bool,
                        g_ids: array.array[int], c_ids: array.array[int],
                        stream: torch.cuda.Stream, extra: list[torch.cuda.Stream],
                        start: torch.cuda.Event) -> None:
        arrays = self.plan.single_plane_descriptors(g_ids, c_ids, is_store)
        if arrays is not None:
            count = len(arrays[0])
            dst, src, size = (a.buffer_info()[0] for a in arrays)
        else:
            tensors = self.plan.descriptors(as_tensor(g_ids), as_tensor(c_ids), is_store)
            count = tensors[0].numel()
            dst, src, size = (t.data_ptr() for t in tensors)
        # Split over the direction's DMA lanes (H100, 256 scattered 2 MiB blocks: 0.989x of
        # the contiguous copy on one stream, 0.995x on four). Every lane starts where the
        # job's stream stood at its start, and the job's stream waits for every lane at the end.
        lanes = [stream, *extra] if count >= 2 * DMA_LANES else [stream]
        per = -(-count // len(lanes))
        lanes = lanes[:-(-count // per)]  # no empty part (9 copies on 4 lanes: 3+3+3)
        started: list[torch.cuda.Stream] = []
        try:
            for i, lane in enumerate(lanes):
                if lane is not stream:
                    lane.wait_event(start)
                    started.append(lane)
                first, part = i * per, min(per, count - i * per)
                rc = batch_memcpy(dst + 8 * first, src + 8 * first, size + 8 * first, part,
                                  lane.cuda_stream)
                if rc != 0:
                    cudart.clear_error()
                    msg = f"cudaMemcpyBatchAsync returned CUDA error {rc} for {part} copies"
                    raise RuntimeError(msg)
        finally:
            # Also after a failed call: the job's end (on ``stream``) follows every lane's
            # copies queued so far, so a failed job is reported only after them.
            for lane in started:
                # One event per lane, recorded again every job: a wait orders the stream after
                # the record made before it (another thread's later record only adds waiting).
                done = self.lane_events.get(lane)
                if done is None:
                    done = self.lane_events[lane] = torch.cuda.Event()
                done.record(lane)
                stream.wait_event(done)

    def copy_host(self, job: Job, g_ids: array.array[int], c_ids: array.array[int]) -> None:
        """A job on a CPU KV cache: synchronous copies on the calling thread.

        Few runs (consecutive ids) copy run by run; scattered ids move with one gather
        and one scatter per plane: a ``copy_`` per run and plane costs ~2.5 us of
        dispatch however small the row, so 32 scattered blocks of a 4-layer cache were
        128 calls (~300 us) where ``index_select`` + ``index_copy_`` make 8 (~30 us).
        ``per_block`` and ``coalesced`` keep their literal copy-per-run behaviour.
        """
        gpu_ids, cpu_ids = g_ids.tolist(), c_ids.tolist()
        runs = coalesce_runs(gpu_ids, cpu_ids)
        if self.method in ("per_block", "coalesced") or len(runs) <= _HOST_RUNS_PER_GATHER:
            self._copy(job, job.is_store, gpu_ids, cpu_ids, runs)
            return
        g_index, c_index = as_tensor(g_ids), as_tensor(c_ids)
        for gpu_plane, cpu_plane in self.host_word_planes or ():
            if job.is_store:
                cpu_plane.index_copy_(0, c_index, gpu_plane.index_select(0, g_index))
            else:
                gpu_plane.index_copy_(0, g_index, cpu_plane.index_select(0, c_index))

    def _copy(self, job: Job, is_store: bool, gpu_ids: list[int], cpu_ids: list[int],
              runs: list[tuple[int, int, int]] | None = None) -> None:
        if runs is None:
            runs = coalesce_runs(gpu_ids, cpu_ids)
        for gpu_plane, cpu_plane in zip(self.layout.planes, self.cpu_planes, strict=True):
            method = self.method
            dense = gpu_plane.stride(0) == gpu_plane.shape[1]
            if method == "per_block" or not dense:
                plane_runs = [(g, c, 1) for g, c in zip(gpu_ids, cpu_ids, strict=True)]
            else:  # coalesced, and batched / auto where there is no batch API or no CUDA
                plane_runs = runs
            if self.memcpy is not None:
                self._copy_raw(self.memcpy, is_store, gpu_plane, cpu_plane, plane_runs)
                continue
            for g, c, n in plane_runs:
                if is_store:
                    cpu_plane[c:c + n].copy_(gpu_plane[g:g + n], non_blocking=True)
                else:
                    gpu_plane[g:g + n].copy_(cpu_plane[c:c + n], non_blocking=True)

    def _copy_raw(self, memcpy: cudart.Memcpy, is_store: bool,
                  gpu_plane: torch.Tensor, cpu_plane: torch.Tensor,
                  runs: list[tuple[int, int, int]]) -> None:
        # Each run is contiguous on both sides: whole rows of a dense plane, or a single
        # row (n == 1) of a plane with gaps. uint8 planes: strides are in bytes.
        row = gpu_plane.shape[1]
        g_base, g_stride = gpu_plane.data_ptr(), gpu_plane.stride(0)
        c_base, c_stride = cpu_plane.data_ptr(), cpu_plane.stride(0)
        stream = torch.cuda.current_stream(self.device_index).cuda_stream
        for g, c, n in runs:
            g_ptr, c_ptr, nbytes = g_base + g * g_stride, c_base + c * c_stride, n * row
            dst, src = (c_ptr, g_ptr) if is_store else (g_ptr, c_ptr)
            rc = memcpy(dst, src, nbytes, stream)
            if rc != 0:
                cudart.clear_error()
                msg = f"cudaMemcpyAsync returned CUDA error {rc}"
                raise RuntimeError(msg)
