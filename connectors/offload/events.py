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

After lost events (the connector's ``take_events`` raised after draining the tier's
events) :func:`snapshot_events` resyncs consumers: a clear of the medium, then one
``BlockStored`` per ready chunk's blocks, and the table's counts rebuilt to match, so
later events continue from the snapshot. Token ids are kept (compactly) for every held
chunk so that a snapshot is as self-describing as the events it replaces.

Primitives: ChunkInfo, ChunkInfoTable, to_wire_events, snapshot_events,
snapshot_grouped_events (one table per KV cache group), GroupedEvents (the tables and
wire events of a tier keyed per group).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from connectors.offload.manager import OffloadingEvent, OffloadingManager, OffloadKey
from kvconnector_core.kv_cache.hashing import BlockHash
from kvconnector_core.kv_events import (
    MEDIUM_CPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    to_external_hash,
)

__all__ = [
    "ChunkInfo",
    "ChunkInfoTable",
    "GroupedEvents",
    "snapshot_events",
    "snapshot_grouped_events",
    "to_wire_events",
]


@dataclass(slots=True)
class ChunkInfo:
    """What the wire needs to know about one offloaded chunk.

    Attributes:
        block_hashes: hashes of the GPU blocks the chunk holds, in prefix order.
        parent_block_hash: hash of the GPU block before the chunk (None at the start).
        token_ids: the chunk's tokens (None where unknown).
        lora_name: LoRA adapter that is part of the hashes, if any.
    """

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: Sequence[int] | None
    lora_name: str | None = None


class ChunkInfoTable:
    """Per-key chunk information, kept while the key is stored or being stored."""

    def __init__(self) -> None:
        self._info: dict[OffloadKey, ChunkInfo] = {}
        self._refs: dict[bytes, int] = {}  # GPU block hash -> held chunks holding it
        self._announced: set[OffloadKey] = set()  # keys whose stored event went out

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
        """Remember ``info`` for ``key`` (a store was planned).

        The token ids are kept as a machine-int array (8 bytes a token rather than a
        list's pointer plus int object): a snapshot may need them as long as the
        chunk is held.
        """
        if info.token_ids is not None and not isinstance(info.token_ids, array):
            info.token_ids = array("q", info.token_ids)
        self._info[key] = info
        # A store of a key that still counts as announced means its removal event was lost.
        self._announced.discard(key)

    def discard(self, keys: Iterable[OffloadKey]) -> None:
        """Forget keys whose store failed (they never appeared on the wire)."""
        for key in keys:
            self._info.pop(key, None)
            self._announced.discard(key)

    def __len__(self) -> int:
        return len(self._info)

    def get(self, key: OffloadKey) -> ChunkInfo | None:
        """Info of a stored or planned key, left in place (None if unknown)."""
        return self._info.get(key)

    def stored(self, key: OffloadKey) -> ChunkInfo | None:
        """Info for a stored event (None for a key never added); the key counts as announced."""
        info = self._info.get(key)
        if info is not None:
            self._announced.add(key)
        return info

    def removed(self, key: OffloadKey) -> ChunkInfo | None:
        """Info for a removal event; the key is forgotten."""
        self._announced.discard(key)
        return self._info.pop(key, None)

    def restart(self, ready: Iterable[OffloadKey]) -> None:
        """Forget every count, before a snapshot re-announces the ``ready`` keys.

        Info is kept for the ready keys and for keys never announced (stores still in
        flight, whose stored event is yet to come); an announced key that is no longer
        ready was removed by an event that was lost, so its info goes.
        """
        keep = set(ready)
        self._info = {k: v for k, v in self._info.items() if k in keep or k not in self._announced}
        self._announced.clear()
        self._refs.clear()


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
            stored = _announce(key, table, block_size, event.medium, group_idx)
            if stored is not None:
                out.append(stored)
    return out


def _announce(key: OffloadKey, table: ChunkInfoTable, block_size: int, medium: str,
              group_idx: int) -> BlockStored | None:
    """The stored event of one chunk: its GPU blocks no other held chunk announced (None if
    none)."""
    info = table.stored(key)
    if info is None:
        if not table.hold((key,)):
            return None
        return BlockStored(block_hashes=[to_external_hash(key)], parent_block_hash=None,
                           token_ids=[], block_size=block_size, lora_id=None, medium=medium,
                           lora_name=None, group_idx=group_idx)
    new = table.hold(info.block_hashes)
    if not new:
        return None
    # Held positions of a chunk are a prefix (the hashes are chained), so the new
    # ones are its tail: its parent is the block before the first new one.
    first = new[0]
    parent = info.block_hashes[first - 1] if first else info.parent_block_hash
    tokens = info.token_ids if info.token_ids is not None else ()
    return BlockStored(
        block_hashes=[to_external_hash(info.block_hashes[i]) for i in new],
        parent_block_hash=to_external_hash(parent) if parent is not None else None,
        token_ids=[t for i in new for t in tokens[i * block_size:(i + 1) * block_size]],
        block_size=block_size,
        lora_id=None,
        medium=medium,
        lora_name=info.lora_name,
        group_idx=group_idx,
    )


def snapshot_events(manager: OffloadingManager, table: ChunkInfoTable, block_size: int, *,
                    medium: str = MEDIUM_CPU, group_idx: int = 0) -> list[KVCacheEvent]:
    """Resync consumers with what the tier holds now, after events were lost (one KV
    cache group; see :func:`snapshot_grouped_events`, which this calls).

    Args:
        manager: the tier; it must implement ``ready_keys``.
        table: chunk information recorded when the stores were planned.
        block_size: tokens per GPU block.
        medium: the tier's medium.
        group_idx: KV cache group of the blocks.

    Returns:
        ``AllBlocksCleared(medium=medium)``, then per ready chunk one ``BlockStored``
        for its GPU blocks not already in the snapshot.

    Raises:
        NotImplementedError: the manager cannot list its keys; nothing was changed,
            so the snapshot can be retried.
    """
    return snapshot_grouped_events(manager, {group_idx: (table, block_size)},
                                   lambda _key: group_idx, medium=medium)


def snapshot_grouped_events(manager: OffloadingManager,
                            tables: Mapping[int, tuple[ChunkInfoTable, int]],
                            group_of: Callable[[OffloadKey], int], *,
                            medium: str = MEDIUM_CPU) -> list[KVCacheEvent]:
    """Resync consumers with what the tier holds now, after events were lost, for a tier
    whose keys belong to several KV cache groups.

    The snapshot supersedes every event the manager recorded and the caller has not
    returned yet: the manager's pending events are drained and dropped here, and the
    caller must drop the wire events it still holds (translated, not yet returned).
    Each group's table has its counts rebuilt so that later :func:`to_wire_events`
    calls continue from the snapshot's state. Call it only with events enabled (the
    tables are filled only then).

    Args:
        manager: the tier; it must implement ``ready_keys``.
        tables: per group index, the group's chunk information and its tokens per GPU block.
        group_of: the group index of a key (every ready key's group must be in ``tables``).
        medium: the tier's medium.

    Returns:
        ``AllBlocksCleared(medium=medium)``, then per group and ready chunk one
        ``BlockStored`` (with the group's index and block size) for its GPU blocks not
        already in the snapshot (parent hash, token ids and LoRA name as in normal
        events). A consumer applying it holds exactly the tier's ready blocks.

    Raises:
        NotImplementedError: the manager cannot list its keys; nothing was changed,
            so the snapshot can be retried.
    """
    ready = manager.ready_keys()  # first: if it raises, nothing has changed
    manager.take_events()  # superseded by the snapshot
    by_group: dict[int, list[OffloadKey]] = {g: [] for g in tables}
    for key in ready:
        by_group[group_of(key)].append(key)
    out: list[KVCacheEvent] = [AllBlocksCleared(medium=medium)]
    for g, (table, block_size) in tables.items():
        table.restart(by_group[g])
        for key in by_group[g]:
            stored = _announce(key, table, block_size, medium, g)
            if stored is not None:
                out.append(stored)
    return out


class GroupedEvents:
    """Wire events of a tier whose keys belong to KV cache groups (a key ends with its
    group index as 4 big-endian bytes): one :class:`ChunkInfoTable` per group, events
    translated per group (its index and block size) as the manager records them.

    Args:
        block_sizes: per group, tokens per GPU block.
        enabled: events on; off, nothing is kept or translated.
    """

    def __init__(self, block_sizes: Sequence[int], *, enabled: bool) -> None:
        self.enabled = enabled
        self.block_sizes = list(block_sizes)
        self.tables = [ChunkInfoTable() for _ in self.block_sizes]
        """Per group: what its wire events need, per stored key."""
        self._wire: list[KVCacheEvent] = []

    @staticmethod
    def group_of(key: OffloadKey) -> int:
        """The group index a key ends with."""
        return int.from_bytes(key[-4:], "big")

    def add(self, key: OffloadKey, info: ChunkInfo) -> None:
        """Remember a planned store's chunk (nothing with events off)."""
        if self.enabled:
            self.tables[self.group_of(key)].add(key, info)

    def discard(self, keys: Iterable[OffloadKey]) -> None:
        """Forget keys whose store failed (they never appeared on the wire)."""
        for key in keys:
            self.tables[self.group_of(key)].discard((key,))

    def translate(self, manager: OffloadingManager) -> None:
        """Turn the manager's events into wire events now, while the chunk info is current."""
        if not self.enabled:
            return
        for event in manager.take_events():
            by_group: dict[int, list[OffloadKey]] = {}
            for key in event.keys:
                by_group.setdefault(self.group_of(key), []).append(key)
            for g, keys in by_group.items():
                part = OffloadingEvent(tuple(keys), event.medium, event.removed)
                self._wire += to_wire_events([part], self.tables[g], self.block_sizes[g],
                                             group_idx=g)

    def take(self, manager: OffloadingManager) -> list[KVCacheEvent]:
        """Every wire event not yet returned (the manager's pending ones translated first)."""
        if not self.enabled:
            return []  # nothing is kept with events off
        self.translate(manager)
        events, self._wire = self._wire, []
        return events

    def snapshot(self, manager: OffloadingManager) -> list[KVCacheEvent]:
        """:func:`snapshot_grouped_events` over every group; it supersedes every event not
        yet returned. Nothing with events off."""
        if not self.enabled:
            return []
        tables = {g: (table, self.block_sizes[g]) for g, table in enumerate(self.tables)}
        events = snapshot_grouped_events(manager, tables, self.group_of)
        self._wire = []  # superseded by the snapshot
        return events
