"""Worker side of the CPU offloading tier: moves KV blocks between device and CPU.

Importable with torch alone (the benchmark runs it on machines without msgspec).

Primitives:
    BlockLayout            the KV cache seen as byte "planes" of shape (num_blocks, bytes)
    cross_layer_planes     recover one plane per block of all layers from per-layer views
    chunk_to_sub_block_ids CPU chunk ids -> CPU sub-block ids (one per GPU block)
    KVBlockMover           one CPU buffer + submit_store / submit_load / get_finished / wait
    TransferResult         what a finished job reports

Layout. The engine keeps one tensor per KV cache group shaped ``(num_blocks, num_layers,
2, block_size, num_kv_heads, head_size)`` and hands out per-layer views ``t[:, i]``. All
layers of one block are then one contiguous chunk (2 MiB for Llama-3-8B), so a block
moves as one DMA instead of ``num_layers`` small ones; :func:`cross_layer_planes`
recovers that chunk from the views. Other layouts fall back to one plane per layer
(still batched in one job, just more copy calls).

CUDA path. Each direction has its own stream; a job first waits for the compute stream
(the data it reads was produced there, the blocks it writes may still be read there),
then issues its copies and records an end event; completion is polled with
``event.query()``. Copies go through the DMA copy engines, which leave the model's SMs
alone. Methods (``KVBlockMover(method=...)``):

    ``pitched``    where the planes are equally spaced on both sides (per-layer tensors
                   of one size, allocated back to back): one ``cudaMemcpy2DAsync`` per
                   run of blocks, its rows the planes; else as ``batched``
    ``batched``    the whole job (every plane, every run of consecutive source AND
                   destination ids) as ``cudaMemcpyBatchAsync`` calls (CUDA 12.8+) split
                   over four streams per direction, its descriptors computed from
                   addresses prepared at registration
    ``coalesced``  one ``cudaMemcpyAsync`` per run of consecutive ids and plane
    ``per_block``  one copy per block and plane (the baseline the others must beat)
    ``gather``     gather scattered rows on the device into a staging buffer, a group of
                   planes at a time (8-byte words, one kernel per group where the planes
                   share a span), and move each group with one large (2D) DMA, kernels and
                   DMAs pipelined on two streams (:mod:`._staged`; uses some SM time)
    ``auto``       the default: ``gather`` when the job's copies would average under
                   256 KiB (scattered rows of the per-layer layout), else ``pitched``
                   (which falls back to ``batched``, then ``coalesced``)

Issue thread. On CUDA the copies are issued by a background thread (:mod:`._issuer`):
the caller records one event on its current stream, which fixes where the copies sit in
stream order, and returns; ``get_finished`` and ``wait`` first wait until the thread has
queued the jobs (so a caller polling in a loop cannot starve it of the GIL); a job the
thread has not begun by then is issued by the caller itself, which is about to block anyway
(waiting for the thread to wake and take the GIL cost 2-3% of a 512 MiB transfer).

Single copies go through ``cudaMemcpyAsync`` by ctypes when the CUDA runtime loads and
``Tensor.copy_(non_blocking=True)`` otherwise (~3 vs ~26 us of host time per copy);
``batched`` without the batch API behaves as ``coalesced``.

On CPU tensors the same code runs with plain synchronous ``copy_`` (what CI tests).

Failures. Any exception while submitting or completing a job marks that job failed (it
is logged and reported through :meth:`KVBlockMover.get_finished` with
``success=False``); nothing is asserted away.
"""

from __future__ import annotations

import array
import functools
import logging
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from connectors.offload import _cudart
from connectors.offload._copy_plan import CopyPlan, scan_runs
from connectors.offload._issuer import IssueThread
from connectors.offload._layout import (
    BlockLayout,
    build_block_layout,
    cross_layer_planes,
)
from connectors.offload._staged import GatherPlan, plan_gather, staged_copy

__all__ = [
    "BlockLayout",
    "KVBlockMover",
    "TransferResult",
    "build_block_layout",
    "chunk_to_sub_block_ids",
    "coalesce_runs",
    "cross_layer_planes",
]

logger = logging.getLogger(__name__)

METHODS = ("auto", "pitched", "batched", "coalesced", "per_block", "gather")
_SMALL_ROW_BYTES = 256 * 1024  # below this a DMA per row is launch-bound: gather instead
_DMA_LANES = 4  # streams per direction that a batched job is split over


# ---------------------------------------------------------------------------- id helpers
def chunk_to_sub_block_ids(chunk_ids: Sequence[int], factor: int, num_gpu_blocks: int
                           ) -> list[int]:
    """Expand CPU chunk ids into CPU sub-block ids, one per GPU block.

    Chunk ``k`` holds sub-blocks ``k*factor .. k*factor+factor-1``. A transfer of
    ``num_gpu_blocks`` that is not a whole number of chunks starts mid-chunk: the first
    ``(-num_gpu_blocks) % factor`` sub-blocks of the first chunk are skipped.

    Raises:
        ValueError: the chunks cannot hold ``num_gpu_blocks`` blocks.
    """
    skip = (-num_gpu_blocks) % factor
    if len(chunk_ids) * factor - skip != num_gpu_blocks:
        msg = (f"{len(chunk_ids)} chunks of {factor} blocks cannot hold exactly "
               f"{num_gpu_blocks} GPU blocks")
        raise ValueError(msg)
    subs = [c * factor + j for c in chunk_ids for j in range(factor)]
    return subs[skip:]


def coalesce_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Group ``(src, dst)`` pairs into runs where both ids advance by one.

    Returns:
        ``(src_start, dst_start, length)`` per run, in input order.
    """
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids, strict=True):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


def _id_array(ids: Sequence[int]) -> array.array[int]:
    """A private int64 copy of the ids (the caller may reuse its list after submitting).

    ``array.array`` because building it from a list of Python ints is ~6x faster than
    ``torch.tensor``, and this runs twice per job on the engine's step.
    """
    if isinstance(ids, torch.Tensor):
        ids = ids.tolist()
    try:
        return array.array("q", ids)
    except TypeError as exc:
        msg = f"block ids must be a flat sequence of ints, got {list(ids)[:4]!r}..."
        raise ValueError(msg) from exc


def _as_tensor(ids: array.array[int]) -> torch.Tensor:
    """The ids as an int64 tensor sharing the array's memory."""
    if not ids:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(ids, dtype=torch.int64)


# ---------------------------------------------------------------------------- jobs
@dataclass(frozen=True, slots=True)
class TransferResult:
    """A finished transfer job.

    Attributes:
        job_id: the id given at submission.
        success: False if any part of the job failed (the data must not be used).
        is_store: True for device -> CPU, False for CPU -> device.
        num_bytes: bytes the job moved (or would have moved).
        seconds: time from submission to completion as observed (None if unknown).
        issue_seconds: host time spent issuing the copies (on CPU: making them), on the
            issue thread where one is used; None if the job failed before that.
    """

    job_id: int
    success: bool
    is_store: bool
    num_bytes: int
    seconds: float | None
    issue_seconds: float | None = None


@dataclass(slots=True)
class _Job:
    job_id: int
    is_store: bool
    num_bytes: int
    submitted_at: float
    host_seconds: float | None = None  # synchronous (CPU) copies: their duration
    start_event: torch.cuda.Event | None = None
    end_event: torch.cuda.Event | None = None
    error: str | None = None
    issued: threading.Event | None = None  # set by the issue thread once the copies are queued
    issue_args: tuple[Any, ...] = ()  # what _issue needs, for whichever thread claims the job
    claimed: bool = False  # an issuing thread (the issue thread or a waiting caller) took it
    issue_seconds: float | None = None
    keep_alive: list[torch.Tensor] = field(default_factory=list)  # staging, index tensors


class KVBlockMover:
    """Moves KV blocks between the device KV cache and one CPU buffer.

    Args:
        kv_caches: the KV cache (see :func:`build_block_layout`).
        num_cpu_blocks: number of CPU sub-blocks (one GPU block each) to allocate.
        pin_memory: pin the CPU buffer; defaults to True when the cache is on CUDA.
        method: one of ``auto``, ``pitched``, ``batched``, ``coalesced``, ``per_block``,
            ``gather``.
        raw_memcpy: issue DMA copies with ``cudaMemcpyAsync`` through ctypes instead of
            ``Tensor.copy_`` (about 10x less host time per copy). None (default): when
            the CUDA runtime library loads; False: never; True: required.
        issue_thread: issue the copies on a background thread, so that the caller pays
            only for one CUDA event and a queue put (None: on CUDA only; on CPU the
            thread makes the synchronous copies, which tests use).

    Attributes:
        layout: the device KV cache as byte planes.
        cpu_buffer: the one (pinned on CUDA) uint8 CPU allocation, shaped
            ``(num_planes, num_cpu_blocks, row_bytes)`` when all planes have one row size.
        cpu_planes: per plane, the ``(num_cpu_blocks, row_bytes)`` view of sub-blocks.

    Raises:
        ValueError: bad layout, ``num_cpu_blocks`` < 1 or an unknown method.
    """

    def __init__(self, kv_caches: Mapping[str, torch.Tensor] | Sequence[torch.Tensor],
                 num_cpu_blocks: int, *, pin_memory: bool | None = None,
                 method: str = "auto", raw_memcpy: bool | None = None,
                 issue_thread: bool | None = None) -> None:
        if method not in METHODS:
            msg = f"unknown transfer method {method!r}; valid: {', '.join(METHODS)}"
            raise ValueError(msg)
        if num_cpu_blocks < 1:
            msg = f"num_cpu_blocks must be >= 1, got {num_cpu_blocks}"
            raise ValueError(msg)
        self.layout = build_block_layout(kv_caches)
        self.device = self.layout.device
        self.is_cuda = self.device.type == "cuda"
        # An int: torch.cuda.current_stream(int) skips the device parsing that a
        # torch.device costs on every call (tens of microseconds on the issue path).
        self._device_index = (self.device.index if self.device.index is not None
                              else torch.cuda.current_device()) if self.is_cuda else -1
        self.method = method
        self.num_cpu_blocks = num_cpu_blocks
        pin = self.is_cuda if pin_memory is None else pin_memory
        # One allocation for all planes: pinning is expensive, do it once at registration.
        rows = {p.shape[1] for p in self.layout.planes}
        if len(rows) == 1:
            self.cpu_buffer = torch.empty((len(self.layout.planes), num_cpu_blocks, rows.pop()),
                                          dtype=torch.uint8, pin_memory=pin)
            self.cpu_planes = tuple(self.cpu_buffer.unbind(0))
        else:
            self.cpu_buffer = torch.empty(num_cpu_blocks * self.layout.block_bytes,
                                          dtype=torch.uint8, pin_memory=pin)
            planes, offset = [], 0
            for p in self.layout.planes:
                size = num_cpu_blocks * p.shape[1]
                planes.append(self.cpu_buffer[offset:offset + size].view(num_cpu_blocks, -1))
                offset += size
            self.cpu_planes = tuple(planes)
        self._streams: dict[bool, torch.cuda.Stream] = {}
        self._kernel_streams: dict[bool, torch.cuda.Stream] = {}
        self._lanes: dict[bool, list[torch.cuda.Stream]] = {True: [], False: []}
        if self.is_cuda:
            self._streams = {True: torch.cuda.Stream(self.device),
                             False: torch.cuda.Stream(self.device)}
            # Gather / scatter kernels of the staged method, beside each direction's DMAs.
            self._kernel_streams = {True: torch.cuda.Stream(self.device),
                                    False: torch.cuda.Stream(self.device)}
            # Extra streams a batched job is split over, beside the direction's own.
            self._lanes = {d: [torch.cuda.Stream(self.device) for _ in range(_DMA_LANES - 1)]
                           for d in (True, False)}
        self._jobs: list[_Job] = []
        # Issue DMA copies through the CUDA runtime directly (None: when available).
        use_runtime = self.is_cuda and raw_memcpy is not False
        memcpy = _cudart.memcpy_async() if use_runtime else None
        if raw_memcpy and memcpy is None:
            msg = ("raw_memcpy=True needs a CUDA KV cache" if not self.is_cuda
                   else "raw_memcpy=True but no CUDA runtime library could be loaded")
            raise ValueError(msg)
        self._memcpy = memcpy
        self._batch_memcpy = _cudart.batch_memcpy_async() if use_runtime else None
        # Addresses and strides of every plane on both sides, computed once here so that
        # a job only adds block offsets (see _copy_plan).
        self._plan = CopyPlan(self.layout.planes, self.cpu_planes)
        self._memcpy_2d = None  # set where the pitched method applies
        self._stage_2d = _cudart.memcpy_2d_async() if use_runtime else None
        limit = 0
        if use_runtime:
            limit = _cudart.max_pitch(self._device_index)
            if self._plan.pitch is not None and max(self._plan.pitch[1], self._plan.pitch[3]) <= limit:
                self._memcpy_2d = self._stage_2d
        # Staged copies (method gather): prepared here, used on CUDA only.
        self._gather_plan: GatherPlan | None = (
            plan_gather(self.layout.planes, self.cpu_planes, limit if self._stage_2d else 0)
            if self.is_cuda else None)
        self._block_bytes = self.layout.block_bytes
        self._issuer: IssueThread | None = None
        self._claim_lock = threading.Lock()
        if issue_thread or (self.is_cuda and issue_thread is None):
            self._issuer = IssueThread(self.device, name=f"kv-transfer-issue-{id(self):x}")
            # A mover dropped without shutdown() still stops its thread.
            weakref.finalize(self, self._issuer.close, join=False)

    @property
    def batched_available(self) -> bool:
        """True when jobs can be issued as one ``cudaMemcpyBatchAsync`` (CUDA 12.8+)."""
        return self._batch_memcpy is not None

    # ------------------------------------------------------------------ submission
    def submit_store(self, job_id: int, gpu_block_ids: Sequence[int],
                     cpu_block_ids: Sequence[int]) -> None:
        """Copy device blocks to CPU sub-blocks (pairwise, in order); asynchronous on CUDA."""
        self._submit(job_id, True, gpu_block_ids, cpu_block_ids)

    def submit_load(self, job_id: int, cpu_block_ids: Sequence[int],
                    gpu_block_ids: Sequence[int]) -> None:
        """Copy CPU sub-blocks to device blocks (pairwise, in order); asynchronous on CUDA."""
        self._submit(job_id, False, cpu_block_ids, gpu_block_ids)

    def _submit(self, job_id: int, is_store: bool, src_ids: Sequence[int],
                dst_ids: Sequence[int]) -> None:
        # The engine pays every microsecond here before its forward: keep it lean.
        job = _Job(job_id, is_store, len(src_ids) * self._block_bytes, time.perf_counter())
        self._jobs.append(job)
        try:
            gpu_ids, cpu_ids = (src_ids, dst_ids) if is_store else (dst_ids, src_ids)
            g, c = self._checked_ids(gpu_ids, cpu_ids)
            ready = None
            if self.is_cuda:
                # Fixes the copies' place in stream order now, whichever thread issues
                # them: a store reads what the model queued so far; a load overwrites
                # blocks that earlier kernels may still read.
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(self._device_index))
        except Exception as exc:  # noqa: BLE001 - any failure fails the job, never the engine
            self._fail(job, exc)
            return
        if self._issuer is None:
            self._issue(job, ready, g, c)
        else:
            job.issued = threading.Event()
            job.issue_args = (ready, g, c)
            self._issuer.submit(functools.partial(self._issue_claimed, job))

    def _claim(self, job: _Job) -> bool:
        """Take the job for issuing if no thread has; True when the caller must issue it."""
        with self._claim_lock:
            if job.claimed:
                return False
            job.claimed = True
            return True

    def _issue_claimed(self, job: _Job) -> None:
        if self._claim(job):
            self._issue(job, *job.issue_args)

    def _await_issued(self, job: _Job) -> None:
        """Return once the job's copies are queued, issuing them here if no thread has begun.

        A caller about to block on a job gains nothing by waiting for the issue thread to
        wake up and take the GIL (a few hundred microseconds on the H100 machines, 2-3% of
        a 512 MiB transfer): it issues the job itself. A job the thread has begun is
        waited for (GIL released), so a caller polling in a tight loop cannot starve it.
        """
        if job.issued is None:
            return
        if not job.issued.is_set() and self._claim(job):
            self._issue(job, *job.issue_args)
        job.issued.wait()

    def _issue(self, job: _Job, ready: torch.cuda.Event | None, g_ids: array.array[int],
               c_ids: array.array[int]) -> None:
        """Queue a job's copies on its direction's stream (CPU: copy now); never raises."""
        t0 = time.perf_counter()
        try:
            g, c = _as_tensor(g_ids), _as_tensor(c_ids)
            if ready is None:  # CPU cache: plain synchronous copies
                if g.numel():
                    self._copy(job, job.is_store, g.tolist(), c.tolist())
                job.host_seconds = time.perf_counter() - job.submitted_at
                return
            stream = self._streams[job.is_store]
            stream.wait_event(ready)
            start = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            if g.numel():
                self._copy_cuda(job, g_ids, c_ids, stream, start)
            end = torch.cuda.Event(enable_timing=True)
            end.record(stream)
            job.start_event, job.end_event = start, end
        except Exception as exc:  # noqa: BLE001 - any failure fails the job, never the engine
            self._fail(job, exc)
        finally:
            job.issue_seconds = time.perf_counter() - t0
            if job.issued is not None:
                job.issued.set()  # last: the fields above are complete when it is seen

    @staticmethod
    def _fail(job: _Job, exc: Exception) -> None:
        job.error = f"{type(exc).__name__}: {exc}"
        logger.warning("KV %s job %d failed at submission: %s",
                       "store" if job.is_store else "load", job.job_id, job.error)

    def _checked_ids(self, gpu_ids: Sequence[int], cpu_ids: Sequence[int]
                     ) -> tuple[array.array[int], array.array[int]]:
        """The ids as private int64 arrays, checked: equal lengths, every id in range."""
        if len(gpu_ids) != len(cpu_ids):
            msg = f"{len(gpu_ids)} device block ids but {len(cpu_ids)} CPU block ids"
            raise ValueError(msg)
        g, c = _id_array(gpu_ids), _id_array(cpu_ids)
        for name, ids, bound in (("device", g, self.layout.num_blocks),
                                 ("CPU", c, self.num_cpu_blocks)):
            if ids and not (min(ids) >= 0 and max(ids) < bound):
                bad = [i for i in ids if not 0 <= i < bound][:8]
                msg = f"{name} block ids {bad} out of range [0, {bound})"
                raise IndexError(msg)
        return g, c

    def _copy_cuda(self, job: _Job, g_ids: array.array[int], c_ids: array.array[int],
                   stream: torch.cuda.Stream, start: torch.cuda.Event) -> None:
        # Preference: one 2D copy per run (equally spaced planes), else one batch call for
        # the job, else the per-copy methods. A method names the most it may use.
        # ``start`` marks where the job begins on ``stream`` (extra streams wait for it).
        method = self.method
        planes = self.layout.planes
        scan = None
        if method == "gather" or (method == "auto" and (
                len(planes) > 1 or planes[0].shape[1] < _SMALL_ROW_BYTES)):
            scan = scan_runs(g_ids, c_ids)
        if method == "auto" and scan is not None and self._small_rows(len(g_ids), scan[0]):
            method = "gather"
        g, c = _as_tensor(g_ids), _as_tensor(c_ids)
        if method == "gather" and self._gather_plan is not None and scan is not None:
            staged_copy(self._gather_plan, job.is_store, g, scan[1], stream,
                        self._kernel_streams[job.is_store], self._memcpy,
                        self._stage_2d if self._memcpy is not None else None, job.keep_alive)
        elif self._memcpy_2d is not None and method in ("auto", "pitched"):
            self._copy_pitched(self._memcpy_2d, job.is_store, g, c, stream)
        elif self._batch_memcpy is not None and method in ("auto", "pitched", "batched"):
            self._copy_batched(self._batch_memcpy, job.is_store, g_ids, c_ids, stream, start)
        else:
            with torch.cuda.stream(stream):
                self._copy(job, job.is_store, g.tolist(), c.tolist())

    def _small_rows(self, num_blocks: int, joint_runs: int) -> bool:
        """True when the job's DMAs would average under 256 KiB (scattered per-layer rows).

        Measured on an H100: the copy engines lose a fixed cost per row, so such jobs
        are gathered on the device first (see _staged).
        """
        planes = self.layout.planes
        return num_blocks * self._block_bytes / (joint_runs * len(planes)) < _SMALL_ROW_BYTES

    def _copy_pitched(self, memcpy_2d: _cudart.Memcpy2D, is_store: bool, g: torch.Tensor,
                      c: torch.Tensor, stream: torch.cuda.Stream) -> None:
        # One copy-engine operation moves a run of blocks in every plane (rows = planes),
        # where the per-layer layout would otherwise need one small copy per plane.
        handle = stream.cuda_stream
        for dst, dpitch, src, spitch, width, height in self._plan.pitched_copies(g, c, is_store):
            rc = memcpy_2d(dst, dpitch, src, spitch, width, height, handle)
            if rc != 0:
                _cudart.clear_error()
                msg = f"cudaMemcpy2DAsync returned CUDA error {rc} ({height} rows of {width} bytes)"
                raise RuntimeError(msg)

    def _copy_batched(self, batch_memcpy: _cudart.BatchMemcpy, is_store: bool, g_ids: array.array[int],
                      c_ids: array.array[int], stream: torch.cuda.Stream, start: torch.cuda.Event) -> None:
        # Every plane and run of the job in one runtime call: thousands of DMA copies for
        # the per-layer layout cost one call's host time, and the copy engines see the
        # whole batch at once instead of a trickle of single copies.
        arrays = self._plan.single_plane_descriptors(g_ids, c_ids, is_store)
        if arrays is not None:
            count = len(arrays[0])
            dst, src, size = (a.buffer_info()[0] for a in arrays)
        else:
            tensors = self._plan.descriptors(_as_tensor(g_ids), _as_tensor(c_ids), is_store)
            count = tensors[0].numel()
            dst, src, size = (t.data_ptr() for t in tensors)
        # Split over the direction's DMA lanes (H100, 256 scattered 2 MiB blocks: 0.989x of
        # the contiguous copy on one stream, 0.995x on four). Every lane starts where the
        # job's stream stands now, and the job's stream waits for every lane at the end.
        lanes = [stream, *self._lanes[is_store]] if count >= 2 * _DMA_LANES else [stream]
        per = -(-count // len(lanes))
        lanes = lanes[:-(-count // per)]  # no empty part (9 copies on 4 lanes: 3+3+3)
        for i, lane in enumerate(lanes):
            if lane is not stream:
                lane.wait_event(start)
            first, part = i * per, min(per, count - i * per)
            rc = batch_memcpy(dst + 8 * first, src + 8 * first, size + 8 * first, part,
                              lane.cuda_stream)
            if rc != 0:
                _cudart.clear_error()
                msg = f"cudaMemcpyBatchAsync returned CUDA error {rc} for {part} copies"
                raise RuntimeError(msg)
        for lane in lanes[1:]:
            done = torch.cuda.Event()
            done.record(lane)
            stream.wait_event(done)

    def _copy(self, job: _Job, is_store: bool, gpu_ids: list[int], cpu_ids: list[int]) -> None:
        runs = coalesce_runs(gpu_ids, cpu_ids)
        for gpu_plane, cpu_plane in zip(self.layout.planes, self.cpu_planes, strict=True):
            method = self.method
            dense = gpu_plane.stride(0) == gpu_plane.shape[1]
            if method == "per_block" or not dense:
                plane_runs = [(g, c, 1) for g, c in zip(gpu_ids, cpu_ids, strict=True)]
            else:  # coalesced, and batched / auto where there is no batch API or no CUDA
                plane_runs = runs
            if self._memcpy is not None:
                self._copy_raw(self._memcpy, is_store, gpu_plane, cpu_plane, plane_runs)
                continue
            for g, c, n in plane_runs:
                if is_store:
                    cpu_plane[c:c + n].copy_(gpu_plane[g:g + n], non_blocking=True)
                else:
                    gpu_plane[g:g + n].copy_(cpu_plane[c:c + n], non_blocking=True)

    def _copy_raw(self, memcpy: _cudart.Memcpy, is_store: bool,
                  gpu_plane: torch.Tensor, cpu_plane: torch.Tensor,
                  runs: list[tuple[int, int, int]]) -> None:
        # Each run is contiguous on both sides: whole rows of a dense plane, or a single
        # row (n == 1) of a plane with gaps. uint8 planes: strides are in bytes.
        row = gpu_plane.shape[1]
        g_base, g_stride = gpu_plane.data_ptr(), gpu_plane.stride(0)
        c_base, c_stride = cpu_plane.data_ptr(), cpu_plane.stride(0)
        stream = torch.cuda.current_stream(self._device_index).cuda_stream
        for g, c, n in runs:
            g_ptr, c_ptr, nbytes = g_base + g * g_stride, c_base + c * c_stride, n * row
            rc = memcpy(c_ptr, g_ptr, nbytes, stream) if is_store else memcpy(g_ptr, c_ptr, nbytes, stream)
            if rc != 0:
                _cudart.clear_error()
                msg = f"cudaMemcpyAsync returned CUDA error {rc}"
                raise RuntimeError(msg)

    # ------------------------------------------------------------------ completion
    def get_finished(self) -> list[TransferResult]:
        """Return the jobs that completed (or failed) since the last call, in order.

        Blocks only until every submitted job has been issued (a few hundred
        microseconds of the issue thread's work), never for the copies themselves.
        """
        done: list[TransferResult] = []
        pending: list[_Job] = []
        # Every job issued before anything else (here, if the issue thread has not begun
        # it). Without this, a caller polling in a tight loop starves the thread of the GIL
        # and the copies are issued late or never (seen on an H100: an engine spun 10,000
        # empty steps waiting for loads). The engine polls after its forward is launched,
        # so issuing here overlaps device work.
        for job in self._jobs:
            self._await_issued(job)
        for job in self._jobs:
            finished = True
            if job.error is None and job.end_event is not None:
                try:
                    finished = job.end_event.query()
                except Exception as exc:  # noqa: BLE001 - a device error fails the job
                    job.error = f"{type(exc).__name__}: {exc}"
                    logger.warning("KV transfer job %d failed: %s", job.job_id, job.error)
            if finished:
                done.append(self._result(job))
            else:
                pending.append(job)
        self._jobs = pending
        return done

    def wait(self, job_ids: Sequence[int] | None = None) -> None:
        """Block until the given jobs (all pending jobs by default) have completed."""
        wanted = None if job_ids is None else set(job_ids)
        jobs = [job for job in self._jobs if wanted is None or job.job_id in wanted]
        # Issue first, then block: blocking on an earlier job releases the GIL, and the
        # issue thread would then take a later job that this thread could issue at once.
        for job in jobs:
            self._await_issued(job)
        for job in jobs:
            if job.end_event is not None:
                try:
                    job.end_event.synchronize()
                except Exception as exc:  # noqa: BLE001
                    job.error = f"{type(exc).__name__}: {exc}"
            # Done with its staging and index tensors: hand them back to the allocator now,
            # not at the next get_finished (a caller that waits job by job would otherwise
            # hold every job's staging memory).
            job.keep_alive.clear()

    @property
    def num_pending(self) -> int:
        """Jobs submitted and not yet reported by :meth:`get_finished`."""
        return len(self._jobs)

    @staticmethod
    def _result(job: _Job) -> TransferResult:
        seconds = job.host_seconds or (time.perf_counter() - job.submitted_at)
        if job.error is None and job.start_event is not None and job.end_event is not None:
            try:  # device time of the copies themselves, not of the polling
                seconds = job.start_event.elapsed_time(job.end_event) / 1e3
            except RuntimeError:
                pass
        return TransferResult(job.job_id, job.error is None, job.is_store, job.num_bytes,
                              seconds, job.issue_seconds)

    def shutdown(self) -> None:
        """Wait for in-flight jobs so no DMA touches freed memory; stop the issue thread."""
        self.wait()
        if self._issuer is not None:
            self._issuer.close()
            self._issuer = None
