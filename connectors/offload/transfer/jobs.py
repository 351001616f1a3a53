"""Records and id helpers of the block mover: what a job is, what it reports, its ids.

Primitives: :class:`Job`, :class:`TransferResult`, :class:`EventPool`,
:func:`chunk_to_sub_block_ids`, :func:`coalesce_runs`, :func:`id_array`, :func:`as_tensor`.
"""

from __future__ import annotations

import array
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "EventPool",
    "Job",
    "TransferResult",
    "as_tensor",
    "chunk_to_sub_block_ids",
    "coalesce_runs",
    "id_array",
]


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


def id_array(ids: Sequence[int]) -> array.array[int]:
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


def as_tensor(ids: array.array[int]) -> torch.Tensor:
    """The ids as an int64 tensor sharing the array's memory."""
    if not ids:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(ids, dtype=torch.int64)


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
class Job:
    """One submitted job, from submission until :meth:`KVBlockMover.get_finished` reports it."""

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


class EventPool:
    """CUDA events kept for reuse instead of one new ``torch.cuda.Event`` per use.

    Why: a job used three new events (ready, start, end), each a Python object and a
    ``cudaEventCreate`` at its first record, on the engine's step or the issue thread.
    An event may be recorded again once nothing will wait on or query its last record:
    the mover returns the ready event after the job's stream has been told to wait for
    it, and the start / end events once the job's result is built.
    ``list.pop`` / ``append`` are atomic, so the caller and the issue thread may share it.
    """

    def __init__(self, *, timing: bool) -> None:
        self._timing = timing
        self._free: list[torch.cuda.Event] = []

    def get(self) -> torch.cuda.Event:
        """A free event (a new one when none is free)."""
        try:
            return self._free.pop()
        except IndexError:
            return torch.cuda.Event(enable_timing=self._timing)

    def put(self, event: torch.cuda.Event) -> None:
        """Hand an event back; the caller no longer waits on or queries it."""
        self._free.append(event)
