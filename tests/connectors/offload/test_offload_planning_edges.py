"""Edge cases of the offload connector's scheduler-side load and store planning.

Each test pins one decision of ``ChunkLoadPlanner`` / ``ChunkStorePlanner`` that the engine-level
tests do not reach: the role gate, chunk boundaries of a hit and of a store, and what
the worker is told to copy.
"""

from __future__ import annotations

import time
import types

import pytest

from connectors.offload.connector import OffloadingConnector
from kvconnector_core.connector.base import KVConnectorRole
from kvconnector_core.connector.config import KVConnectorConfig
from kvconnector_core.kv_cache.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)


def kv_config(block_size: int = 16) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=8)
    return KVCacheConfig(num_blocks=32, kv_cache_groups=[KVCacheGroupSpec(["l0", "l1"], spec)])


def side_of(extra: dict, role: str = "kv_both"):
    cfg = KVConnectorConfig(name="cpu_offload", role=role, extra_config=extra)
    return OffloadingConnector(cfg, KVConnectorRole.SCHEDULER, kv_config()).scheduler_side


def request(rid: str, hashes: list[bytes], num_tokens: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(request_id=rid, block_hashes=hashes, num_tokens=num_tokens)


def hold(side, hashes: list[bytes], chunks: range) -> None:
    """Store (and complete) the given chunks of a request with these block hashes."""
    keys = [side.keys.key(types.SimpleNamespace(block_hashes=hashes), 0, c) for c in chunks]
    side.manager.complete_store(side.manager.prepare_store(keys).keys_to_store)


HASHES = [bytes([i]) * 8 for i in range(8)]


def test_a_producer_finds_no_hit_even_for_held_chunks() -> None:
    """Role kv_producer only stores: chunks the tier holds are never offered as a hit."""
    side = side_of({"num_cpu_blocks": 16}, role="kv_producer")
    hold(side, HASHES, range(4))
    assert side.get_num_new_matched_tokens(request("r", HASHES, 8 * 16 + 1), 0) == (0, False)
    both = side_of({"num_cpu_blocks": 16})
    hold(both, HASHES, range(4))
    assert both.get_num_new_matched_tokens(request("r", HASHES, 8 * 16 + 1), 0) == (64, True)


def test_a_local_hit_inside_a_chunk_needs_that_chunk_held() -> None:
    """With 32-token chunks, a 16-token GPU hit ends inside chunk 0: the CPU hit must
    start with chunk 0 (its second block is loaded from it). Chunk 0 missing means no
    hit, however many later chunks are held."""
    side = side_of({"num_cpu_blocks": 16, "blocks_per_chunk": 2})
    hold(side, HASHES, range(1, 4))
    assert side.get_num_new_matched_tokens(request("r", HASHES, 8 * 16 + 1), 16) == (0, False)
    hold(side, HASHES, range(1))
    assert side.get_num_new_matched_tokens(request("r", HASHES, 8 * 16 + 1), 16) == (128 - 16, True)


def test_a_fully_local_hit_costs_no_lookup() -> None:
    """When the GPU hit already covers every chunk, the CPU tier is not asked."""
    side = side_of({"num_cpu_blocks": 16})
    hold(side, HASHES, range(8))
    calls: list[int] = []
    lookup = side.manager.lookup
    side.manager.lookup = lambda keys: calls.append(1) or lookup(keys)
    assert side.get_num_new_matched_tokens(request("r", HASHES, 8 * 16 + 1), 128) == (0, False)
    assert calls == []
    assert side.get_num_new_matched_tokens(request("r2", HASHES, 8 * 16 + 1), 112) == (16, True)
    assert calls == [1]  # one chunk left: asked


def _admission(held: range = range(8)):
    from kvconnector_core.kv_cache.block_pool import KVCacheBlock
    from kvconnector_core.kv_cache.kv_cache_manager import KVCacheBlocks
    from kvconnector_core.request import Request

    side = side_of({"num_cpu_blocks": 16})
    req = Request("r", list(range(8 * 16 + 1)), 4, hash_block_size=16)
    hold(side, list(req.block_hashes), held)
    return side, req, KVCacheBlocks(([KVCacheBlock(i) for i in range(1, 9)],))


def _empty_output():
    from kvconnector_core.scheduler.output import CachedRequestData, SchedulerOutput

    return SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData([], set(), [], [], []),
        num_scheduled_tokens={},
        total_num_scheduled_tokens=0,
        finished_req_ids=set(),
        preempted_req_ids=set(),
    )


def test_a_load_is_planned_once_when_the_allocation_is_reported_twice() -> None:
    side, req, blocks = _admission()
    assert side.get_num_new_matched_tokens(req, 0) == (128, True)
    side.update_state_after_alloc(req, blocks, 128)
    side.update_state_after_alloc(req, blocks, 128)
    loads = side.build_connector_meta(_empty_output()).loads
    assert [job.gpu_block_ids for job in loads] == [list(range(1, 9))]


def test_without_a_lookup_the_load_starts_after_the_hashed_gpu_prefix() -> None:
    """Another connector answered the lookup: the GPU prefix hit is the leading blocks
    that carry a hash, and only the blocks after it are loaded, from their own chunks."""
    side, req, blocks = _admission()
    for block, h in zip(blocks.blocks[0][:2], req.block_hashes, strict=False):
        block.block_hash = h
    side.update_state_after_alloc(req, blocks, 96)
    (job,) = side.build_connector_meta(_empty_output()).loads
    assert job.gpu_block_ids == list(range(3, 9))
    slots = side.manager.prepare_load([side.keys.key(req, 0, c) for c in range(2, 8)]).block_ids
    assert job.cpu_block_ids == list(slots)


def test_a_forgotten_request_gets_no_load() -> None:
    """After the guard forgets a request (its store still in flight), a new allocation
    for it plans nothing."""
    from kvconnector_core.scheduler.output import NewRequestData

    side, req, blocks = _admission(held=range(4, 8))
    side.update_state_after_alloc(req, blocks, 0)
    out = _empty_output()
    ids = [b.block_id for b in blocks.blocks[0]]
    out.scheduled_new_reqs.append(NewRequestData("r", list(req.prompt_token_ids), (ids,), 0))
    out.num_scheduled_tokens["r"] = 64
    assert len(side.build_connector_meta(out).stores) == 1  # chunks 0-3, in flight
    side.forget_requests({"r"})
    for block, h in zip(blocks.blocks[0][:4], req.block_hashes, strict=False):
        block.block_hash = h
    side.update_state_after_alloc(req, blocks, 64)
    assert side.build_connector_meta(_empty_output()).loads == []


# ------------------------------------------------------------------ with a disk tier
_OPEN: list = []  # scheduler sides with tiers, shut down after each test (their I/O threads)


@pytest.fixture(autouse=True)
def _shut_down_tiered_sides():
    yield
    while _OPEN:
        _OPEN.pop().shutdown()


def tiered(
    tmp_path,
    on_disk: range,
    in_cpu: range,
    *,
    num_cpu_blocks: int,
    factor: int = 1,
    hashes: list[bytes] = HASHES,
):
    """A scheduler side with a disk tier holding chunks ``on_disk`` and the CPU tier
    holding ``in_cpu`` of the request with these block hashes."""
    from connectors.offload.tiers import DiskTier
    from connectors.offload.tiers.records import tier_key

    path = tmp_path / "disk"
    tier = DiskTier({"path": str(path), "capacity_bytes": 1 << 20})
    ns = types.SimpleNamespace(block_hashes=hashes)
    probe = side_of({"num_cpu_blocks": 4, "blocks_per_chunk": factor})
    tier.store([(tier_key(probe.keys.key(ns, 0, c)), b"x") for c in on_disk])
    tier.flush(30)
    tier.close()
    side = side_of(
        {
            "num_cpu_blocks": num_cpu_blocks,
            "blocks_per_chunk": factor,
            "tiers": [{"type": "disk", "path": str(path), "capacity_bytes": 1 << 20}],
        }
    )
    _OPEN.append(side)
    hold(side, hashes, in_cpu)
    return side


def ask(side, req) -> tuple[int | None, bool]:
    """The lookup's answer once the tier has answered."""
    deadline = time.monotonic() + 30
    while (out := side.get_num_new_matched_tokens(req, 0))[0] is None:
        assert time.monotonic() < deadline, "the tier never answered"
        time.sleep(0.001)
    return out


def test_a_prompt_the_cpu_tier_serves_whole_does_not_wait_for_the_tiers(tmp_path) -> None:
    """128 tokens, all 8 chunks in the CPU tier: the hit (one block short of the end)
    is answered at once, without asking the tiers (which answer a step later)."""
    side = tiered(tmp_path, on_disk=range(8), in_cpu=range(8), num_cpu_blocks=16)
    assert side.get_num_new_matched_tokens(request("r", HASHES, 128), 0) == (112, True)


def test_a_tier_hit_runs_through_chunks_the_cpu_tier_holds(tmp_path) -> None:
    """Chunk 0 in the CPU tier, chunks 1-3 on disk: one hit of all four."""
    side = tiered(tmp_path, on_disk=range(1, 4), in_cpu=range(1), num_cpu_blocks=16)
    assert ask(side, request("r", HASHES, 4 * 16 + 1)) == (64, True)


def test_promotions_may_take_every_free_cpu_slot(tmp_path) -> None:
    """Four chunks on disk and exactly four free CPU slots: all four are promoted."""
    side = tiered(tmp_path, on_disk=range(4), in_cpu=range(0), num_cpu_blocks=4)
    assert ask(side, request("r", HASHES, 4 * 16 + 1)) == (64, True)


def test_a_hit_too_big_for_the_cpu_slots_is_cut_by_one_chunk(tmp_path) -> None:
    """32-token chunks; the prompt's hit would end at 112 (4 chunks, the last one
    partly) but 3 CPU slots are free: the hit is cut to the 3 chunks that fit (96)."""
    side = tiered(tmp_path, on_disk=range(4), in_cpu=range(0), num_cpu_blocks=3, factor=2)
    assert ask(side, request("r", HASHES, 7 * 16 + 1)) == (96, True)


def test_a_failed_promotion_plan_unpins_the_cpu_chunks_of_the_load(tmp_path, monkeypatch) -> None:
    """If the tiers cannot plan the promotions, admission fails and the CPU-held chunks
    the load had pinned are released (evictable again), not leaked."""
    from kvconnector_core.errors import InvariantError
    from kvconnector_core.kv_cache.block_pool import KVCacheBlock
    from kvconnector_core.kv_cache.kv_cache_manager import KVCacheBlocks
    from kvconnector_core.request import Request

    req = Request("r", list(range(4 * 16 + 1)), 4, hash_block_size=16)
    side = tiered(
        tmp_path,
        on_disk=range(1, 4),
        in_cpu=range(1),
        num_cpu_blocks=16,
        hashes=list(req.block_hashes),
    )
    assert ask(side, req) == (64, True)
    key = side.keys.key(req, 0, 0)
    evictable = side.manager.num_evictable_blocks

    def refuse(*_: object) -> list:
        raise InvariantError("no CPU slot")

    monkeypatch.setattr(side.tiers, "plan_promotion", refuse)
    blocks = KVCacheBlocks(([KVCacheBlock(i) for i in range(1, 5)],))
    with pytest.raises(InvariantError, match="no CPU slot"):
        side.update_state_after_alloc(req, blocks, 64)
    assert side.manager.policy.get(key).ref_cnt == 0
    assert side.manager.num_evictable_blocks == evictable


def test_a_scheduled_request_without_block_ids_plans_no_store() -> None:
    """A new request reported with no block ids: nothing to copy from, so no store
    (never a job whose CPU slots have no GPU blocks)."""
    from kvconnector_core.scheduler.output import NewRequestData

    side, req, blocks = _admission(held=range(0))
    side.update_state_after_alloc(req, blocks, 0)
    out = _empty_output()
    out.scheduled_new_reqs.append(NewRequestData("r", list(req.prompt_token_ids), (), 0))
    out.num_scheduled_tokens["r"] = 64
    assert side.build_connector_meta(out).stores == []


def _schedule_new(side, req, blocks, tokens: int):
    """Report the request scheduled for its first ``tokens`` tokens; the step's plan."""
    from kvconnector_core.scheduler.output import NewRequestData

    out = _empty_output()
    ids = [b.block_id for b in blocks.blocks[0]]
    out.scheduled_new_reqs.append(
        NewRequestData(req.request_id, list(req.prompt_token_ids), (ids,), 0)
    )
    out.num_scheduled_tokens[req.request_id] = tokens
    return side.build_connector_meta(out)


def test_a_forgotten_request_stores_nothing_more() -> None:
    from kvconnector_core.scheduler.output import CachedRequestData

    side, req, blocks = _admission(held=range(0))
    side.update_state_after_alloc(req, blocks, 0)
    assert len(_schedule_new(side, req, blocks, 32).stores) == 1  # chunks 0-1, in flight
    side.forget_requests({"r"})
    out = _empty_output()
    out.scheduled_cached_reqs = CachedRequestData(["r"], set(), [[]], [None], [32])
    out.num_scheduled_tokens["r"] = 64
    assert side.build_connector_meta(out).stores == []


def test_offering_a_held_chunk_for_storing_makes_it_recent() -> None:
    """Recency "all_keys" (vLLM 0.33): a request that completes a chunk the CPU tier
    already holds uses it, so the next eviction takes another, older chunk."""
    side, req, blocks = _admission(held=range(0))
    side.manager.complete_store(
        side.manager.prepare_store([side.keys.key(req, 0, 0)]).keys_to_store
    )
    others = [bytes([200 + i]) * 8 + bytes(4) for i in range(15)]  # group 0
    # the tier is full
    side.manager.complete_store(side.manager.prepare_store(others).keys_to_store)
    side.update_state_after_alloc(req, blocks, 0)
    _schedule_new(side, req, blocks, 16)  # completes chunk 0: held, so reused
    side.manager.prepare_store([b"new!" * 2 + bytes(4)])  # evicts the least recent chunk
    assert side.manager.lookup([side.keys.key(req, 0, 0)]) == 1
    assert side.manager.lookup(others[:1]) == 0
