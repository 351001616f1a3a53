"""The offload connector's tier cascade helpers: lookups across tiers, CPU buffer <-> tier."""

from __future__ import annotations

import time

import pytest
import torch

from connectors.offload.manager import CPUOffloadingManager
from connectors.offload.records import TierRead, TierWrite
from connectors.offload.tiers import DiskTier, TierKey
from connectors.offload.tiers.base import make_tiers
from connectors.offload.tiers.records import tier_key
from connectors.offload.tiers.scheduler import SchedulerTiers, TierLookups
from connectors.offload.tiers.worker import WorkerTiers
from kvconnector_core.errors import ConfigError
from kvconnector_core.kv_events import BlockStored, to_external_hash


def _disk(tmp_path, name):
    return DiskTier({"path": str(tmp_path / name), "capacity_bytes": 1 << 20})


def _keys(n, group=0):
    """Offload keys: a chained hash, then the KV cache group (4 bytes, big-endian)."""
    return [bytes([i]) * 32 + group.to_bytes(4, "big") for i in range(n)]


def _poll(fn, timeout=30.0):
    deadline = time.monotonic() + timeout
    while (out := fn()) is None or out == []:
        assert time.monotonic() < deadline, "no answer"
        time.sleep(0.001)
    return out


def test_lookups_go_tier_by_tier_per_key_and_ask_again(tmp_path):
    first, second = _disk(tmp_path, "a"), _disk(tmp_path, "b")
    keys = _keys(6)
    first.store([(tier_key(k), b"x") for k in keys[1:3]])
    second.store([(tier_key(k), b"x") for k in keys[3:4]])
    first.flush(30)
    second.flush(30)
    second.store([(tier_key(keys[5]), b"x")])  # after a gap: a sliding window may need it
    first.flush(30)
    second.flush(30)
    lookups = TierLookups([first, second])
    assert lookups.sources("r", keys) is None  # the first tier's I/O is running
    # per key: tier 0 serves keys 1-2, tier 1 keys 3 and 5, keys 0 and 4 are nowhere
    expected = [None, 0, 0, 1, None, 1]
    assert _poll(lambda: lookups.sources("r", keys)) == expected
    assert lookups.sources("r", keys) == expected  # kept until forgotten
    assert lookups.answered("r") == {keys[1]: 0, keys[2]: 0, keys[3]: 1, keys[5]: 1}
    lookups.forget("r")
    assert lookups.sources("r", keys) is None
    lookups.close()


def test_worker_moves_chunks_between_cpu_buffer_and_tier(tmp_path):
    tier = _disk(tmp_path, "t")
    planes = (torch.arange(8 * 4, dtype=torch.uint8).view(8, 4),
              torch.arange(100, 100 + 8 * 3, dtype=torch.uint8).view(8, 3))
    worker = WorkerTiers([tier], block_sizes=[16])
    worker.bind_buffer(planes)
    key = _keys(1)[0]
    chunk = [p[2:4].clone() for p in planes]
    worker.write([TierWrite(key, [2, 3], [b"h" * 32, key], None)])
    tier.flush(30)
    for p in planes:
        p.zero_()
    worker.start_reads(7, [TierRead(0, key, [5, 6])])
    assert _poll(worker.finished_reads) == [(7, True)]
    assert all(torch.equal(p[5:7], c) for p, c in zip(planes, chunk, strict=True))
    events = worker.take_events()
    assert events == [BlockStored(block_hashes=[to_external_hash(b"h" * 32), to_external_hash(key)],
                                  parent_block_hash=None, token_ids=[], block_size=16, lora_id=None,
                                  medium="DISK", lora_name=None, group_idx=0)]
    assert worker.stats()["disk_stores"] == 1
    assert "disk_stores" not in worker.stats()  # deltas: nothing new since the last call
    worker.close()


def test_tier_keys_carry_the_kv_cache_group(tmp_path):
    """A chunk of group 3 is stored under its hash and group 3: only group 3's key finds
    it, and its tier event names group 3."""
    tier = _disk(tmp_path, "t")
    worker = WorkerTiers([tier], block_sizes=[16])
    worker.bind_buffer((torch.ones(4, 8, dtype=torch.uint8),))
    key = _keys(1, group=3)[0]
    assert tier_key(key) == TierKey(bytes(32), 3)
    worker.write([TierWrite(key, [0], [b"h" * 32], None)])
    tier.flush(30)
    lookups = TierLookups([tier])
    assert _poll(lambda: lookups.sources("a", [key])) == [0]
    assert _poll(lambda: lookups.sources("b", _keys(1, group=0))) == [None]
    assert [e.group_idx for e in worker.take_events()] == [3]
    lookups.close()
    worker.close()


def test_a_missing_or_damaged_chunk_fails_the_whole_read_job(tmp_path):
    tier = _disk(tmp_path, "t")
    plane = torch.zeros(4, 8, dtype=torch.uint8)
    worker = WorkerTiers([tier])
    worker.bind_buffer((plane,))
    keys = _keys(2)
    tier.store([(tier_key(keys[0]), bytes(8))])
    tier.store([(tier_key(keys[1]), bytes(5))])  # another geometry: must not be copied
    tier.flush(30)
    worker.start_reads(1, [TierRead(0, keys[0], [0]), TierRead(0, b"\x09" * 36, [1])])
    worker.start_reads(2, [TierRead(0, keys[1], [2])])
    done = []
    deadline = time.monotonic() + 30
    while len(done) < 2 and time.monotonic() < deadline:
        done += worker.finished_reads()
    assert sorted(done) == [(1, False), (2, False)]
    assert not plane[2].any()  # the 5-byte value was not copied into an 8-byte sub-block
    worker.close()


@pytest.mark.parametrize("tiers", [{"type": "disk"}, ["disk"]])
def test_bad_tier_list_is_a_config_error(tiers):
    from connectors.offload.config import OffloadConfig
    from kvconnector_core.engine.engine import EngineConfig

    kv_cache_config = EngineConfig(num_gpu_blocks=64, max_model_len=256).kv_cache_config()
    with pytest.raises(
        ConfigError,
        match=r"OffloadingConnector: extra_config tiers(\[0\])?=.* is not valid: "
        r"Expected `(array|object)`",
    ):
        OffloadConfig.from_extra({"num_cpu_blocks": 4, "tiers": tiers}, kv_cache_config)


def test_redis_tier_gets_the_connector_layout_unless_given(tmp_path):
    tiers = make_tiers(
        [{"type": "redis", "model": "m"}, {"type": "redis", "model": "m", "layout": "mine"}],
        layout="bs16x1-2048B",
        enable_events=False,
    )
    try:
        assert [t.config.layout for t in tiers] == ["bs16x1-2048B", "mine"]
    finally:
        for t in tiers:
            t.close()


def test_a_chunk_being_written_to_the_cpu_tier_is_no_tier_hit(tmp_path):
    """A chunk on disk whose CPU-tier store (or promotion) is in flight is no tier hit:
    promoting it would need a fresh CPU slot, which ``prepare_store`` cannot give a key it
    holds, so admission would raise (a contained traceback in ``kvconnector run --tier
    disk:... --cpu-blocks 6``). The hit stops at that chunk, and the promotion of the
    chunks before it succeeds."""
    from connectors.offload.manager import CPUOffloadingManager
    from connectors.offload.tiers.scheduler import SchedulerTiers

    tier = _disk(tmp_path, "t")
    keys = _keys(4)
    tier.store([(tier_key(k), b"x") for k in keys])
    tier.flush(30)
    manager = CPUOffloadingManager(8)
    assert manager.prepare_store([keys[2]]) is not None  # being written: not ready
    tiers = SchedulerTiers([tier], manager, blocks_per_chunk=1)
    assert _poll(lambda: tiers.promotable("r", keys)) == {keys[0], keys[1], keys[3]}
    reads = tiers.plan_promotion("r", keys[:2])
    assert [r.key for r in reads] == keys[:2]
    tiers.close()


def test_tier_events_are_reference_counted_so_a_replica_equals_the_tier(tmp_path):
    """One stored event per key the tier holds (storing it again
    announces nothing), one removal when it really goes (evicted, or damaged and
    deleted), GPU block hashes shared by two chunks counted. Replaying the DISK events
    as a set gives exactly the blocks of the chunks whose files are on disk."""
    from kvconnector_core.kv_events import BlockRemoved

    plane = torch.arange(8 * 4, dtype=torch.uint8).view(8, 4)  # 2 sub-blocks per chunk: 8 bytes
    tier = DiskTier({"path": str(tmp_path), "capacity_bytes": 2 * (16 + 8)})  # two files
    worker = WorkerTiers([tier], block_sizes=[16])
    worker.bind_buffer((plane,))
    h = [bytes([i]) * 32 for i in range(6)]
    keys = {"a": h[2] + bytes(4), "b": h[3] + bytes(4), "c": h[5] + bytes(4)}
    blocks = {"a": [h[1], h[2]], "b": [h[1], h[3]], "c": [h[4], h[5]]}  # a and b share h1
    replica: set[bytes] = set()

    def write(*names):
        worker.write([TierWrite(keys[n], [0, 1], blocks[n], None) for n in names])
        tier.flush(30)

    def check():
        for event in worker.take_events():
            assert event.medium == "DISK" and event.group_idx == 0
            wire = set(event.block_hashes)
            if isinstance(event, BlockRemoved):
                assert wire <= replica
                replica.difference_update(wire)
            else:
                assert not wire & replica, "a block announced twice"
                replica.update(wire)
        on_disk = {n for n, k in keys.items() if tier._path(tier_key(k)).exists()}
        assert replica == {to_external_hash(b) for n in on_disk for b in blocks[n]}
        return on_disk

    write("a", "b")
    assert check() == {"a", "b"}
    write("a")  # stored again: nothing new to announce (and a is now the most recent)
    assert worker.take_events() == []
    write("c")  # over the budget: b, the least recently used, is evicted; h1 stays (a)
    assert check() == {"a", "c"}
    path = tier._path(tier_key(keys["a"]))
    path.write_bytes(path.read_bytes()[:-1] + b"\xff")  # damaged: its load fails, file deleted
    worker.start_reads(1, [TierRead(0, keys["a"], [4, 5])])
    assert _poll(worker.finished_reads) == [(1, False)]
    assert check() == {"c"}
    worker.close()


def test_a_write_without_chunk_info_describes_the_chunk_by_its_block_hash():
    """With no ChunkInfo for a chunk (events off), its tier write describes it by its block
    hash, not the whole offload key (hash + 4 group bytes), so tier events carry the right
    wire hash."""
    manager = CPUOffloadingManager(2)
    key = _keys(1, group=1)[0]
    manager.prepare_store([key])
    manager.complete_store([key])
    planned = SchedulerTiers([], manager, blocks_per_chunk=1).plan_writes(
        3, [key], lambda _key: None
    )
    assert planned is not None
    job, pinned = planned
    assert pinned == (key,)
    assert [(w.key, w.block_hashes, w.parent_block_hash) for w in job.writes] == [
        (key, [key[:-4]], None)
    ]
