"""Offloading events -> self-describing wire KV events.

:class:`~connectors.offload.manager.OffloadingEvent` carries only keys (one per offloaded
chunk). The connector knows more about each key when it plans the store: the GPU block
hashes the chunk holds, the hash of the block before it and the token ids. This module
keeps that per key (:class:`ChunkInfo`, in a :class:`ChunkInfoTable`) and turns events
into :class:`~kvconnector_core.kv_events.BlockStored` / ``BlockRemoved`` at GPU block
granularity, so a consumer replaying the stream knows exactly which blocks the CPU tier
holds, with a real block size (never 0).

With ``blocks_per_chunk > 1`` two chunks can hold the same GPU block (two prompts that
diverge inside a chunk share its leading blocks). The table therefore counts, per GPU
block hash, the held chunks holding it: a hash is announced only when its count goes
0 -> 1 and removed only when it goes 1 -> 0, so a consumer replaying the stream as a
set is exact.

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
        self._refs: dict[bytes, int] = {}  # GPU block hash -> held chunks holding it

    def hold(self, hashes: Iterable[bytes]) -> list[int]:
        """Count one more held chunk for each hash; return the positions that went 0 -> 1."""
        new = []
        for i, h in enumerate(hashes):
            count = self._refs.get(h, 0)
            self._refs[h] = count + 1
            if count == 0:
                new.append(i)
        return new

    def release(self, hashes: Iterable[bytes]) -> list[bytes]:
        """Count one held chunk less for each hash; return the hashes that went 1 -> 0."""
        gone = []
        for h in hashes:
            count = self._refs.get(h, 0)
            if count <= 1:
                self._refs.pop(h, None)
                if count == 1:
                    gone.append(h)
            else:
                self._refs[h] = count - 1
        return gone

    @property
    def num_held_hashes(self) -> int:
        """GPU block hashes the stream has announced and not removed."""
        return len(self._refs)

    def add(self, key: OffloadKey, info: ChunkInfo) -> None:
        """Remember ``info`` for ``key`` (a store was planned)."""
        self._info[key] = info

    def discard(self, keys: Iterable[OffloadKey]) -> None:
        """Forget keys whose store failed (they never appeared on the wire)."""
        for key in keys:
            self._info.pop(key, None)

    def __len__(self) -> int:
        return len(self._info)

    def get(self, key: OffloadKey) -> ChunkInfo | None:
        """Info of a stored or planned key, left in place (None if unknown)."""
        return self._info.get(key)

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
        Per stored chunk, one ``BlockStored`` with the GPU blocks no other held chunk
        already announced (their parent hash and tokens; none when all were), and one
        ``BlockRemoved`` per removal event listing the hashes no held chunk holds any
        more (none when empty), in order. A key the table does not know (never
        expected) is sent as its own hash, with no tokens.
    """
    out: list[KVCacheEvent] = []
    for event in events:
        if event.removed:
            gone: list[bytes] = []
            for key in event.keys:
                info = table.removed(key)
                gone += table.release(info.block_hashes if info else (key,))
            if gone:
                out.append(BlockRemoved(block_hashes=[to_external_hash(h) for h in gone],
                                        medium=event.medium, group_idx=group_idx))
            continue
        for key in event.keys:
            info = table.stored(key)
            if info is None:
                if table.hold((key,)):
                    out.append(BlockStored(block_hashes=[to_external_hash(key)], parent_block_hash=None,
                                           token_ids=[], block_size=block_size, lora_id=None,
                                           medium=event.medium, lora_name=None, group_idx=group_idx))
                continue
            new = table.hold(info.block_hashes)
            if not new:
                continue
            # Held positions of a chunk are a prefix (the hashes are chained), so the new
            # ones are its tail: its parent is the block before the first new one.
            first = new[0]
            parent = info.block_hashes[first - 1] if first else info.parent_block_hash
            tokens = info.token_ids or []
            out.append(BlockStored(
                block_hashes=[to_external_hash(info.block_hashes[i]) for i in new],
                parent_block_hash=to_external_hash(parent) if parent is not None else None,
                token_ids=[t for i in new for t in tokens[i * block_size:(i + 1) * block_size]],
                block_size=block_size,
                lora_id=None,
                medium=event.medium,
                lora_name=info.lora_name,
                group_idx=group_idx,
            ))
    return out
