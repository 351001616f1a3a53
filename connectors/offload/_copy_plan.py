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

from collections.abc import Sequence

import torch

__all__ = ["CopyPlan", "run_starts"]


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


class CopyPlan:
    """Per-plane addresses and strides of the device cache and the CPU buffer.

    Args:
        gpu_planes: uint8 ``(num_blocks, row_bytes)`` device planes.
        cpu_planes: the matching uint8 ``(num_cpu_blocks, row_bytes)`` CPU planes.

    The tensors must stay alive (and unmoved) while the plan is used; the mover owns both.
    """

    def __init__(self, gpu_planes: Sequence[torch.Tensor], cpu_planes: Sequence[torch.Tensor]
                 ) -> None:
        dense, gapped = [], []
        for g, c in zip(gpu_planes, cpu_planes, strict=True):
            row = g.shape[1]
            entry = (g.data_ptr(), g.stride(0), c.data_ptr(), c.stride(0), row)
            # A run of several rows is one copy only where rows are back to back on both sides.
            (dense if g.stride(0) == row and c.stride(0) == row else gapped).append(entry)
        self._dense = self._columns(dense)
        self._gapped = self._columns(gapped)

    @staticmethod
    def _columns(entries: list[tuple[int, int, int, int, int]]) -> tuple[torch.Tensor, ...] | None:
        if not entries:
            return None
        cols = torch.tensor(entries, dtype=torch.int64)
        return tuple(cols[:, i:i + 1] for i in range(5))  # each (planes, 1), broadcasts over runs

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
        cols = parts[0] if len(parts) == 1 else tuple(torch.cat(c) for c in zip(*parts, strict=True))
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
