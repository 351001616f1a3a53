"""Reusable memory of the staged (gather) copies: one set per transfer direction.

Split from :mod:`connectors.offload._staged`, which uses it: the staging buffer, the device
index, the pinned index buffers and the event that orders the two streams, kept for the
mover's lifetime instead of allocated per job.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from connectors.offload._cudart import Memcpy
    from connectors.offload._staged import GatherPlan

__all__ = ["StagingBuffers"]

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
    """

    def __init__(self, device: torch.device, plan: GatherPlan, memcpy: Memcpy | None = None) -> None:
        self.device = device
        self.memcpy = memcpy
        self.lock = threading.Lock()
        self.fence = torch.cuda.Event()  # every record/wait pair between the two streams
        self._words, self._word = plan.planes[0].shape[1], plan.word
        self._staging: torch.Tensor | None = None
        self._staging_rows: torch.Tensor | None = None
        self._device_index: torch.Tensor | None = None
        # Pinned index buffers (rows of one allocation) used in turn, each with the event
        # of its last upload: a job waits only for the upload of _HOST_SLOTS jobs ago
        # (long done), never for the previous job's, which may sit behind the model's work.
        self._host: torch.Tensor | None = None
        self._uploaded = [torch.cuda.Event() for _ in range(_HOST_SLOTS)]
        self._used = [False] * _HOST_SLOTS
        self._turn = 0
        self._pending: int | None = None  # the slot uploaded by the job being issued
        # Per job size: each stage's (index rows, staging rows) views, made once (two
        # slicing calls per stage and job otherwise); dropped when a buffer is replaced.
        self._views: dict[tuple[int, int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._index_views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

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

    def upload_index(self, plan: GatherPlan, gpu_ids: torch.Tensor, stream: torch.cuda.Stream,
                     keep_alive: list[torch.Tensor]) -> torch.Tensor:
        """The job's gather index on the device, copied on ``stream`` from a pinned buffer."""
        length = plan.index_length(gpu_ids.numel())
        slot = self._turn % _HOST_SLOTS
        self._turn += 1
        host = self._host
        if host is None or host.shape[1] < length:
            if host is not None:
                keep_alive.append(host)
            host = self._host = torch.empty((_HOST_SLOTS, length), dtype=torch.int64,
                                            pin_memory=True)
            self._used = [False] * _HOST_SLOTS
            self._index_views.clear()
        elif self._used[slot]:
            self._uploaded[slot].synchronize()  # its last upload has read it
        device_index = self._device_index
        if device_index is None or device_index.numel() < length:
            if device_index is not None:
                keep_alive.append(device_index)
            device_index = self._device_index = torch.empty(length, dtype=torch.int64,
                                                            device=self.device)
            self.clear_views()
        self._used[slot] = True
        key = (slot, length)
        views = self._index_views.get(key)
        if views is None:  # the two slices, made once per buffer and length
            views = self._index_views[key] = (host[slot, :length], device_index[:length])
        host_part, index = views
        plan.gather_index(gpu_ids, out=host_part)
        if self.memcpy is None:
            index.copy_(host_part, non_blocking=True)
        else:
            rc = self.memcpy(index.data_ptr(), host_part.data_ptr(), 8 * length, stream.cuda_stream)
            if rc != 0:
                msg = f"cudaMemcpyAsync of the gather index returned CUDA error {rc}"
                raise RuntimeError(msg)
        self._pending = slot
        return index

    def end_job(self, stream: torch.cuda.Stream) -> None:
        """Mark the job's pinned index buffer free once ``stream`` reaches this point.

        Called where the job ends (after its last kernel and copy), on its DMA stream:
        the upload, which ran on one of the job's streams, lies before that point.
        """
        slot, self._pending = self._pending, None
        if slot is not None:
            self._uploaded[slot].record(stream)
