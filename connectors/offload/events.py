"""Offloading events -> self-describing wire KV events.

:class:`~connectors.offload.manager.OffloadingEvent` carries only keys (one per offloaded
chunk). The connector knows more about each key when it plans the store: the GPU block
hashes the chunk holds, the hash of the block before it and the token ids. This module
keeps that per key (:class:`ChunkInfo`, in a :class:`ChunkInfoTable`) and turns events
into :class:`~kvconnector_core.kv_events.BlockStored` / ``BlockRemoved`` at GPU block
granularity, so a consumer replaying the stream knows exactly which blocks the CPU tier
holds, with a real block size (never 0).

Primitives: ChunkInfo, ChunkInfoTable, to_wire_events.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from connectors.offload.manager import OffloadingEvent
from connectors.offload.policies import OffloadKey
from kvconnector_core.kv_events import BlockRemoved, BlockStored, KVCacheEvent, to_external_hash

__all__ = ["ChunkInfo", "ChunkInfoTable", "to_wire_events"]


@dataclass(slots=True)
class ChunkInfo:
    """What the wire needs to know about one offloaded chunk.

    Attributes:
        block_hashes: hashes of the GPU blocks the chunk holds, in prefix order.
        parent_block_hash: hash of the GPU block before the chunk (None at the start).
        token_ids: the chunk's tokens (dropped once the stored event is emitted).
        lora_name: LoRA adapter that is part of the hashes, if any.
    """

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: list[int] | None
    lora_name: str | None = None


class ChunkInfoTable:
    """Per-key chunk information, kept while the key is stored or being stored."""

    def __init__(self) -> None:
        self._info: dict[OffloadKey, ChunkInfo] = {}

    def add(self, key: OffloadKey, info: ChunkInfo) -> None:
        """Remember ``info`` for ``key`` (a store was planned)."""
        self._info[key] = info

    def discard(self, keys: Iterable[OffloadKey]) -> None:
        """Forget keys whose store failed (they never appeared on the wire)."""
        for key in keys:
            self._info.pop(key, None)

    def __len__(self) -> int:
        return len(self._info)

    def stored(self, key: OffloadKey) -> ChunkInfo | None:
        """Info for a stored event; the token ids are released afterwards."""
        info = self._info.get(key)
        if info is None:
            return None
        out = ChunkInfo(info.block_hashes, info.parent_block_hash, info.token_ids, info.lora_name)
        info.token_ids = None  # only needed once; keep the hashes for the removal
        return out

    def removed(self, key: OffloadKey) -> ChunkInfo | None:
        """Info for a removal event; the key is forgotten."""
        return self._info.pop(key, None)


def to_wire_events(events: Iterable[OffloadingEvent], table: ChunkInfoTable,
                   block_size: int, *, group_idx: int = 0) -> list[KVCacheEvent]:
    """Translate offloading events into wire events.

    Args:
        events: what the offloading manager recorded, in order.
        table: chunk information recorded when the stores were planned.
        block_size: tokens per GPU block (the unit of ``block_hashes`` on the wire).
        group_idx: KV cache group of the blocks.

    Returns:
        One ``BlockStored`` per stored chunk (its GPU blocks, parent hash and tokens)
        and one ``BlockRemoved`` per removal event, in order. A key the table does not
        know (never expected) is sent as its own hash, with no tokens.
    """
    out: list[KVCacheEvent] = []
    for event in events:
        if event.removed:
            hashes: list[int] = []
            for key in event.keys:
                info = table.removed(key)
                hashes += ([to_external_hash(h) for h in info.block_hashes] if info
                           else [to_external_hash(key)])
            out.append(BlockRemoved(block_hashes=hashes, medium=event.medium, group_idx=group_idx))
            continue
        for key in event.keys:
            info = table.stored(key)
            if info is None:
                out.append(BlockStored(block_hashes=[to_external_hash(key)], parent_block_hash=None,
                                       token_ids=[], block_size=block_size, lora_id=None,
                                       medium=event.medium, lora_name=None, group_idx=group_idx))
                continue
            parent = info.parent_block_hash
            out.append(BlockStored(
                block_hashes=[to_external_hash(h) for h in info.block_hashes],
                parent_block_hash=to_external_hash(parent) if parent is not None else None,
                token_ids=list(info.token_ids or ()),
                block_size=block_size,
                lora_id=None,
                medium=event.medium,
                lora_name=info.lora_name,
                group_idx=group_idx,
            ))
    return out
