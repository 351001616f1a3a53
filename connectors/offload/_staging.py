"""Reusable memory of the staged (gather) copies: one set per transfer direction.

Split from :mod:`connectors.offload._staged`, which uses it: the staging buffer, the device
index, the pinned index buffers and the event that orders the two streams, kept for the
mover's lifetime instead of allocated per job; and the geometry between staging and the
CPU tier (:func:`span_layout`, :func:`cpu_pitch`, :func:`staging_copies`), moved here from
``_staged`` (which re-exports them) to keep that module about the pipeline.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from connectors.offload._cudart import Memcpy
    from connectors.offload._staged import GatherPlan

__all__ = ["StagingBuffers", "cpu_pitch", "span_layout", "staging_copies"]

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

    def __init__(self, device: torch.device, plan: GatherPlan, memcpy: Memcpy | None = None,
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
            views = [(index[g.start * n:g.stop * n], staging[g.start * n:g.stop * n]) for g in groups]
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
            device_buffer = self._device_index = torch.empty(need, dtype=torch.int64, device=self.device)
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
            views = self._index_views[key] = (host[length:length + n], device_buffer[length:length + n])
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
