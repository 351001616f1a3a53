"""KV cache events: what a medium (GPU, CPU, storage) stored and dropped.

The structs match vLLM 0.33's ``vllm.distributed.kv_events`` field for field
and in the same order, with the same msgspec options (batches encode as arrays,
events as maps tagged ``"type": <class name>``, None-defaults omitted), so a consumer
written for vLLM's event stream
decodes ours unchanged and vice versa.

Unlike vLLM's offloading events, ours are *self-describing*: every
``BlockStored`` carries its medium, block size, parent hash and (where known)
token ids, so a consumer replaying the stream always knows exactly which blocks
each medium holds and what they contain.

Block hashes travel in vLLM's default wire form, the low 64 bits of the digest
as an ``int`` (see :func:`to_external_hash`).
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "ExternalBlockHash",
    "KVCacheEvent",
    "KVEventBatch",
    "decode_event_batch",
    "encode_event_batch",
    "to_external_hash",
]

MEDIUM_GPU = "GPU"
"""``medium`` of events about the GPU KV cache (the engine's prefix cache)."""
MEDIUM_CPU = "CPU"
"""``medium`` of events about a CPU tier (the offload connector)."""
MEDIUM_STORAGE = "STORAGE"
"""``medium`` of events about storage behind the CPU tier."""

ExternalBlockHash = bytes | int
"""A block hash as it appears on the wire: raw digest bytes or its 64-bit int form."""


def to_external_hash(block_hash: bytes) -> int:
    """Return the wire form of a block hash: its last 8 bytes as a big-endian int.

    This is vLLM's default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), so event
    consumers that index vLLM's blocks index ours the same way.
    """
    return int.from_bytes(block_hash[-8:], "big")


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A timestamped batch of events, as published once per engine step."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of every KV cache event; encoded with its class name as the tag."""


class BlockStored(KVCacheEvent):
    """Blocks became available (cached) on ``medium``.

    Attributes:
        block_hashes: wire hashes of the stored blocks, in prefix order.
        parent_block_hash: wire hash of the block before the first one, or None
            at the start of a sequence.
        token_ids: token ids of the cached range (``block_size`` per block in it,
            null or already-cached blocks in the range included), or empty where the
            producer does not know them.
        block_size: tokens per block (never 0 in kvconnector's events).
        lora_id: deprecated, kept for vLLM compatibility; always None here.
        medium: "GPU", "CPU" or "STORAGE".
        lora_name: LoRA adapter name that is part of the hash, if any.
        extra_keys: extra hash keys, one entry per block (None where a block has none).
        group_idx: KV cache group the blocks belong to.
    """

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
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
    lookahead_token_ids: list[list[int]] | None = None

    def __hash__(self) -> int:
        # Hashable like vLLM's, so aggregators can count identical events from workers.
        return hash((
            tuple(self.block_hashes), self.parent_block_hash, tuple(self.token_ids),
            self.block_size,
            self.lora_id, self.medium, self.lora_name,
            tuple(self.extra_keys) if self.extra_keys else None, self.group_idx,
            self.kv_cache_spec_kind, self.kv_cache_spec_sliding_window,
        ))


class BlockRemoved(KVCacheEvent):
    """Blocks are no longer available on ``medium``."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None

    def __hash__(self) -> int:
        return hash((tuple(self.block_hashes), self.medium, self.group_idx))


class AllBlocksCleared(KVCacheEvent):
    """Every block of ``medium`` was dropped (a prefix cache reset, or a resync).

    Attributes:
        medium: the medium that was cleared ("GPU", "CPU", "STORAGE"), or None for
            every medium (the only meaning before the field existed). A clear of one
            medium followed by ``BlockStored`` events for what it holds is how a
            producer resyncs consumers after losing events (see
            ``KVConnectorBase_V1.get_event_snapshot``).

    ``medium`` is an optional trailing field, omitted from the wire when None, so
    vLLM 0.33's decoder (whose ``AllBlocksCleared`` has no field and ignores
    unknown ones) still reads every batch, and our decoder reads vLLM's.
    """

    medium: str | None = None


class KVEventBatch(EventBatch):
    """An :class:`EventBatch` whose events are KV cache events."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)

# Bound methods rather than wrapper functions: these run once per published
# batch, and a Python frame around the C call was the only cost ours had over
# vLLM's publisher (measured in benchmarks/compare_vllm.py).
encode_event_batch = _encoder.encode
"""Encode a :class:`KVEventBatch` to msgpack, exactly as vLLM's publisher puts it on the wire."""

decode_event_batch = _decoder.decode
"""Decode msgpack bytes (ours or vLLM's) into a :class:`KVEventBatch`.

Raises ``msgspec.ValidationError`` on bad input."""
