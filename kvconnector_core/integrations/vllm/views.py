"""Thin views of vLLM's live scheduler objects, in the shapes kvconnector connectors read.

- :class:`BlockPoolView`: vLLM's ``BlockPool`` as a ``GPUBlockPoolView`` (vLLM's
  pool lacks ``iter_cached_blocks``).
- :class:`SchedulerOutputView`: vLLM's ``SchedulerOutput`` with
  ``preempted_req_ids`` never None (vLLM's ``make_empty()`` leaves it None).

vLLM's ``Request`` and ``KVCacheBlocks`` are passed through unchanged: they
have every attribute kvconnector's connectors read (the LoRA name is read with
``kvconnector_core.request.lora_name_of``).

Primitives: :class:`BlockPoolView`, :class:`SchedulerOutputView`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

__all__ = ["BlockPoolView", "SchedulerOutputView"]


class BlockPoolView:
    """vLLM's ``BlockPool`` behind kvconnector's ``GPUBlockPoolView`` protocol."""

    __slots__ = ("_pool",)

    def __init__(self, pool: Any) -> None:
        self._pool = pool

    @property
    def num_gpu_blocks(self) -> int:
        """Total blocks in the pool, the null block included."""
        return self._pool.num_gpu_blocks

    def touch(self, blocks: Sequence[Any]) -> None:
        """Pin: ref count + 1 (taken out of the free queue at 0)."""
        self._pool.touch(blocks)

    def free_blocks(self, ordered_blocks: Iterable[Any]) -> None:
        """Unpin: ref count - 1 (evictable at 0)."""
        self._pool.free_blocks(ordered_blocks)

    def get_cached_block(self, block_hash: bytes, kv_cache_group_ids: Sequence[int]
                         ) -> list[Any] | None:
        """The cached block per group for ``block_hash``, or None if a group misses."""
        return self._pool.get_cached_block(block_hash, list(kv_cache_group_ids))

    def iter_cached_blocks(self) -> Iterator[Any]:
        """Every block in the prefix cache (vLLM keeps a block or a ``{id: block}`` per hash)."""
        for entry in list(self._pool.cached_block_hash_to_block._cache.values()):  # noqa: SLF001
            if isinstance(entry, dict):
                yield from entry.values()
            else:
                yield entry

    def get_num_free_blocks(self) -> int:
        """Blocks that can be allocated now."""
        return self._pool.get_num_free_blocks()


class SchedulerOutputView:
    """vLLM's ``SchedulerOutput``, read through, with ``preempted_req_ids`` a set."""

    __slots__ = ("_out",)

    def __init__(self, scheduler_output: Any) -> None:
        self._out = scheduler_output

    @property
    def preempted_req_ids(self) -> set[str]:
        """Requests preempted this step (empty, never None)."""
        return self._out.preempted_req_ids or set()

    def replace(self, **changes: Any) -> SchedulerOutputView:
        """A view of a copy of the output with ``changes`` (the guard hides detached requests)."""
        return SchedulerOutputView(dataclasses.replace(self._out, **changes))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._out, name)
