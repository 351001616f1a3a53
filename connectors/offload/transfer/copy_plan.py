"""Copy descriptors for one transfer job, built with a few vectorised tensor operations.

A job moves ``n`` blocks between device ids and CPU ids in every plane of the layout.
:class:`CopyPlan` holds, per plane, the base addresses, row strides and row sizes on both
sides, computed once when the KV cache is registered. For a job it returns three int64
arrays (destination address, source address, byte count per copy) that one
``cudaMemcpyBatchAsync`` consumes. Runs of consecutive ids on both sides become one copy in
dense planes; planes with gaps between rows get one copy per row.

Why vectorised: the per-layer layout has 32 planes, so a 256-block job is 8,192 copies.
Building their descriptors one Python object at a time costs milliseconds of the engine's
step; as (planes x runs) tensor arithmetic it costs tens of microseconds.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from itertools import pairwise

import torch

__all__ = ["CopyPlan", "cpu_runs", "estimate_joint_runs", "run_starts", "scan_runs"]


_KEY = 1 << 32  # ids are < 2**31, so gpu * _KEY + cpu advances by _KEY + 1 only on a run


def run_starts(gpu_ids: torch.Tensor, cpu_ids: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Runs where both ids advance by one, as tensors.

    Args:
        gpu_ids, cpu_ids: int64 tensors of equal length ``n >= 1``, ids in ``[0, 2**31)``.

    Returns:
        ``(gpu_start, cpu_start, length)`` per run, in input order.
    """
    n = gpu_ids.numel()
    # One combined key instead of two diffs: a few tensor ops fewer on the step's hot path.
    key = gpu_ids * _KEY + cpu_ids
    breaks = (key.diff() != _KEY + 1).nonzero().view(-1) + 1
    starts = torch.cat((_ZERO, breaks))
    ends = torch.cat((breaks, torch.full((1,), n, dtype=torch.int64)))
    return gpu_ids[starts], cpu_ids[starts], ends - starts


_ZERO = torch.zeros(1, dtype=torch.int64)


def _runs(gpu_ids: Sequence[int], cpu_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(gpu_start, cpu_start, length)`` per run where both ids advance by one."""
    runs: list[tuple[int, int, int]] = []
    g0, c0, n = gpu_ids[0], cpu_ids[0], 1
    for i in range(1, len(gpu_ids)):
        g, c = gpu_ids[i], cpu_ids[i]
        if g == g0 + n and c == c0 + n:
            n += 1
            continue
        runs.append((g0, c0, n))
        g0, c0, n = g, c, 1
    runs.append((g0, c0, n))
    return runs


def scan_runs(gpu_ids: Sequence[int], cpu_ids: Sequence[int]
              ) -> tuple[int, list[tuple[int, int, int]]]:
    """One pass over a job's ids: how many joint runs, and the runs of the CPU ids alone.

    Args:
        gpu_ids, cpu_ids: equal-length sequences of ints (``n >= 1``).

    Returns:
        ``(joint_runs, cpu_runs)``: the number of runs where both ids advance by one (the
        copies a DMA per run makes per plane), and ``(index, cpu_start, length)`` per run
        of consecutive CPU ids (what staged copies move to or from staging row ``index``).

    Why a Python loop: on the issue path it is 3x faster than the tensor version
    (:func:`run_starts` twice plus ``tolist``) for jobs of a few hundred blocks.
    """
    joint, runs, start = 1, [], 0
    prev_g, prev_c = gpu_ids[0], cpu_ids[0]
    for i in range(1, len(cpu_ids)):
        g, c = gpu_ids[i], cpu_ids[i]
        if c != prev_c + 1:
            runs.append((start, cpu_ids[start], i - start))
            start = i
            joint += 1
        elif g != prev_g + 1:
            joint += 1
        prev_g, prev_c = g, c
    runs.append((start, cpu_ids[start], len(cpu_ids) - start))
    return joint, runs


def cpu_runs(cpu_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(index, cpu_start, length)`` per run of consecutive CPU ids (``n >= 1``).

    The second output of :func:`scan_runs` alone, in half its time: the staged copies
    need only this, and a store computes it while its first gather kernel runs. One run
    (the usual store into fresh CPU slots) is recognised by one comparison at C speed.
    """
    n, first = len(cpu_ids), cpu_ids[0]
    if cpu_ids[n - 1] - first == n - 1:  # maybe one run (fresh CPU slots): check at C speed
        expected = range(first, first + n)
        if (cpu_ids == array.array(cpu_ids.typecode, expected) if isinstance(cpu_ids, array.array)
                else list(cpu_ids) == list(expected)):
            return [(0, first, n)]
    runs, start = [], 0
    prev = first
    for i in range(1, n):
        c = cpu_ids[i]
        if c != prev + 1:
            runs.append((start, cpu_ids[start], i - start))
            start = i
        prev = c
    runs.append((start, cpu_ids[start], len(cpu_ids) - start))
    return runs


_SAMPLE = 16  # id pairs looked at by estimate_joint_runs


def estimate_joint_runs(gpu_ids: Sequence[int], cpu_ids: Sequence[int]) -> int:
    """The joint runs of :func:`scan_runs` estimated from the first 16 pairs (``n >= 1``).

    Why: deciding whether a job's rows are scattered (then gathered on the device) needs
    only the order of magnitude, and the full scan of a 256-block job costs tens of
    microseconds before the first DMA. Exact for jobs of up to 16 blocks.
    """
    n = len(gpu_ids)
    k = min(n, _SAMPLE)
    breaks = sum(1 for i in range(1, k)
                 if gpu_ids[i] != gpu_ids[i - 1] + 1 or cpu_ids[i] != cpu_ids[i - 1] + 1)
    return 1 + (breaks * (n - 1) + (k - 2)) // (k - 1) if k > 1 else 1


class CopyPlan:
    """Per-plane addresses and strides of the device cache and the CPU buffer.

    Args:
        gpu_planes: uint8 ``(num_blocks, row_bytes)`` device planes.
        cpu_planes: the matching uint8 ``(num_cpu_blocks, row_bytes)`` CPU planes.

    The tensors must stay alive (and unmoved) while the plan is used; the mover owns both.
    """

    def __init__(self, gpu_planes: Sequence[torch.Tensor], cpu_planes: Sequence[torch.Tensor]
                 ) -> None:
        dense: list[tuple[int, int, int, int, int]] = []
        gapped: list[tuple[int, int, int, int, int]] = []
        for g, c in zip(gpu_planes, cpu_planes, strict=True):
            row = g.shape[1]
            entry = (g.data_ptr(), g.stride(0), c.data_ptr(), c.stride(0), row)
            # A run of several rows is one copy only where rows are back to back on both sides.
            (dense if g.stride(0) == row and c.stride(0) == row else gapped).append(entry)
        self._dense = self._columns(dense)
        self._gapped = self._columns(gapped)
        self.pitch = self._find_pitch(gpu_planes, cpu_planes)

    @staticmethod
    def _find_pitch(gpu_planes: Sequence[torch.Tensor], cpu_planes: Sequence[torch.Tensor]
                    ) -> tuple[int, int, int, int, int, int] | None:
        """``(gpu_base, gpu_pitch, cpu_base, cpu_pitch, row_bytes, num_planes)`` when the
        planes are dense, of one row size, and equally spaced on both sides; else None.

        Then block ``b`` of every plane is one 2D region (``num_planes`` rows of
        ``row_bytes``, ``gpu_pitch`` apart), so a run of blocks moves as ONE copy-engine
        operation instead of one per plane. The planes must also share one allocation on
        each side (per-layer views of one tensor); otherwise batched copies remain.
        """
        if len(gpu_planes) < 2:
            return None
        # A 2D copy must stay inside one allocation: equally spaced but separately
        # allocated tensors are refused by the runtime (seen on an H100, error 1).
        for planes in (gpu_planes, cpu_planes):
            if len({p.untyped_storage().data_ptr() for p in planes}) != 1:
                return None
        row = gpu_planes[0].shape[1]
        if any(p.shape[1] != row or p.stride(0) != row for p in (*gpu_planes, *cpu_planes)):
            return None
        g_pitch = _even_pitch(gpu_planes, row)
        c_pitch = _even_pitch(cpu_planes, row)
        if g_pitch is None or c_pitch is None:
            return None
        return (gpu_planes[0].data_ptr(), g_pitch, cpu_planes[0].data_ptr(), c_pitch, row,
                len(gpu_planes))

    def pitched_copies(self, gpu_ids: torch.Tensor, cpu_ids: torch.Tensor, is_store: bool
                       ) -> list[tuple[int, int, int, int, int, int]]:
        """``(dst, dpitch, src, spitch, width, height)`` per run: one 2D copy each.

        Only for plans with :attr:`pitch` set.
        """
        if self.pitch is None:
            msg = "pitched_copies needs planes that are equally spaced on both sides"
            raise ValueError(msg)
        g_base, g_pitch, c_base, c_pitch, row, height = self.pitch
        gs, cs, ns = (t.tolist() for t in run_starts(gpu_ids, cpu_ids))
        out = []
        for g, c, n in zip(gs, cs, ns, strict=True):
            gpu, cpu = g_base + g * row, c_base + c * row
            out.append((cpu, c_pitch, gpu, g_pitch, n * row, height) if is_store
                       else (gpu, g_pitch, cpu, c_pitch, n * row, height))
        return out

    @staticmethod
    def _columns(entries: list[tuple[int, int, int, int, int]]) -> tuple[torch.Tensor, ...] | None:
        if not entries:
            return None
        cols = torch.tensor(entries, dtype=torch.int64)
        return tuple(cols[:, i:i + 1] for i in range(5))  # each (planes, 1), broadcasts over runs

    def single_plane_descriptors(self, gpu_ids: Sequence[int], cpu_ids: Sequence[int],
                                 is_store: bool
                                 ) -> tuple[array.array[int], array.array[int],
                                            array.array[int]] | None:
        """:meth:`descriptors` as ``array('q')`` built in Python, for one dense plane (else None).

        Why: the engine's cross-layer layout is one plane, where a job is at most a few
        hundred copies; a Python pass costs a third of the dozen tensor operations, and
        every microsecond here delays the job's first DMA.
        """
        if self._gapped is not None or self._dense is None or self._dense[0].shape[0] != 1:
            return None
        g_base, g_stride, c_base, c_stride, row = (int(col) for col in self._dense)
        gpu, cpu, size = [], [], []
        for g, c, n in _runs(gpu_ids, cpu_ids):
            gpu.append(g_base + g * g_stride)
            cpu.append(c_base + c * c_stride)
            size.append(n * row)
        gpu_a, cpu_a, size_a = array.array("q", gpu), array.array("q", cpu), array.array("q", size)
        return (cpu_a, gpu_a, size_a) if is_store else (gpu_a, cpu_a, size_a)

    def descriptors(self, gpu_ids: torch.Tensor, cpu_ids: torch.Tensor, is_store: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dsts, srcs, sizes)``: contiguous int64 arrays, one entry per copy.

        Args:
            gpu_ids, cpu_ids: int64 tensors of equal length >= 1, already range-checked.
            is_store: device -> CPU when True, CPU -> device otherwise.
        """
        parts = []
        if self._dense is not None:
            parts.append(self._expand(self._dense, *run_starts(gpu_ids, cpu_ids)))
        if self._gapped is not None:
            parts.append(self._expand(self._gapped, gpu_ids, cpu_ids, torch.ones_like(gpu_ids)))
        cols = (parts[0] if len(parts) == 1
                else tuple(torch.cat(c) for c in zip(*parts, strict=True)))
        gpu_ptr, cpu_ptr, size = cols
        return (cpu_ptr, gpu_ptr, size) if is_store else (gpu_ptr, cpu_ptr, size)

    @staticmethod
    def _expand(cols: tuple[torch.Tensor, ...], g: torch.Tensor, c: torch.Tensor,
                n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g_base, g_stride, c_base, c_stride, row = cols
        gpu_ptr = (g_base + g * g_stride).view(-1)
        cpu_ptr = (c_base + c * c_stride).view(-1)
        size = (row * n).view(-1)
        return gpu_ptr, cpu_ptr, size


def _even_pitch(planes: Sequence[torch.Tensor], row: int) -> int | None:
    """The distance between consecutive planes where it is one and leaves room for a
    plane's rows; else None."""
    ptrs = [p.data_ptr() for p in planes]
    pitch = ptrs[1] - ptrs[0]
    if pitch < planes[0].shape[0] * row or any(b - a != pitch for a, b in pairwise(ptrs)):
        return None
    return pitch
