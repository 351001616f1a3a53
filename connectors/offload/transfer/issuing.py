"""Issuing one job of the block mover: range checks, events, copies, failure.

Split from :mod:`connectors.offload.transfer`: :class:`JobIssuing` is a base class of
``KVBlockMover`` (above :class:`~connectors.offload.transfer.copy_method.CopyMethods`) holding what
runs wherever a job is issued, on the issue thread or on a caller: the ids' range check,
the stream order of the job (its ready, start and end events), the copies by method, and
what a failure leaves behind. The mover keeps submission, the hand-off between threads
and completion.
"""

from __future__ import annotations

import array
import logging
import time

import torch

from connectors.offload.transfer.copy_method import CopyMethods
from connectors.offload.transfer.jobs import Job, as_tensor

__all__ = ["JobIssuing"]

logger = logging.getLogger("connectors.offload.transfer")  # the mover's logger, as before the split

# Jobs of at least this many ids check their range with one tensor op, smaller ones in Python.
_TORCH_RANGE_CHECK_FROM = 512


class JobIssuing(CopyMethods):
    """Queues one job's copies wherever it is issued; the state is set by the mover."""

    num_cpu_blocks: int

    def _issue(self, job: Job, ready: torch.cuda.Event | None, g_ids: array.array[int],
               c_ids: array.array[int]) -> None:
        """Queue a job's copies on its direction's stream (CPU: copy now); never raises."""
        t0 = time.perf_counter()
        try:
            self._check_range(g_ids, c_ids)
            if ready is None:  # CPU cache: plain synchronous copies
                if g_ids:
                    self._copy_host(job, g_ids, c_ids)
                job.host_seconds = time.perf_counter() - job.submitted_at
                return
            stream = self._streams[job.is_store]
            stream.wait_event(ready)
            start = self._timing_events.get()
            start.record(stream)
            job.start_event = start
            if g_ids:
                self._copy_cuda(job, g_ids, c_ids, stream, start)
            end = self._timing_events.get()
            end.record(stream)
            job.end_event = end
        except Exception as exc:  # noqa: BLE001 - any failure fails the job, never the engine
            self._fail(job, exc)
            if job.start_event is not None and job.end_event is None:
                self._end_after_queued(job)
        finally:
            if ready is not None:  # waited for above (or never will be): free to record again
                self._ready_events.put(ready)
            job.issue_seconds = time.perf_counter() - t0
            if job.issued is not None:
                job.issued.set()  # last: the fields above are complete when it is seen

    def _end_after_queued(self, job: Job) -> None:
        """Give a job that failed while issuing an end event after what it had queued.

        Copies (and staged kernels) queued before the failure still run; the job must be
        reported only after them, or its caller reuses what it named (a failed store's CPU
        slots, a failed load's blocks, the staging memory) while they still write there.
        """
        try:
            end = self._timing_events.get()
            end.record(self._streams[job.is_store])
        except Exception as exc:  # noqa: BLE001 - a device error: nothing more can be queued
            logger.warning("KV transfer job %d: no end event after its failure: %s", job.job_id, exc)
            return
        job.end_event = end

    @staticmethod
    def _fail(job: Job, exc: Exception) -> None:
        job.error = f"{type(exc).__name__}: {exc}"
        logger.warning("KV %s job %d failed at submission: %s",
                       "store" if job.is_store else "load", job.job_id, job.error)

    def _check_range(self, g_ids: array.array[int], c_ids: array.array[int]) -> None:
        """Every id in range, else IndexError naming the bad ones (one C-speed pass each)."""
        for name, ids, bound in (("device", g_ids, self.layout.num_blocks),
                                 ("CPU", c_ids, self.num_cpu_blocks)):
            if not ids:
                continue
            # Builtin min/max cost ~20 ns an id; torch.aminmax ~10 us a call whatever
            # the size: the tensor op only pays off for large jobs.
            if len(ids) < _TORCH_RANGE_CHECK_FROM:
                low, high = min(ids), max(ids)
            else:
                low, high = (int(v) for v in torch.aminmax(as_tensor(ids)))
            if low < 0 or high >= bound:
                bad = [i for i in ids if not 0 <= i < bound][:8]
                msg = f"{name} block ids {bad} out of range [0, {bound})"
                raise IndexError(msg)
