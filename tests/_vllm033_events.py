"""An independent replica of vLLM 0.33's KV event structs (vllm/distributed/kv_events.py).

Field names, order, types and msgspec options as vLLM 0.33 declares them (reference §5),
so tests can cross-decode our wire form with vLLM's layout without installing vLLM.

Deliberately no ``from __future__ import annotations``: msgspec resolves string
annotations in the defining module's globals, and a test module that imports our own
``BlockStored`` would make the replica's unions silently resolve to our classes.
"""

from typing import Any

import msgspec


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's batch envelope: an array ``[ts, events, data_parallel_rank]``."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """vLLM's event base: tagged maps, None defaults omitted."""


class BlockStored(KVCacheEvent):
    """vLLM 0.33's BlockStored, field for field."""

    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[Any] | None = None


class BlockRemoved(KVCacheEvent):
    """vLLM 0.33's BlockRemoved."""

    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """vLLM 0.33's AllBlocksCleared: no field."""


class KVEventBatch(EventBatch):
    """vLLM 0.33's KVEventBatch."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
