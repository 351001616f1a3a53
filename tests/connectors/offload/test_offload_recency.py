"""The offload connector's ``recency`` setting: ``"all_keys"`` (vLLM 0.33's rule, the
default) marks every chunk a finished request loaded, stored or found held as recently
used; ``"hits_only"`` marks only the chunks its admission hit (GPU prefix and loads)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from connectors.offload.connector import OffloadingConnector
from kvconnector_core.connector.base import KVConnectorRole
from kvconnector_core.connector.config import KVConnectorConfig
from kvconnector_core.engine.engine import Engine, EngineConfig
from kvconnector_core.engine.workloads import TraceRequest
from kvconnector_core.errors import ConfigError
from kvconnector_core.kv_cache.hashing import hash_request_tokens
from kvconnector_core.kv_cache.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

import _drivers as d  # noqa: E402
import bench_offload_hits  # noqa: E402

BS = 16
GROUP0 = bytes(4)  # offload keys end with the group index


def _scheduler(extra: dict) -> OffloadingConnector:
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8)
    kv = KVCacheConfig(num_blocks=32, kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    return OffloadingConnector(
        KVConnectorConfig(name="cpu_offload", extra_config=extra), KVConnectorRole.SCHEDULER, kv
    )


def test_recency_setting_parses_with_vllms_rule_as_default() -> None:
    assert _scheduler({"num_cpu_blocks": 4}).offload_config.recency == "all_keys"
    conn = _scheduler({"num_cpu_blocks": 4, "recency": "hits_only"})
    assert conn.offload_config.recency == "hits_only"


def test_a_bad_recency_names_the_value_and_the_valid_ones() -> None:
    with pytest.raises(ConfigError) as info:
        _scheduler({"num_cpu_blocks": 4, "recency": "newest"})
    assert str(info.value) == (
        "OffloadingConnector: extra_config recency='newest' is not valid: "
        "Invalid enum value 'newest'; valid: all_keys, hits_only"
    )


def _prompt(rng: random.Random, tokens: int) -> list[int]:
    return [rng.randrange(1000) for _ in range(tokens)]


def _keys(prompt: list[int]) -> list[bytes]:
    """Offload keys of the prompt's whole chunks (one GPU block per chunk)."""
    return [h + GROUP0 for h in hash_request_tokens(prompt, BS)]


def _lru_order(recency: str) -> tuple[list[bytes], list[bytes], list[bytes], list[bytes]]:
    """Run three requests on a CPU tier with LRU; return the tier's keys, least recent
    (first evicted) first, before V and after V, and the keys of Z's and W's prompt chunks.

    Z stores its prompt, W stores another one and finishes while Z still runs, then Z
    finishes; V then reuses Z's prompt as its prefix and finishes.
    """
    rng = random.Random(3)
    z, w = _prompt(rng, 4 * BS), _prompt(rng, 4 * BS)
    eng = Engine(
        EngineConfig(
            num_gpu_blocks=64,
            block_size=BS,
            max_model_len=512,
            connector={
                "name": "cpu_offload",
                "extra_config": {"num_cpu_blocks": 64, "recency": recency},
            },
        )
    )
    eng.add_request(z, 16, request_id="z")
    for _ in range(4):  # Z's prefill, then its stores complete
        eng.step()
    eng.add_request(w, 2, request_id="w")
    finished: list[str] = []
    while "w" not in finished:
        finished += [out.request_id for out in eng.step()]
    assert "z" not in finished  # Z is still running when W finishes
    while eng.has_unfinished_requests():
        eng.step()
    policy = eng.scheduler_connector.manager.policy
    before = [key for key, _ in policy]
    eng.add_request(z + _prompt(rng, 2 * BS + 3), 2, request_id="v")
    while eng.has_unfinished_requests():
        eng.step()
    after = [key for key, _ in policy]
    eng.shutdown()
    zk, wk = _keys(z), _keys(w)  # stored by the prefills (Z's decode stores more later)
    assert set(zk) | set(wk) <= set(before)
    return before, after, zk, wk


def test_hits_only_does_not_promote_what_a_request_only_stored() -> None:
    """All keys (vLLM 0.33): Z's stored chunks are marked used when Z finishes, after W's,
    so W's are evicted first. Hits only: Z's stored chunks keep their store-time rank,
    older than W's."""
    order, _, zk, wk = _lru_order("all_keys")
    rank = {key: i for i, key in enumerate(order)}
    assert max(rank[k] for k in wk) < min(rank[k] for k in zk)
    order, _, zk, wk = _lru_order("hits_only")
    rank = {key: i for i, key in enumerate(order)}
    assert max(rank[k] for k in zk) < min(rank[k] for k in wk)


def test_hits_only_promotes_the_chunks_a_request_reused() -> None:
    """V reuses Z's prompt as its prefix: at V's finish those chunks become the most
    recent of the tier (head of the prefix last), above V's own stores and W's."""
    before, after, zk, _ = _lru_order("hits_only")
    assert before[-len(zk) :] != zk[::-1]
    assert after[-len(zk) :] == zk[::-1]


def _doc_trace(seed: int = 0, rounds: int = 3) -> list[TraceRequest]:
    """Four 96-token documents asked about repeatedly; the GPU pool cannot keep them all."""
    rng = random.Random(seed)
    docs = [_prompt(rng, 96) for _ in range(4)]
    return [
        TraceRequest(
            request_id=f"r{r}-{d}",
            arrival=r * 40 + d * 2,
            max_new_tokens=8,
            prompt_token_ids=doc + _prompt(rng, 5),
        )
        for r in range(rounds)
        for d, doc in enumerate(docs)
    ]


def _engine(connector: dict | None) -> Engine:
    return Engine(
        EngineConfig(
            num_gpu_blocks=24,
            block_size=BS,
            max_model_len=256,
            max_num_batched_tokens=128,
            max_num_seqs=2,
            connector=connector,
        )
    )


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_an_engine_run_with_hits_only_gives_the_baselines_outputs(policy: str) -> None:
    trace = _doc_trace()
    baseline = _engine(None).run(trace)
    eng = _engine(
        {
            "name": "cpu_offload",
            "extra_config": {
                "num_cpu_blocks": 16,
                "blocks_per_chunk": 2,
                "cache_policy": policy,
                "recency": "hits_only",
            },
        }
    )
    result = eng.run(trace)
    eng.shutdown()
    assert result.outputs == baseline.outputs
    assert result.metrics.connector_hit_tokens > 0 and result.metrics.connector_errors == {}


def _chat_prompts(seed: int = 0) -> list[list[int]]:
    """Four conversations on two system prompts, four turns each; no prompt ends on a
    block boundary (a full hit would then stop one block short, which the drivers skip)."""
    rng = random.Random(seed)
    systems = [_prompt(rng, 50) for _ in range(2)]
    convs = [list(systems[u % 2]) for u in range(4)]
    prompts = []
    for _ in range(4):
        for conv in convs:
            conv += _prompt(rng, 20)
            prompts.append(list(conv))
    assert all(len(p) % BS for p in prompts)
    return prompts


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_the_hit_rate_benchmark_drives_the_manager_as_the_connector_does(policy: str) -> None:
    """bench_offload_hits's rows stand for the connector: one request at a time, no GPU
    prefix cache, a tier smaller than the trace, each rule's connector serves as many
    tokens as its driver; and the two rules serve different amounts here."""
    prompts = _chat_prompts()
    trace = [
        TraceRequest(request_id=f"r{i}", arrival=i * 50, max_new_tokens=1, prompt_token_ids=p)
        for i, p in enumerate(prompts)
    ]
    served = {}
    for recency, side in (
        ("all_keys", d.KvconnectorSide()),
        ("hits_only", bench_offload_hits.HitsOnlySide()),
    ):
        eng = Engine(
            EngineConfig(
                num_gpu_blocks=64,
                block_size=BS,
                max_model_len=512,
                max_num_seqs=1,
                enable_prefix_caching=False,
                connector={
                    "name": "cpu_offload",
                    "extra_config": {
                        "num_cpu_blocks": 12,
                        "cache_policy": policy,
                        "recency": recency,
                    },
                },
            )
        )
        tokens = eng.run(trace).metrics.connector_hit_tokens
        eng.shutdown()
        run = side.offload_runner(12, policy)
        assert tokens == BS * sum(run(_keys(p), f"r{i}") for i, p in enumerate(prompts))
        served[recency] = tokens
    assert served["all_keys"] != served["hits_only"]
