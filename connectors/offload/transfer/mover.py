"""The block mover: moves KV blocks between the device KV cache and one CPU buffer.

Importable with torch alone (the benchmark runs it on machines without msgspec).

Primitives: :class:`KVBlockMover` (one CPU buffer + submit_store / submit_load /
get_finished / wait), :data:`METHODS`.

Layout. The device KV cache is seen as byte planes, one row per block, cross-layer where
the engine's tensors allow (:mod:`.layout`): a block then moves as one DMA instead of
``num_layers`` small ones. Other layouts give one plane per layer (still batched in one
job, just more copy calls).

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
                   planes at a time (16- or 8-byte words, one kernel per group where the planes
                   share a span), and move each group with one large (2D) DMA, kernels and
                   DMAs pipelined on two streams (:mod:`.staging`; uses some SM time)
    ``auto``       the default: ``gather`` when the job's copies would average under
                   256 KiB (scattered rows of the per-layer layout), else ``pitched``
                   (which falls back to ``batched``, then ``coalesced``)

Issue thread. On CUDA the copies are issued by a background thread (:mod:`.issue_thread`):
the caller records one event on its current stream, which fixes where the copies sit in
stream order, and returns; ``get_finished`` and ``wait`` first wait until the thread has
queued the jobs (so a caller polling in a loop cannot starve it of the GIL); a job the
thread has not begun by then is issued by the caller itself, which is about to block anyway
(waiting for the thread to wake and take the GIL cost 2-3% of a 512 MiB transfer).

Single copies go through ``cudaMemcpyAsync`` by ctypes when the CUDA runtime loads and
``Tensor.copy_(non_blocking=True)`` otherwise (~3 vs ~26 us of host time per copy);
``batched`` without the batch API behaves as ``coalesced``.

On CPU tensors the same code runs with plain synchronous ``copy_`` (what CI tests).

The mover owns a :class:`~.copy_method.CopyMethod` (how one job's copies are queued, by
method) and keeps registration, submission, the issuing of a job (range checks, events,
failures), the issue thread's hand-off and completion.

Failures. Any exception while submitting or completing a job marks that job failed (it
is logged and reported through :meth:`KVBlockMover.get_finished` with
``success=False``); nothing is asserted away. A job that fails after queueing some of its
copies is reported only once those have finished (its end event follows them), since its
caller then reuses the slots, blocks and staging memory the job named.
"""

from __future__ import annotations

import array
import functools
import logging
import threading
import time
import weakref
from collections.abc import Mapping, Sequence

import torch

from connectors.offload.transfer.copy_method import CopyMethod
from connectors.offload.transfer.issue_thread import IssueThread
from connectors.offload.transfer.jobs import EventPool, Job, TransferResult, as_tensor, id_array
from connectors.offload.transfer.layout import BlockLayout, build_block_layout

__all__ = ["METHODS", "KVBlockMover"]

logger = logging.getLogger(__name__)

METHODS = ("auto", "pitched", "batched", "coalesced", "per_block", "gather")

# The issue thread's start delay on CUDA (see .issue_thread): measured with
# benchmarks/probes/probe_interference_ab.py.
# H100, 64 blocks each way per 5.5 ms step, in one process: step slowdown +3.0% -> +2.2%
# (cross-layer) and +3.7% -> +3.2% (per-layer) at 0.1 ms; 0.3 and 1 ms no better.
_ISSUE_DELAY_S = 0.0001


# Jobs of at least this many ids check their range with one tensor op, smaller ones in Python.
_TORCH_RANGE_CHECK_FROM = 512


def _claimed(job: Job) -> bool:
    return job.claimed


def _cpu_buffer(layout: BlockLayout, num_cpu_blocks: int, pin: bool
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """One allocation for all planes (pinning is expensive: done once, at registration)
    and its ``(num_cpu_blocks, row_bytes)`` view per plane."""
    rows = {p.shape[1] for p in layout.planes}
    if len(rows) == 1:
        buffer = torch.empty((len(layout.planes), num_cpu_blocks, rows.pop()),
                             dtype=torch.uint8, pin_memory=pin)
        return buffer, tuple(buffer.unbind(0))
    buffer = torch.empty(num_cpu_blocks * layout.block_bytes, dtype=torch.uint8,
                         pin_memory=pin)
    planes, offset = [], 0
    for p in layout.planes:
        size = num_cpu_blocks * p.shape[1]
        planes.append(buffer[offset:offset + size].view(num_cpu_blocks, -1))
        offset += size
    return buffer, tuple(planes)


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
        copier: how a job's copies are queued (the method's runtime calls and plans).
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
        self.num_cpu_blocks = num_cpu_blocks
        pin = self.is_cuda if pin_memory is None else pin_memory
        self.cpu_buffer, self.cpu_planes = _cpu_buffer(self.layout, num_cpu_blocks, pin)
        self._jobs: list[Job] = []
        # Each direction's stream (CUDA): a job's copies and its start and end events.
        self._streams: dict[bool, torch.cuda.Stream] = (
            {d: torch.cuda.Stream(self.device) for d in (True, False)} if self.is_cuda else {})
        self._ready_events = EventPool(timing=False)
        self._timing_events = EventPool(timing=True)
        self.copier = CopyMethod(method, self.layout, self.cpu_planes, self._device_index,
                                 raw_memcpy)
        self._block_bytes = self.layout.block_bytes
        self._issuer: IssueThread | None = None
        self._claim_lock = threading.Lock()
        if issue_thread or (self.is_cuda and issue_thread is None):
            self._issuer = IssueThread(self.device, name=f"kv-transfer-issue-{id(self):x}",
                                       delay=_ISSUE_DELAY_S if self.is_cuda else 0.0)
            # A mover dropped without shutdown() still stops its thread.
            weakref.finalize(self, self._issuer.close, join=False)

    @property
    def method(self) -> str:
        """The transfer method (see the module docstring); set it to change the method of
        the jobs submitted from then on."""
        return self.copier.method

    @method.setter
    def method(self, method: str) -> None:
        self.copier.method = method

    @property
    def batched_available(self) -> bool:
        """True when jobs can be issued as one ``cudaMemcpyBatchAsync`` (CUDA 12.8+)."""
        return self.copier.batch_memcpy is not None

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
        # The engine pays every microsecond here before its forward: keep it lean (the
        # range check and everything else runs where the job is issued).
        job = Job(job_id, is_store, len(src_ids) * self._block_bytes, time.perf_counter())
        self._jobs.append(job)
        try:
            gpu_ids, cpu_ids = (src_ids, dst_ids) if is_store else (dst_ids, src_ids)
            if len(gpu_ids) != len(cpu_ids):
                msg = f"{len(gpu_ids)} device block ids but {len(cpu_ids)} CPU block ids"
                raise ValueError(msg)
            g, c = id_array(gpu_ids), id_array(cpu_ids)
            ready = None
            if self.is_cuda:
                # Fixes the copies' place in stream order now, whichever thread issues
                # them: a store reads what the model queued so far; a load overwrites
                # blocks that earlier kernels may still read.
                ready = self._ready_events.get()
                ready.record(torch.cuda.current_stream(self._device_index))
        except Exception as exc:  # noqa: BLE001 - any failure fails the job, never the engine
            self._fail(job, exc)
            return
        if self._issuer is None:
            self._issue(job, ready, g, c)
        else:
            job.issued = threading.Event()
            job.issue_args = (ready, g, c)
            self._issuer.submit(functools.partial(self._issue_claimed, job),
                                functools.partial(_claimed, job) if self._skip_claimed else None)

    # The issue thread drops a job that a waiting caller has claimed before it wakes up
    # (see _issuer); False only to measure the thread without that check.
    _skip_claimed = True

    def _claim(self, job: Job) -> bool:
        """Take the job for issuing if no thread has; True when the caller must issue it."""
        with self._claim_lock:
            if job.claimed:
                return False
            job.claimed = True
            return True

    def _issue_claimed(self, job: Job) -> None:
        if self._claim(job):
            self._issue(job, *job.issue_args)

    def _await_issued(self, job: Job) -> None:
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

    # ------------------------------------------------------------------ issuing
    def _issue(self, job: Job, ready: torch.cuda.Event | None, g_ids: array.array[int],
               c_ids: array.array[int]) -> None:
        """Queue a job's copies on its direction's stream (CPU: copy now); never raises."""
        t0 = time.perf_counter()
        try:
            self._check_range(g_ids, c_ids)
            if ready is None:  # CPU cache: plain synchronous copies
                if g_ids:
                    self.copier.copy_host(job, g_ids, c_ids)
                job.host_seconds = time.perf_counter() - job.submitted_at
                return
            stream = self._streams[job.is_store]
            stream.wait_event(ready)
            start = self._timing_events.get()
            start.record(stream)
            job.start_event = start
            if g_ids:
                self.copier.copy_cuda(job, g_ids, c_ids, stream, start)
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
            logger.warning("KV transfer job %d: no end event after its failure: %s", job.job_id,
                           exc)
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

    # ------------------------------------------------------------------ completion
    def get_finished(self) -> list[TransferResult]:
        """Return the jobs that completed (or failed) since the last call, in order.

        Blocks only until every submitted job has been issued (a few hundred
        microseconds of the issue thread's work), never for the copies themselves.
        """
        done: list[TransferResult] = []
        pending: list[Job] = []
        # Every job issued before anything else (here, if the issue thread has not begun
        # it). Without this, a caller polling in a tight loop starves the thread of the GIL
        # and the copies are issued late or never (seen on an H100: an engine spun 10,000
        # empty steps waiting for loads). The engine polls after its forward is launched,
        # so issuing here overlaps device work.
        for job in self._jobs:
            self._await_issued(job)
        for job in self._jobs:
            finished = True
            if job.end_event is not None:  # a failed job too: copies it queued may still run
                try:
                    finished = job.end_event.query()
                except Exception as exc:  # noqa: BLE001 - a device error fails the job
                    job.error = job.error or f"{type(exc).__name__}: {exc}"
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

    def _result(self, job: Job) -> TransferResult:
        seconds = job.host_seconds or (time.perf_counter() - job.submitted_at)
        if job.error is None and job.start_event is not None and job.end_event is not None:
            try:  # device time of the copies themselves, not of the polling
                seconds = job.start_event.elapsed_time(job.end_event) / 1e3
            except RuntimeError:
                pass
        for event in (job.start_event, job.end_event):
            if event is not None:  # the job is done and reported: nothing queries them again
                self._timing_events.put(event)
        return TransferResult(job.job_id, job.error is None, job.is_store, job.num_bytes,
                              seconds, job.issue_seconds)

    def shutdown(self) -> None:
        """Wait for in-flight jobs so no DMA touches freed memory; stop the issue thread."""
        self.wait()
        if self._issuer is not None:
            self._issuer.close()
            self._issuer = None
