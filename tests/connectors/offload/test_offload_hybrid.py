"""CPU offload of hybrid models: keys per group, window-aware hits, partial loads,
stores that skip out-of-window chunks, per-group events, identical outputs."""

from __future__ import annotations

import pytest
import torch

from kvconnector_core.engine.engine import Engine, EngineConfig
from kvconnector_core.engine.workloads import get_workload
from kvconnector_core.kv_events import BlockRemoved, BlockStored
from kvconnector_core.worker.model import ModelConfig

GPU_BLOCKS = 80


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _run(layer_types: tuple[str, ...], connector: dict | None):
    model = ModelConfig(layer_types=layer_types, vocab_size=1000)
    cfg = EngineConfig(model=model, max_num_batched_tokens=64, max_model_len=1024,
                       num_gpu_blocks=GPU_BLOCKS, connector=connector, enable_kv_cache_events=True)
    eng = Engine(cfg)
    events: list = []
    if connector is not None:
        take = eng.scheduler_connector.take_events

        def recording_take():
            out = take()
            events.extend(out)
            return out

        eng.scheduler_connector.take_events = recording_take
    result = eng.run(get_workload("documents"))
    return eng, result, events


OFFLOAD = {"name": "cpu_offload", "extra_config": {"num_cpu_blocks": 256}}


@pytest.mark.parametrize("layer_types", [
    ("full", "sliding:48") * 2,      # full + sliding window (gpt-oss-like)
    ("full", "chunked:64") * 2,      # full + chunked local (Llama 4-like)
    ("sliding:40", "sliding:96") * 2,  # two sliding windows, no full attention
], ids=["full+swa", "full+chunked", "two-windows"])
def test_hybrid_models_offload_with_identical_outputs(layer_types):
    _, baseline, _ = _run(layer_types, None)
    eng, result, events = _run(layer_types, OFFLOAD)
    assert result.outputs == baseline.outputs
    m = result.metrics
    assert m.connector_hit_tokens > 0 and m.connector_errors == {}
    assert m.prefill_tokens_computed < baseline.metrics.prefill_tokens_computed
    # Keys carry the group; every group has chunks in the tier.
    keys = [k for k, _ in eng.scheduler_connector.manager.policy]
    assert {int.from_bytes(k[-4:], "big") for k in keys} == {0, 1}
    # Partial loads: fewer bytes than every group's blocks of the hit tokens.
    kv = eng.kv_cache_config
    everything = m.connector_hit_tokens // 16 * len(kv.kv_cache_groups) * kv.bytes_per_block
    assert 0 < m.bytes_loaded < everything
    # Events per group, each with its group's index; a replay per group is consistent.
    held: dict[int, set[int]] = {0: set(), 1: set()}
    for e in events:
        assert isinstance(e, (BlockStored, BlockRemoved)) and e.group_idx in held
        if isinstance(e, BlockStored):
            assert e.block_size == 16 and not held[e.group_idx] & set(e.block_hashes)
            held[e.group_idx] |= set(e.block_hashes)
        else:
            assert set(e.block_hashes) <= held[e.group_idx]
            held[e.group_idx] -= set(e.block_hashes)
    assert held[0] and held[1]
    eng.shutdown()


def _prefill_once(layer_types: tuple[str, ...], prompt: list[int]) -> Engine:
    """An engine that prefilled ``prompt`` in one step and completed its stores."""
    model = ModelConfig(layer_types=layer_types, vocab_size=1000)
    eng = Engine(EngineConfig(model=model, max_num_batched_tokens=128, max_model_len=1024,
                              num_gpu_blocks=GPU_BLOCKS, connector=OFFLOAD))
    eng.add_request(prompt, 1)
    while eng.has_unfinished_requests():
        eng.step()
    for _ in range(3):  # stores complete and are reported
        eng.step()
    return eng


@pytest.mark.parametrize("window", [3, 8, 16, 48])
def test_windowed_groups_serve_a_hit_at_every_chunk_boundary(window):
    """A windowed group stores every chunk the prefill step computed, not only those still
    in its window (then only a hit ending where that step ended would be served, and a
    repeated prompt, whose hit ends one block short, or a shared prefix would get no hit
    with windows of 8 or 16 tokens)."""
    from kvconnector_core.request import Request

    prompt = [(7 * i) % 997 + 1 for i in range(96)]
    for kind in ("sliding", "chunked"):
        eng = _prefill_once(("full", f"{kind}:{window}") * 2, prompt)
        lookup = eng.scheduler_connector.get_num_new_matched_tokens
        assert lookup(Request("again", prompt, 1, hash_block_size=16), 0) == (80, True), kind
        shared = prompt[:48] + [999] * 22
        assert lookup(Request("shared", shared, 1, hash_block_size=16), 0) == (48, True), kind
        eng.shutdown()


def _decode_key_counts(prompt_len: int, steps: int = 40) -> list[int]:
    """Offload keys the scheduler side computes in each decode step of one request."""
    from connectors.offload.connector import OffloadingConnector
    from kvconnector_core.connector.base import KVConnectorRole
    from kvconnector_core.connector.config import KVConnectorConfig
    from kvconnector_core.kv_cache.block_pool import KVCacheBlock
    from kvconnector_core.kv_cache.kv_cache_manager import KVCacheBlocks
    from kvconnector_core.kv_cache.kv_cache_spec import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )
    from kvconnector_core.request import Request
    from kvconnector_core.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput

    n_blocks = prompt_len // 16 + steps // 16 + 4
    kv = KVCacheConfig(n_blocks + 1, [KVCacheGroupSpec(["l"], FullAttentionSpec(16, 1, 4))])
    conn = OffloadingConnector(
        KVConnectorConfig(
            name="cpu_offload", extra_config={"num_cpu_blocks": n_blocks, "enable_events": False}
        ),
        KVConnectorRole.SCHEDULER,
        kv,
    )
    side = conn.scheduler_side
    calls = [0]
    key = side.keys.key

    def counting_key(*args):
        calls[0] += 1
        return key(*args)

    side.keys.key = counting_key  # type: ignore[method-assign]
    prompt = list(range(prompt_len))
    req = Request("r", prompt, steps + 1, hash_block_size=16)
    ids = list(range(1, prompt_len // 16 + 1))

    def out(new, cached, n):
        return SchedulerOutput(
            scheduled_new_reqs=new,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens={"r": n},
            total_num_scheduled_tokens=n,
            finished_req_ids=set(),
            preempted_req_ids=set(),
        )

    conn.update_state_after_alloc(req, KVCacheBlocks(([KVCacheBlock(i) for i in ids],)), 0)
    conn.build_connector_meta(
        out(
            [NewRequestData("r", prompt, (ids,), 0)],
            CachedRequestData([], set(), [], [], []),
            prompt_len,
        )
    )
    counts = []
    next_id = len(ids) + 1
    for step in range(steps):
        req.append_output_token_ids(step)
        computed = prompt_len + step
        new_ids = ([next_id],) if computed % 16 == 0 else None
        next_id += new_ids is not None
        calls[0] = 0
        conn.build_connector_meta(
            out([], CachedRequestData(["r"], set(), [[step]], [new_ids], [computed]), 1)
        )
        counts.append(calls[0])
    return counts


def test_store_planning_computes_only_the_new_chunks_keys():
    """Store planning is O(new blocks): a decode step computes the key of the chunk it
    completes (if any), never the request's whole key list, whatever the prompt length."""
    short, long = _decode_key_counts(256), _decode_key_counts(16384)
    assert short == long
    assert max(long) == 1 and sum(long) == 40 // 16  # one key per completed chunk


def test_a_resent_prompt_hits_its_sliding_window_after_a_one_step_prefill():
    """The chunk the window starts in is stored: after a 99-token prompt prefilled in one
    step, the same prompt hits 96 tokens (the window of token 96 reaches back into the
    chunk of tokens 48-63, which is only partly in the window of token 99)."""
    from kvconnector_core.request import Request

    model = ModelConfig(layer_types=("full", "sliding:40") * 2, vocab_size=1000)
    eng = Engine(
        EngineConfig(
            model=model,
            max_num_batched_tokens=128,
            max_model_len=1024,
            num_gpu_blocks=GPU_BLOCKS,
            connector=OFFLOAD,
        )
    )
    prompt = [(7 * i) % 997 + 1 for i in range(99)]
    eng.add_request(prompt, 1)
    while eng.has_unfinished_requests():
        eng.step()
    for _ in range(3):  # stores complete and are reported
        eng.step()
    again = Request("again", prompt, 1, hash_block_size=16)
    assert eng.scheduler_connector.get_num_new_matched_tokens(again, 0) == (96, True)
    eng.shutdown()


def test_a_chunk_with_a_block_freed_before_the_step_is_never_stored():
    """With a window smaller than a chunk, a chunk that completes after its first block left
    the window is not stored from that block's old id (freed by this step's allocation,
    possibly rewritten by another request). Window 4, 4-token blocks, 8-token
    chunks: decoding token 15 frees blocks 0-2 (window of token 15: tokens 12-15), so
    chunk 1 (blocks 2-3) of the sliding group is skipped; the full group stores it."""
    from connectors.offload.connector import OffloadingConnector
    from kvconnector_core.connector.base import KVConnectorRole
    from kvconnector_core.connector.config import KVConnectorConfig
    from kvconnector_core.kv_cache.block_pool import KVCacheBlock
    from kvconnector_core.kv_cache.kv_cache_manager import KVCacheBlocks
    from kvconnector_core.kv_cache.kv_cache_spec import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )
    from kvconnector_core.request import Request
    from kvconnector_core.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput

    kv = KVCacheConfig(
        16,
        [
            KVCacheGroupSpec(["f"], FullAttentionSpec(block_size=4)),
            KVCacheGroupSpec(["s"], SlidingWindowSpec(block_size=4, sliding_window=4)),
        ],
    )
    conn = OffloadingConnector(
        KVConnectorConfig(
            name="cpu_offload", extra_config={"num_cpu_blocks": 16, "blocks_per_chunk": 2}
        ),
        KVConnectorRole.SCHEDULER,
        kv,
    )
    prompt = list(range(1, 15))
    req = Request("r", prompt, 8, hash_block_size=4)
    full_ids, sliding_ids = [1, 2, 3, 4], [5, 6, 7, 8]

    def step(new, cached, n):
        return conn.build_connector_meta(
            SchedulerOutput(
                scheduled_new_reqs=new,
                scheduled_cached_reqs=cached,
                num_scheduled_tokens={"r": n},
                total_num_scheduled_tokens=n,
                finished_req_ids=set(),
                preempted_req_ids=set(),
            )
        )

    conn.update_state_after_alloc(
        req,
        KVCacheBlocks(
            ([KVCacheBlock(i) for i in full_ids], [KVCacheBlock(i) for i in sliding_ids])
        ),
        0,
    )
    first = step(
        [NewRequestData("r", prompt, (full_ids, sliding_ids), 0)],
        CachedRequestData([], set(), [], [], []),
        14,
    )
    assert [job.gpu_block_ids for job in first.stores] == [[1, 2, 5, 6]]  # chunk 0 of each group
    stored = []
    for token, computed in ((14, 14), (15, 15)):
        req.append_output_token_ids(token)
        meta = step([], CachedRequestData(["r"], set(), [[token]], [None], [computed]), 1)
        stored += [job.gpu_block_ids for job in meta.stores]
    assert stored == [[3, 4]]  # chunk 1 of the full group only: block 7 was freed
