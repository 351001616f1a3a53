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
then issues its copies (``cudaMemcpyAsync`` through ctypes when the CUDA runtime loads,
``Tensor.copy_(non_blocking=True)`` otherwise: ~3 vs ~26 us of host time per copy) and
records an end event; completion is polled with ``event.query()``. Copies go through the DMA copy engines so they do not
take SMs from the model. Methods (``KVBlockMover(method=...)``):

    ``coalesced``  runs of consecutive source AND destination ids in one copy (default)
    ``per_block``  one copy per block and plane (the baseline the others must beat)
    ``gather``     gather the scattered blocks on the device into a staging buffer,
                   then copy runs of consecutive CPU ids (uses SMs and device memory)
    ``auto``       per job and plane: ``gather`` when the copies would average under
                   256 KiB (scattered per-layer pieces), else ``coalesced`` (the default)

On CPU tensors the same code runs with plain synchronous ``copy_`` (what CI tests).

Failures. Any exception while submitting or completing a job marks that job failed (it
is logged and reported through :meth:`KVBlockMover.get_finished` with
``success=False``); nothing is asserted away.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

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

METHODS = ("auto", "coalesced", "per_block", "gather")
_CUDA_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction inferred from the (UVA) pointers


@functools.cache
def _raw_memcpy_async() -> Callable[[int, int, int, int], int] | None:
    """``cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, stream)`` through ctypes, or None.

    Why: ``Tensor.copy_`` costs about 26 us of host time per call (two slice views
    plus the dispatcher); a scattered batch of 256 blocks then spends ~7 ms of the
    engine's step just *issuing* copies, before the forward. The runtime call
    itself costs ~3 us (measured on an H200: 0.7 ms for 256). It uses the same
    primary context and streams as torch. Looked up in the CUDA runtime that torch
    ships (``nvidia/*/lib``) first, then the system's; None if none loads, and the
    mover falls back to ``Tensor.copy_``.
    """
    torch_dir = os.path.dirname(torch.__file__)
    candidates = sorted(glob.glob(os.path.join(torch_dir, "lib", "libcudart.so*")))
    candidates += sorted(glob.glob(os.path.join(os.path.dirname(torch_dir), "nvidia", "*", "lib",
                                                "libcudart.so*")), reverse=True)
    found = ctypes.util.find_library("cudart")
    if found:
        candidates.append(found)
    for path in candidates:
        try:
            fn = ctypes.CDLL(path).cudaMemcpyAsync
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        return lambda dst, src, nbytes, stream: fn(dst, src, nbytes, _CUDA_MEMCPY_DEFAULT, stream)
    return None
_SMALL_ROW_BYTES = 256 * 1024  # below this a DMA per row is launch-bound: gather instead


# ---------------------------------------------------------------------------- layout
@dataclass(frozen=True, slots=True)
class BlockLayout:
    """The device KV cache as byte planes.

    Attributes:
        planes: uint8 tensors ``(num_blocks, row_bytes)``; block ``b`` of plane ``p`` is
            ``planes[p][b]``, one contiguous row. A row may be followed by a gap
            (``stride(0) > row_bytes``), in which case runs are not coalesced.
        cross_layer: True when one plane holds all layers of a block.
    """

    planes: tuple[torch.Tensor, ...]
    cross_layer: bool

    @property
    def num_blocks(self) -> int:
        """Number of device blocks."""
        return self.planes[0].shape[0]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all planes."""
        return sum(p.shape[1] for p in self.planes)

    @property
    def device(self) -> torch.device:
        """Device of the KV cache."""
        return self.planes[0].device


def _byte_rows(storage_tensor: torch.Tensor, offset_bytes: int, num_rows: int,
               row_bytes: int, row_stride_bytes: int) -> torch.Tensor:
    """A uint8 (num_rows, row_bytes) view of ``storage_tensor``'s storage."""
    out = torch.empty(0, dtype=torch.uint8, device=storage_tensor.device)
    return out.set_(storage_tensor.untyped_storage(), offset_bytes, (num_rows, row_bytes),
                    (row_stride_bytes, 1))


def _plane_of(t: torch.Tensor) -> torch.Tensor:
    """One layer tensor ``(num_blocks, ...)`` as a byte plane; each block must be dense."""
    if t.dim() < 2 or not t[0].is_contiguous():
        msg = (f"KV cache tensor of shape {tuple(t.shape)} and strides {t.stride()}: "
               "each block (t[i]) must be one contiguous chunk")
        raise ValueError(msg)
    elt = t.element_size()
    return _byte_rows(t, t.storage_offset() * elt, t.shape[0], t[0].numel() * elt,
                      t.stride(0) * elt)


def cross_layer_planes(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """Recover the cross-layer block view of per-layer views of one tensor.

    Args:
        tensors: per-layer views ``base[:, i]`` of a ``(num_blocks, num_layers, ...)``
            tensor, in any order.

    Returns:
        A uint8 ``(num_blocks, num_layers * layer_block_bytes)`` view in which a row is
        all layers of one block, or None when the views are not laid out that way.
    """
    if not tensors:
        return None
    first = tensors[0]
    if first.dim() < 2 or not first[0].is_contiguous():
        return None
    same = all(
        t.device == first.device and t.dtype == first.dtype and t.shape == first.shape
        and t.stride() == first.stride()
        and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        for t in tensors
    )
    if not same:
        return None
    elt = first.element_size()
    layer_bytes = first[0].numel() * elt
    ordered = sorted(tensors, key=lambda t: t.storage_offset())
    offsets = [t.storage_offset() * elt for t in ordered]
    # Layers must sit back to back inside a block, and blocks back to back after that.
    if any(b - a != layer_bytes for a, b in zip(offsets, offsets[1:], strict=False)):
        return None
    row_bytes = layer_bytes * len(ordered)
    if first.stride(0) * elt < row_bytes:
        return None
    return _byte_rows(ordered[0], offsets[0], first.shape[0], row_bytes, first.stride(0) * elt)


def build_block_layout(kv_caches: Mapping[str, torch.Tensor] | Sequence[torch.Tensor]
                       ) -> BlockLayout:
    """Describe the KV cache as byte planes, cross-layer when possible.

    Args:
        kv_caches: layer name -> per-layer tensor ``(num_blocks, ...)`` (as given to
            ``register_kv_caches``), or a sequence of such tensors, or one cross-layer
            tensor ``(num_blocks, num_layers, ...)`` in a one-element sequence.

    Raises:
        ValueError: no tensors, tensors on different devices or with different block
            counts, or a block that is not one contiguous chunk.
    """
    tensors = list(kv_caches.values()) if isinstance(kv_caches, Mapping) else list(kv_caches)
    # Layers of KV cache groups that share a physical pool are views of the same
    # memory (slot i of each group): move each piece of memory once.
    unique: dict[tuple[int, int, tuple[int, ...], tuple[int, ...]], torch.Tensor] = {}
    for t in tensors:
        unique.setdefault((t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
                           t.stride()), t)
    tensors = list(unique.values())
    if not tensors:
        msg = "no KV cache tensors to register"
        raise ValueError(msg)
    if len({t.device for t in tensors}) != 1 or len({t.shape[0] for t in tensors}) != 1:
        msg = ("KV cache tensors must share one device and one block count, got "
               f"{sorted({(str(t.device), t.shape[0]) for t in tensors})}")
        raise ValueError(msg)
    base = cross_layer_planes(tensors) if len(tensors) > 1 else None
    if base is not None:
        return BlockLayout((base,), cross_layer=True)
    # Sorting by address keeps the CPU layout independent of dict order.
    ordered = sorted(tensors, key=lambda t: (t.untyped_storage().data_ptr(), t.storage_offset()))
    return BlockLayout(tuple(_plane_of(t) for t in ordered), cross_layer=len(tensors) == 1)


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
    """

    job_id: int
    success: bool
    is_store: bool
    num_bytes: int
    seconds: float | None


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
    keep_alive: list[torch.Tensor] = field(default_factory=list)  # staging, index tensors


class KVBlockMover:
    """Moves KV blocks between the device KV cache and one CPU buffer.

    Args:
        kv_caches: the KV cache (see :func:`build_block_layout`).
        num_cpu_blocks: number of CPU sub-blocks (one GPU block each) to allocate.
        pin_memory: pin the CPU buffer; defaults to True when the cache is on CUDA.
        method: one of ``auto``, ``coalesced``, ``per_block``, ``gather``.
        raw_memcpy: issue DMA copies with ``cudaMemcpyAsync`` through ctypes instead of
            ``Tensor.copy_`` (about 10x less host time per copy). None (default): when
            the CUDA runtime library loads; False: never; True: required.

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
                 method: str = "auto", raw_memcpy: bool | None = None) -> None:
        if method not in METHODS:
            msg = f"unknown transfer method {method!r}; valid: {', '.join(METHODS)}"
            raise ValueError(msg)
        if num_cpu_blocks < 1:
            msg = f"num_cpu_blocks must be >= 1, got {num_cpu_blocks}"
            raise ValueError(msg)
        self.layout = build_block_layout(kv_caches)
        self.device = self.layout.device
        self.is_cuda = self.device.type == "cuda"
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
        if self.is_cuda:
            self._streams = {True: torch.cuda.Stream(self.device),
                             False: torch.cuda.Stream(self.device)}
        self._jobs: list[_Job] = []
        # Issue DMA copies through the CUDA runtime directly (None: when available).
        memcpy = _raw_memcpy_async() if self.is_cuda and raw_memcpy is not False else None
        if raw_memcpy and memcpy is None:
            msg = ("raw_memcpy=True needs a CUDA KV cache" if not self.is_cuda
                   else "raw_memcpy=True but no CUDA runtime library could be loaded")
            raise ValueError(msg)
        self._memcpy = memcpy

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
        job = _Job(job_id, is_store, len(src_ids) * self.layout.block_bytes, time.perf_counter())
        self._jobs.append(job)
        try:
            gpu_ids, cpu_ids = (src_ids, dst_ids) if is_store else (dst_ids, src_ids)
            self._check_ids(gpu_ids, cpu_ids)
            if self.is_cuda:
                stream = self._streams[is_store]
                # Ordered after everything the model has queued so far: a store reads
                # what this step wrote; a load overwrites blocks earlier kernels may read.
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    job.start_event = torch.cuda.Event(enable_timing=True)
                    job.start_event.record(stream)
                    self._copy(job, is_store, list(gpu_ids), list(cpu_ids))
                    job.end_event = torch.cuda.Event(enable_timing=True)
                    job.end_event.record(stream)
            else:
                self._copy(job, is_store, list(gpu_ids), list(cpu_ids))
                job.host_seconds = time.perf_counter() - job.submitted_at
        except Exception as exc:  # noqa: BLE001 - any failure fails the job, never the engine
            job.error = f"{type(exc).__name__}: {exc}"
            logger.warning("KV %s job %d failed at submission: %s",
                           "store" if is_store else "load", job_id, job.error)

    def _check_ids(self, gpu_ids: Sequence[int], cpu_ids: Sequence[int]) -> None:
        if len(gpu_ids) != len(cpu_ids):
            msg = f"{len(gpu_ids)} device block ids but {len(cpu_ids)} CPU block ids"
            raise ValueError(msg)
        for name, ids, bound in (("device", gpu_ids, self.layout.num_blocks),
                                 ("CPU", cpu_ids, self.num_cpu_blocks)):
            bad = [i for i in ids if not 0 <= i < bound]
            if bad:
                msg = f"{name} block ids {bad[:8]} out of range [0, {bound})"
                raise IndexError(msg)

    def _copy(self, job: _Job, is_store: bool, gpu_ids: list[int], cpu_ids: list[int]) -> None:
        if not gpu_ids:
            return
        runs = coalesce_runs(gpu_ids, cpu_ids)
        for gpu_plane, cpu_plane in zip(self.layout.planes, self.cpu_planes, strict=True):
            method = self.method
            if method == "auto":
                # Measured on an H200: a DMA per copy is launch-bound below ~256 KiB, so
                # small scattered pieces are gathered on the device first.
                small = len(gpu_ids) * gpu_plane.shape[1] / len(runs) < _SMALL_ROW_BYTES
                method = "gather" if small else "coalesced"
            if method == "gather" and self.is_cuda:
                self._copy_gather(job, is_store, gpu_plane, cpu_plane, gpu_ids, cpu_ids)
                continue
            dense = gpu_plane.stride(0) == gpu_plane.shape[1]
            if method == "per_block" or not dense:
                plane_runs = [(g, c, 1) for g, c in zip(gpu_ids, cpu_ids, strict=True)]
            else:
                plane_runs = runs
            if self._memcpy is not None:
                self._copy_raw(self._memcpy, is_store, gpu_plane, cpu_plane, plane_runs)
                continue
            for g, c, n in plane_runs:
                if is_store:
                    cpu_plane[c:c + n].copy_(gpu_plane[g:g + n], non_blocking=True)
                else:
                    gpu_plane[g:g + n].copy_(cpu_plane[c:c + n], non_blocking=True)

    def _copy_raw(self, memcpy: Callable[[int, int, int, int], int], is_store: bool,
                  gpu_plane: torch.Tensor, cpu_plane: torch.Tensor,
                  runs: list[tuple[int, int, int]]) -> None:
        # Each run is contiguous on both sides: whole rows of a dense plane, or a single
        # row (n == 1) of a plane with gaps. uint8 planes: strides are in bytes.
        row = gpu_plane.shape[1]
        g_base, g_stride = gpu_plane.data_ptr(), gpu_plane.stride(0)
        c_base, c_stride = cpu_plane.data_ptr(), cpu_plane.stride(0)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        for g, c, n in runs:
            g_ptr, c_ptr, nbytes = g_base + g * g_stride, c_base + c * c_stride, n * row
            rc = memcpy(c_ptr, g_ptr, nbytes, stream) if is_store else memcpy(g_ptr, c_ptr, nbytes, stream)
            if rc != 0:
                msg = f"cudaMemcpyAsync returned CUDA error {rc}"
                raise RuntimeError(msg)

    def _copy_gather(self, job: _Job, is_store: bool, gpu_plane: torch.Tensor,
                     cpu_plane: torch.Tensor, gpu_ids: list[int], cpu_ids: list[int]) -> None:
        # Scattered device rows <-> one dense staging buffer (SM work), then the
        # staging buffer <-> CPU in as few DMAs as the CPU ids allow.
        idx_host = torch.tensor(gpu_ids, dtype=torch.int64).pin_memory()
        idx = idx_host.to(self.device, non_blocking=True)
        staging = torch.empty((len(gpu_ids), gpu_plane.shape[1]), dtype=torch.uint8,
                              device=self.device)
        # Allocated on this side stream; kept until the job is reported done so the
        # caching allocator cannot hand them out while the copies still use them.
        job.keep_alive += [idx_host, idx, staging]
        runs = coalesce_runs(range(len(cpu_ids)), cpu_ids)
        if is_store:
            torch.index_select(gpu_plane, 0, idx, out=staging)
            for s, c, n in runs:
                cpu_plane[c:c + n].copy_(staging[s:s + n], non_blocking=True)
        else:
            for s, c, n in runs:
                staging[s:s + n].copy_(cpu_plane[c:c + n], non_blocking=True)
            gpu_plane.index_copy_(0, idx, staging)

    # ------------------------------------------------------------------ completion
    def get_finished(self) -> list[TransferResult]:
        """Return the jobs that completed (or failed) since the last call, in order."""
        done: list[TransferResult] = []
        pending: list[_Job] = []
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
        for job in self._jobs:
            if job.end_event is not None and (wanted is None or job.job_id in wanted):
                try:
                    job.end_event.synchronize()
                except Exception as exc:  # noqa: BLE001
                    job.error = f"{type(exc).__name__}: {exc}"

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
                              seconds)

    def shutdown(self) -> None:
        """Wait for in-flight jobs so no DMA touches freed memory."""
        self.wait()
