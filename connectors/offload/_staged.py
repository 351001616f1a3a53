"""Pipelined gather: scattered small device rows <-> dense staging <-> CPU, on two streams.

Why: in the per-layer layout a block is one 64 KiB row per layer, and the copy engines
lose a fixed cost on every row they move (measured on an H100: one batched DMA per row
reaches 0.66x of the contiguous pinned copy, one 2D DMA per block 0.85x). Gathering a
group of planes' scattered rows into a dense staging buffer with a kernel turns them into
a few large DMAs. The kernel for group ``k + 1`` runs on the kernel stream while the DMA
of group ``k`` runs on the DMA stream, so the copy engines stay busy; the kernels move
device memory at TB/s and cost the model little SM time, which the interference
benchmark measures.

Loads run the other way: DMA group ``k`` into staging, then a scatter kernel per plane,
while the DMA of group ``k + 1`` proceeds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from connectors.offload import _cudart

__all__ = ["staged_copy"]

_GROUPS = 8  # pipeline depth: planes are moved in this many groups


def staged_copy(is_store: bool, gpu_planes: Sequence[torch.Tensor],
                cpu_planes: Sequence[torch.Tensor], gpu_ids: torch.Tensor,
                cpu_runs: Sequence[tuple[int, int, int]], dma_stream: torch.cuda.Stream,
                kernel_stream: torch.cuda.Stream, memcpy: Callable[[int, int, int, int], int] | None,
                keep_alive: list[torch.Tensor]) -> None:
    """Queue a staged transfer; on return the DMA stream is ordered after all of it.

    Args:
        is_store: device -> CPU when True.
        gpu_planes, cpu_planes: uint8 ``(blocks, row_bytes)`` planes, pairwise.
        gpu_ids: int64 CPU tensor of device block ids, one per staging row.
        cpu_runs: ``(staging_row, cpu_id, length)`` runs of consecutive CPU ids.
        dma_stream: the job's stream (already ordered after the model's work).
        kernel_stream: a second stream for the gather / scatter kernels.
        memcpy: ``cudaMemcpyAsync`` by ctypes, or None for ``Tensor.copy_``.
        keep_alive: receives the index and staging tensors, which must outlive the job.
    """
    device = gpu_planes[0].device
    n = gpu_ids.numel()
    kernel_stream.wait_stream(dma_stream)
    with torch.cuda.stream(kernel_stream):
        # Allocated on the kernel stream, released only after the job completes.
        idx = gpu_ids.pin_memory().to(device, non_blocking=True)
        staging = [torch.empty((n, p.shape[1]), dtype=torch.uint8, device=device)
                   for p in gpu_planes]
    keep_alive += [idx, *staging]
    per_group = -(-len(gpu_planes) // _GROUPS)
    groups = [range(i, min(i + per_group, len(gpu_planes)))
              for i in range(0, len(gpu_planes), per_group)]
    for planes in groups:
        if is_store:
            with torch.cuda.stream(kernel_stream):
                for p in planes:
                    torch.index_select(gpu_planes[p], 0, idx, out=staging[p])
            dma_stream.wait_event(_record(kernel_stream))
            for p in planes:
                _dma(memcpy, dma_stream, staging[p], cpu_planes[p], cpu_runs, to_cpu=True)
        else:
            for p in planes:
                _dma(memcpy, dma_stream, staging[p], cpu_planes[p], cpu_runs, to_cpu=False)
            kernel_stream.wait_event(_record(dma_stream))
            with torch.cuda.stream(kernel_stream):
                for p in planes:
                    gpu_planes[p].index_copy_(0, idx, staging[p])
    dma_stream.wait_event(_record(kernel_stream))  # the job ends after its last kernel


def _record(stream: torch.cuda.Stream) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(stream)
    return event


def _dma(memcpy: Callable[[int, int, int, int], int] | None, stream: torch.cuda.Stream,
         staging: torch.Tensor, cpu_plane: torch.Tensor, runs: Sequence[tuple[int, int, int]],
         *, to_cpu: bool) -> None:
    row = staging.shape[1]
    if memcpy is None:
        with torch.cuda.stream(stream):
            for s, c, k in runs:
                if to_cpu:
                    cpu_plane[c:c + k].copy_(staging[s:s + k], non_blocking=True)
                else:
                    staging[s:s + k].copy_(cpu_plane[c:c + k], non_blocking=True)
        return
    handle, s_base, c_base, c_stride = (stream.cuda_stream, staging.data_ptr(),
                                        cpu_plane.data_ptr(), cpu_plane.stride(0))
    for s, c, k in runs:
        dev, host = s_base + s * row, c_base + c * c_stride
        if c_stride != row and k > 1:  # CPU rows with gaps: one copy per row
            for j in range(k):
                _check(memcpy(host + j * c_stride, dev + j * row, row, handle) if to_cpu
                       else memcpy(dev + j * row, host + j * c_stride, row, handle))
            continue
        _check(memcpy(host, dev, k * row, handle) if to_cpu else memcpy(dev, host, k * row, handle))


def _check(rc: int) -> None:
    if rc != 0:
        _cudart.clear_error()
        msg = f"cudaMemcpyAsync returned CUDA error {rc}"
        raise RuntimeError(msg)
