"""Offload wire events after lost takes: snapshot_events resyncs a replica exactly."""

from __future__ import annotations

import random
from collections.abc import Iterable

import pytest

from connectors.offload.events import ChunkInfo, ChunkInfoTable, snapshot_events, to_wire_events
from connectors.offload.manager import CPUOffloadingManager, OffloadingEvent, OffloadingManager
from kvconnector_core.engine.engine import Engine, EngineConfig
from kvconnector_core.engine.workloads import TraceRequest
from kvconnector_core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, to_external_hash

BLOCK_SIZE = 4
PER_CHUNK = 2  # GPU blocks per chunk: chunks of diverging prompts share their first block


class Replica:
    """A consumer of the stream: per medium, the set of wire hashes it believes is held."""

    def __init__(self) -> None:
        self.media: dict[str | None, set[int]] = {}

    def apply(self, events: Iterable[object]) -> None:
        for ev in events:
            if isinstance(ev, AllBlocksCleared):
                if ev.medium is None:
                    self.media.clear()
                else:
                    self.media.pop(ev.medium, None)
            elif isinstance(ev, BlockStored):
                assert len(ev.token_ids) in (0, ev.block_size * len(ev.block_hashes))
                self.media.setdefault(ev.medium, set()).update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                self.media.setdefault(ev.medium, set()).difference_update(ev.block_hashes)
            else:
                raise AssertionError(f"unexpected event {ev!r}")

    def held(self, medium: str) -> set[int]:
        return self.media.get(medium, set())


def chunk(rng: random.Random, prefixes: list[bytes]) -> tuple[bytes, ChunkInfo]:
    """A chunk of PER_CHUNK GPU blocks; it reuses a known first block half the time."""
    first = rng.choice(prefixes) if prefixes and rng.random() < 0.5 else rng.randbytes(32)
    prefixes.append(first)
    hashes = (first, *(rng.randbytes(32) for _ in range(PER_CHUNK - 1)))
    tokens = [rng.randrange(1000) for _ in range(PER_CHUNK * BLOCK_SIZE)]
    return hashes[-1], ChunkInfo(hashes, None, tokens)


def expected(manager: CPUOffloadingManager, infos: dict[bytes, ChunkInfo]) -> set[int]:
    return {to_external_hash(h) for key in manager.ready_keys() for h in infos[key].block_hashes}


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("seed", range(4))
def test_replica_is_exact_after_every_resync(policy: str, seed: int) -> None:
    """Random stores, failures, loads and evictions; a third of the takes lose their events
    (translated or not yet) and are answered with a snapshot instead. After every take the replica
    equals the tier,
    while a consumer that just missed the lost events goes wrong (so losses matter here)."""
    rng = random.Random(seed)
    manager = CPUOffloadingManager(6, policy, enable_events=True)
    table = ChunkInfoTable()
    infos: dict[bytes, ChunkInfo] = {}
    prefixes: list[bytes] = []
    in_flight: list[bytes] = []
    pinned: list[bytes] = []
    replica, naive = Replica(), Replica()
    resyncs = naive_wrong = 0
    for _ in range(300):
        op = rng.random()
        if op < 0.4:
            new = [chunk(rng, prefixes) for _ in range(rng.randrange(1, 3))]
            out = manager.prepare_store([k for k, _ in new])
            if out is not None:
                for key, info in new:
                    if key in out.keys_to_store:
                        infos[key] = info
                        table.add(key, ChunkInfo(info.block_hashes, None, list(info.token_ids)))
                in_flight += out.keys_to_store
        elif op < 0.7 and in_flight:
            key = in_flight.pop(rng.randrange(len(in_flight)))
            ok = rng.random() < 0.8
            manager.complete_store([key], success=ok)
            if not ok:
                table.discard([key])
        elif op < 0.8:
            ready = manager.ready_keys()
            if ready:
                key = rng.choice(ready)
                manager.prepare_load([key])
                pinned.append(key)
        elif pinned:
            manager.complete_load([pinned.pop(rng.randrange(len(pinned)))])
        # A take may be lost after the manager's events were translated, or before.
        lost = rng.random() < 0.3
        if not (lost and rng.random() < 0.5):
            events = to_wire_events(manager.take_events(), table, BLOCK_SIZE)
        if lost:
            resyncs += 1
            events = snapshot_events(manager, table, BLOCK_SIZE)
            assert isinstance(events[0], AllBlocksCleared) and events[0].medium == "CPU"
        else:
            naive.apply(events)
        replica.apply(events)
        assert replica.held("CPU") == expected(manager, infos)
        naive_wrong += naive.held("CPU") != expected(manager, infos)
    assert resyncs > 0 and naive_wrong > 0


def test_snapshot_is_self_describing_and_announces_shared_blocks_once() -> None:
    """Two ready chunks sharing a first block: the snapshot names it once, with tokens and
    parents."""
    manager = CPUOffloadingManager(4, enable_events=True)
    table = ChunkInfoTable()
    a, b, c = (bytes([i]) * 32 for i in (1, 2, 3))
    table.add(b, ChunkInfo((a, b), None, list(range(8)), "lora"))
    table.add(c, ChunkInfo((a, c), None, list(range(4)) + [9] * 4, "lora"))
    manager.prepare_store([b, c])
    manager.complete_store([b, c])
    events = snapshot_events(manager, table, BLOCK_SIZE)
    assert events[0] == AllBlocksCleared(medium="CPU")
    first, second = events[1:]
    assert first.block_hashes == [to_external_hash(a), to_external_hash(b)]
    assert first.token_ids == list(range(8)) and first.parent_block_hash is None
    assert second.block_hashes == [to_external_hash(c)]
    assert second.parent_block_hash == to_external_hash(a) and second.token_ids == [9] * 4
    assert all(
        e.lora_name == "lora" and e.block_size == BLOCK_SIZE and e.medium == "CPU"
        for e in events[1:]
    )
    # The stores' own events were superseded; later events continue from the snapshot.
    assert to_wire_events(manager.take_events(), table, BLOCK_SIZE) == []
    manager.reset_cache()
    (removed,) = to_wire_events(manager.take_events(), table, BLOCK_SIZE)
    assert set(removed.block_hashes) == {to_external_hash(h) for h in (a, b, c)}


def test_snapshot_keeps_info_of_stores_in_flight_and_drops_lost_removals() -> None:
    """A store still being written is announced by its own event after the snapshot; a key
    whose removal event was lost is forgotten (no leak in the table)."""
    manager = CPUOffloadingManager(1, enable_events=True)
    table = ChunkInfoTable()
    old, new = b"\x01" * 32, b"\x02" * 32
    table.add(old, ChunkInfo((old,), None, [1] * BLOCK_SIZE))
    manager.prepare_store([old])
    manager.complete_store([old])
    to_wire_events(manager.take_events(), table, BLOCK_SIZE)
    table.add(new, ChunkInfo((new,), None, [2] * BLOCK_SIZE))
    manager.prepare_store([new])  # evicts old; that removal event is then lost
    assert snapshot_events(manager, table, BLOCK_SIZE) == [AllBlocksCleared(medium="CPU")]
    assert len(table) == 1 and table.num_held_hashes == 0
    manager.complete_store([new])
    (stored,) = to_wire_events(manager.take_events(), table, BLOCK_SIZE)
    assert stored.block_hashes == [to_external_hash(new)] and stored.token_ids == [2] * BLOCK_SIZE


def test_key_stored_again_after_a_lost_removal_keeps_its_info_through_a_snapshot() -> None:
    """Evicted (removal lost), stored again and still in flight at the snapshot: its stored
    event later still carries its GPU blocks and tokens."""
    manager = CPUOffloadingManager(1, enable_events=True)
    table = ChunkInfoTable()
    key, other = b"\x01" * 32, b"\x02" * 32
    table.add(key, ChunkInfo((b"\x09" * 32, key), None, [1] * 2 * BLOCK_SIZE))
    manager.prepare_store([key])
    manager.complete_store([key])
    to_wire_events(manager.take_events(), table, BLOCK_SIZE)  # key announced
    table.add(other, ChunkInfo((b"\x08" * 32, other), None, [2] * 2 * BLOCK_SIZE))
    manager.prepare_store([other])  # evicts key
    manager.complete_store([other])
    manager.take_events()  # lost: key's removal and other's store
    table.add(key, ChunkInfo((b"\x09" * 32, key), None, [3] * 2 * BLOCK_SIZE))
    manager.prepare_store([key])  # evicts other (lost too); key is in flight at the snapshot
    manager.take_events()
    assert snapshot_events(manager, table, BLOCK_SIZE) == [AllBlocksCleared(medium="CPU")]
    manager.complete_store([key])
    (stored,) = to_wire_events(manager.take_events(), table, BLOCK_SIZE)
    assert stored.block_hashes == [to_external_hash(b"\x09" * 32), to_external_hash(key)]
    assert stored.token_ids == [3] * 2 * BLOCK_SIZE


def test_snapshot_of_a_manager_without_ready_keys_changes_nothing() -> None:
    """A manager that cannot list its keys: NotImplementedError naming it, events left for a
    retry."""

    class Opaque(OffloadingManager):
        def __init__(self) -> None:
            self.events = ["pending"]

        def lookup(self, keys):  # noqa: ANN001, ANN201
            return 0

        def prepare_load(self, keys):  # noqa: ANN001, ANN201
            raise AssertionError

        def prepare_store(self, keys):  # noqa: ANN001, ANN201
            return None

        def complete_store(self, keys, success=True):  # noqa: ANN001, ANN201
            pass

        def take_events(self):  # noqa: ANN201
            events, self.events = self.events, []
            return events

    manager = Opaque()
    with pytest.raises(NotImplementedError, match="Opaque does not implement ready_keys"):
        snapshot_events(manager, ChunkInfoTable(), BLOCK_SIZE)
    assert manager.events == ["pending"]


def doc_trace(seed: int, num_docs: int, doc_len: int, num_requests: int) -> list[TraceRequest]:
    """Requests that share a few document prefixes, each with its own short tail."""
    rng = random.Random(seed)
    docs = [[rng.randrange(1000) for _ in range(doc_len)] for _ in range(num_docs)]
    return [
        TraceRequest(
            request_id=f"r{i}",
            arrival=i * 3,
            max_new_tokens=4,
            prompt_token_ids=docs[i % num_docs]
            + [rng.randrange(1000) for _ in range(rng.randrange(1, 20))],
        )
        for i in range(num_requests)
    ]


def lose_every_third_take(conn, apply) -> list[int]:  # noqa: ANN001
    """Every third take of ``conn`` that has events loses them and returns the snapshot
    instead (what the guard sends after a failed take); ``apply`` sees what is returned.
    Returns a one-item list counting the resyncs."""
    take = conn.take_events
    calls, resyncs = [0], [0]

    def lossy_take() -> list:
        calls[0] += 1
        events = take()
        if calls[0] % 3 == 0 and events:
            resyncs[0] += 1
            events = list(conn.get_event_snapshot())
        apply(events)
        return events

    conn.take_events = lossy_take
    return resyncs


def test_engine_replica_with_lost_takes_ends_exact() -> None:
    """cpu_offload in the engine; every third take drains and loses its events and is
    answered with the snapshot (as the guard does). The replica ends equal to the tier."""
    eng = Engine(
        EngineConfig(
            num_gpu_blocks=24,
            block_size=16,
            max_model_len=256,
            max_num_batched_tokens=128,
            max_num_seqs=2,
            connector={
                "name": "cpu_offload",
                "extra_config": {"num_cpu_blocks": 6, "blocks_per_chunk": 2},
            },
            enable_kv_cache_events=True,
        )
    )
    conn = eng.scheduler_connector
    replica = Replica()
    resyncs = lose_every_third_take(conn, replica.apply)
    result = eng.run(doc_trace(7, 5, 80, 20))
    assert result.metrics.bytes_stored > 0 and resyncs[0] > 0
    info = conn.scheduler_side.state.events.tables[0]._info
    assert replica.held("CPU") == {
        to_external_hash(h) for k in conn.manager.ready_keys() for h in info[k].block_hashes
    }
    eng.shutdown()


@pytest.mark.parametrize("model", ["tiny-hybrid", "tiny-two-windows"])
def test_hybrid_snapshot_resyncs_every_group(model: str) -> None:
    """Several KV cache groups: the snapshot announces each group's blocks with its group
    index, so a replica per (medium, group) that loses every third take ends equal to
    the tier, group by group."""
    from kvconnector_core.engine.models import get_model

    # 24 chunks: a 128-token step stores 8 chunks per group (windowed groups store every
    # chunk they computed), so the tier takes a step's store and still evicts.
    eng = Engine(
        EngineConfig(
            model=get_model(model),
            num_gpu_blocks=64,
            block_size=16,
            max_model_len=256,
            max_num_batched_tokens=128,
            max_num_seqs=2,
            connector={"name": "cpu_offload", "extra_config": {"num_cpu_blocks": 24}},
            enable_kv_cache_events=True,
        )
    )
    conn = eng.scheduler_connector
    held: dict[int, set[int]] = {}

    def apply(events: list) -> None:
        for ev in events:
            if isinstance(ev, AllBlocksCleared) and ev.medium == "CPU":
                held.clear()
            elif isinstance(ev, BlockStored) and ev.medium == "CPU":
                held.setdefault(ev.group_idx, set()).update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved) and ev.medium == "CPU":
                held.setdefault(ev.group_idx, set()).difference_update(ev.block_hashes)

    resyncs = lose_every_third_take(conn, apply)
    result = eng.run(doc_trace(11, 4, 160, 16))
    tables = conn.scheduler_side.state.events.tables
    assert result.metrics.bytes_stored > 0 and resyncs[0] > 0
    want: dict[int, set[int]] = {}
    for key in conn.manager.ready_keys():
        g = int.from_bytes(key[-4:], "big")
        want.setdefault(g, set()).update(
            to_external_hash(h) for h in tables[g]._info[key].block_hashes
        )
    assert len(want) == 2
    assert {g: s for g, s in held.items() if s} == want
    eng.shutdown()


def test_a_chunk_new_from_its_first_block_names_the_chunks_parent():
    """A chunk whose first GPU block is new names the block before the chunk as parent."""
    table = ChunkInfoTable()
    parent, h0, h1 = b"p" * 32, b"a" * 32, b"b" * 32
    table.add(h1, ChunkInfo((h0, h1), parent, list(range(8))))
    (ev,) = to_wire_events([OffloadingEvent((h1,), "CPU", False)], table, BLOCK_SIZE)
    assert ev.parent_block_hash == to_external_hash(parent)
    assert ev.block_hashes == [to_external_hash(h0), to_external_hash(h1)]


def test_a_chunk_without_info_is_announced_once_as_its_own_hash():
    """A stored key the table knows nothing about is sent as its own hash with no tokens,
    once; its removal is sent once too."""
    table = ChunkInfoTable()
    key = b"k" * 32
    (ev,) = to_wire_events([OffloadingEvent((key,), "CPU", False)], table, BLOCK_SIZE)
    assert ev.block_hashes == [to_external_hash(key)] and ev.token_ids == []
    (gone,) = to_wire_events([OffloadingEvent((key,), "CPU", True)], table, BLOCK_SIZE)
    assert gone.block_hashes == [to_external_hash(key)]


def test_removing_a_key_never_announced_sends_nothing():
    """A removal of a key whose stored event never went out is no event (a replica never
    heard of it)."""
    table = ChunkInfoTable()
    assert to_wire_events([OffloadingEvent((b"x" * 32,), "CPU", True)], table, BLOCK_SIZE) == []
