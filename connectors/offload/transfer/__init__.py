"""Worker side of the CPU offloading tier: the engine that moves KV blocks.

Importable with torch alone (no msgspec): the benchmarks run it on machines without it.

Modules:
    mover          :class:`KVBlockMover`: one CPU buffer, submission, completion
    copy_method    :class:`~.copy_method.CopyMethod`: how one job's copies are queued
    jobs           a job, what it reports, id helpers, event pools
    issue_thread   the background thread that issues CUDA copies off the engine's step
    staging        pipelined gather through staging memory (method ``gather``)
    copy_plan      vectorised copy descriptors (pitched and batched methods)
    layout         the device KV cache seen as byte planes
    cudart         the CUDA runtime calls, through ctypes

Primitives: :class:`KVBlockMover`, :class:`TransferResult`, :class:`BlockLayout`,
:func:`build_block_layout`, :func:`cross_layer_planes`, :func:`chunk_to_sub_block_ids`,
:func:`coalesce_runs`.
"""

from __future__ import annotations

from connectors.offload.transfer.jobs import TransferResult, chunk_to_sub_block_ids, coalesce_runs
from connectors.offload.transfer.layout import BlockLayout, build_block_layout, cross_layer_planes
from connectors.offload.transfer.mover import KVBlockMover

__all__ = [
    "BlockLayout",
    "KVBlockMover",
    "TransferResult",
    "build_block_layout",
    "chunk_to_sub_block_ids",
    "coalesce_runs",
    "cross_layer_planes",
]
