"""Store fence: no GPU block is rewritten while a store still reads it.

A store is submitted at the start of the step after the one that computed its blocks and,
on CUDA, runs as an asynchronous DMA that may take several steps. The blocks of a
full-attention group stay allocated until the request finishes (the connector delays the
free while its stores are in flight) and a preempted request's stores are waited for
before the preemption, so only the blocks of sliding-window and chunked-local groups can
be freed while a store reads them: they leave the window while the request runs. The
engine may then hand such a block to another request (or to a load) and write into it.

vLLM 0.33's OffloadingConnector closes the same hole by fencing: it remembers which store
jobs read each sliding-window block and, when a block is allocated again, tells the
worker to wait for those jobs before the forward (``jobs_to_flush``). This module does the
same bookkeeping for the scheduler side; the worker waits in ``bind_connector_metadata``.
The check is against every block id the step allocated, cache hits included, so it may
wait for a store that did not need it (never the reverse).

Primitives: :class:`StoreFence`.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["StoreFence"]


class StoreFence:
    """Which stores in flight read which windowed-group GPU blocks."""

    def __init__(self) -> None:
        self._jobs_of: dict[int, set[int]] = {}  # GPU block id -> store jobs reading it
        self._blocks_of: dict[int, tuple[int, ...]] = {}  # store job -> its fenced blocks
        self._allocated: set[int] = set()  # fenced block ids allocated since the last take

    def __len__(self) -> int:
        """Store jobs in flight that fence at least one block."""
        return len(self._blocks_of)

    def add(self, job_id: int, block_ids: Iterable[int]) -> None:
        """Fence ``block_ids`` until :meth:`release` of ``job_id`` (a store reads them)."""
        blocks = tuple(block_ids)
        if not blocks:
            return
        self._blocks_of[job_id] = blocks
        for block_id in blocks:
            self._jobs_of.setdefault(block_id, set()).add(job_id)

    def release(self, job_id: int) -> None:
        """The store finished, failed or was never sent: its blocks are free to reuse."""
        for block_id in self._blocks_of.pop(job_id, ()):
            jobs = self._jobs_of[block_id]
            jobs.discard(job_id)
            if not jobs:
                del self._jobs_of[block_id]

    def allocated(self, block_ids: Iterable[int]) -> None:
        """The engine (re)allocated these blocks this step."""
        if self._jobs_of:  # nothing fenced: nothing to remember (the common case)
            self._allocated.update(b for b in block_ids if b in self._jobs_of)

    def take(self) -> list[int]:
        """The store jobs to wait for before this step's forward, sorted; clears the
        allocations seen so far."""
        if not self._allocated:
            return []  # most steps
        jobs: set[int] = set()
        for block_id in self._allocated:
            jobs |= self._jobs_of.get(block_id, set())
        self._allocated.clear()
        return sorted(jobs)
