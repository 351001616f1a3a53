"""kvconnector connectors inside vLLM 0.33's own Scheduler and worker connector code (CPU)."""

from __future__ import annotations

import random
import re

import pytest

pytest.importorskip(
    "vllm.distributed.kv_transfer",
    reason="vLLM 0.33 is not installed in this environment; run `make test-vllm`",
)

import torch  # noqa: E402
from _harness import (  # noqa: E402
    LAYOUTS,
    VllmRig,
    assert_no_leak,
    check_randomized_run,
    connector,
    make_vllm_config,
    multi,
    offload,
    prompt,
)

from kvconnector_core.integrations.vllm import AdapterStats, block_dense_views  # noqa: E402

TTL = connector("ttl", {"ttl_seconds": 1e6, "max_pinned_blocks": 8})


# ------------------------------------------------------------------ construction
def test_multi_connector_config_builds_with_hma_auto():
    """vLLM special-cases the name MultiConnector; behind the adapter it never sees it."""
    cfg = make_vllm_config(multi(TTL, offload()), hma=None)
    assert cfg.scheduler_config.disable_hybrid_kv_cache_manager is True  # auto-off, not a crash


def test_explicit_hma_is_refused_with_the_reason():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    cfg = make_vllm_config(offload(), hma=False)
    cfg.scheduler_config.disable_hybrid_kv_cache_manager = False
    with pytest.raises(ValueError, match="does not support HMA"):
        KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, None)


def test_hma_adapter_refuses_a_single_group_connector():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvconnector_core.errors import ConfigError
    from kvconnector_core.integrations.vllm import KVConnectorAdapterHMA

    rig = VllmRig(TTL)
    with pytest.raises(ConfigError, match="handles one KV cache group only"):
        KVConnectorAdapterHMA(rig.cfg, KVConnectorRole.SCHEDULER, rig.kv_cache_config)


def test_the_workers_rank_and_parallel_layout_reach_the_connector_config():
    """A worker's connector learns its shard from vLLM's parallel config (tier keys carry it)."""
    from kvconnector_core.errors import ConfigError
    from kvconnector_core.integrations.vllm import config as vllm_config

    cfg = make_vllm_config(offload())
    cfg.parallel_config.tensor_parallel_size = 2
    cfg.parallel_config.pipeline_parallel_size = 2
    cfg.parallel_config.rank = 3  # what vLLM's worker of pp rank 1, tp rank 1 sets
    config = vllm_config.connector_config_from_vllm(cfg)
    assert (config.world_size, config.rank, config.pipeline_parallel_size) == (4, 3, 2)
    cfg.parallel_config.prefill_context_parallel_size = 2
    with pytest.raises(ConfigError, match="prefill_context_parallel_size=2"):
        vllm_config.connector_config_from_vllm(cfg)


def test_third_party_entry_point_connector_loads_through_the_registry():
    """The TTL example is a separate distribution registered by entry point."""
    from ttl_connector import TTLPinConnector

    from kvconnector_core.connector import get_registry

    assert get_registry().get_entry("ttl").distribution == "kvconnector-ttl"
    rig = VllmRig(TTL)
    assert isinstance(rig.connector.connector, TTLPinConnector)
    assert rig.connector.requires_kv_delivery is False


def test_a_connector_states_its_preferred_layout_to_vllm():
    from vllm.distributed.kv_transfer.kv_connector.utils import get_kv_connector_cache_layout

    preferring = {
        "kvconnector": {"name": "LayoutPreferringTTL", "module_path": "_layout_connector"}
    }
    assert get_kv_connector_cache_layout(make_vllm_config(preferring)) == "BLHNC"
    assert get_kv_connector_cache_layout(make_vllm_config(offload())) is None


# ---------------------------------------------------------------------- layouts
@pytest.mark.parametrize("layout", LAYOUTS)
def test_views_share_vllm_storage_and_blocks_are_dense(layout):
    rig = VllmRig(offload(), layout=layout, num_gpu_blocks=16)
    for name, t in rig.kv_caches[0].items():
        views = block_dense_views(name, t)
        for v in views.values():
            assert v.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()  # no copy
            assert v[3].is_contiguous()
        before = t[3].clone()
        for v in views.values():
            v[3].fill_(7)
        assert torch.all(t[3] == 7) and not torch.equal(before, t[3])  # every byte of block 3
        assert torch.equal(t[2], torch.zeros_like(t[2]))  # and nothing else


def _store_reset_load(rig: VllmRig, prompts: list[list[int]]) -> None:
    for p in prompts:
        rig.add(p)
    rig.run()
    assert rig.scheduler.reset_prefix_cache() is True
    rig.wipe()
    for p in prompts:
        rig.add(p)
    rig.run()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_offload_loads_are_byte_exact_in_every_layout(layout):
    rig = VllmRig(offload(64), layout=layout, num_gpu_blocks=40)
    _store_reset_load(rig, [prompt(1, 67), prompt(2, 35)])
    assert rig.stats.hit_tokens == 64 + 32
    assert rig.stats.loaded_layer_blocks_checked == (4 + 2) * 4  # every loaded block, every layer
    assert rig.stats.async_loads == 2
    assert_no_leak(rig)
    rig.shutdown()


@pytest.mark.parametrize("num_workers", [2])
def test_tensor_parallel_workers_aggregate_jobs_and_delayed_frees(num_workers):
    """Two workers: a job completes once both report, each delayed free is passed once,
    and its blocks return to vLLM's pool in the step that reports it."""
    rig = VllmRig(offload(64), num_workers=num_workers, num_gpu_blocks=40)
    rid = rig.add(prompt(3, 64 + 3), max_tokens=1)
    freed_at = None
    pending_seen = False
    while rig.scheduler.has_requests():
        rig.step()
        pending_seen |= rig.connector.has_pending_block_frees()
        if rid not in rig.scheduler.requests and freed_at is None:
            freed_at = rig.stats.steps
            assert rig.free_blocks() == rig.kv_cache_config.num_blocks - 1
    assert pending_seen and freed_at is not None
    # every store job completed (both reported)
    assert not rig.connector.connector.scheduler_side.state.jobs
    assert rig.scheduler.reset_prefix_cache() is True
    rig.wipe()
    rig.add(prompt(3, 64 + 3), max_tokens=1)
    rig.run()
    assert rig.stats.hit_tokens == 64
    assert rig.stats.loaded_layer_blocks_checked == 4 * 4 * num_workers  # byte-exact on each worker
    assert_no_leak(rig)


# -------------------------------------------------------------------------- TTL
def test_ttl_pins_survive_the_empty_step_after_a_finish():
    """vLLM runs an empty step after each finish; pins must survive it (48-token hit, not 0)."""
    rig = VllmRig(
        connector("ttl", {"ttl_seconds": 1e6, "max_pinned_blocks": 4}),
        num_gpu_blocks=12,
        max_num_seqs=1,
    )
    hot = prompt(7, 48)
    rig.add(hot + [1, 2, 3], max_tokens=1)
    rig.run()
    rig.add(hot + [4, 5, 6], max_tokens=1)  # hit: pins the 3 prefix blocks
    rig.run()
    assert rig.stats.empty_steps >= 2 and rig.connector.connector.num_pinned_blocks == 3
    rig.add(prompt(8, 120), max_tokens=1)  # needs 8 of 11 blocks: evicts every unpinned one
    rig.run()
    admitted = {}
    forward = rig.connector.connector.get_num_new_matched_tokens

    def spy(request, num_computed_tokens):
        admitted[request.request_id] = num_computed_tokens
        return forward(request, num_computed_tokens)

    rig.connector.connector.get_num_new_matched_tokens = spy
    rid = rig.add(hot + [7, 8, 9], max_tokens=1)
    rig.run()
    assert admitted[rid] == 48
    assert_no_leak_except_pins(rig, pinned=3)


def assert_no_leak_except_pins(rig: VllmRig, pinned: int) -> None:
    assert rig.free_blocks() == rig.kv_cache_config.num_blocks - 1 - pinned
    rig.shutdown()
    assert rig.free_blocks() == rig.kv_cache_config.num_blocks - 1


def test_prefix_cache_reset_with_running_requests_succeeds_while_pins_are_held():
    """vLLM's weight-update path: reset_prefix_cache(reset_running_requests=True) with pins held."""
    rig = VllmRig(TTL, num_gpu_blocks=24)
    hot = prompt(9, 48)
    for tail in ([1], [2]):
        rig.add(hot + tail, max_tokens=1)
        rig.run()
    assert rig.connector.connector.num_pinned_blocks == 3
    rig.add(hot + [3], max_tokens=8)
    rig.step()  # running now
    assert (
        rig.scheduler.reset_prefix_cache(reset_running_requests=True, reset_connector=True) is True
    )
    assert rig.connector.connector.num_pinned_blocks == 0
    rig.run()
    assert_no_leak(rig)


def test_stats_are_per_step_deltas_through_vllms_stats_protocol():
    rig = VllmRig(TTL, num_gpu_blocks=24)
    shipped = []
    forward = rig.connector.get_kv_connector_stats

    def spy():
        stats = forward()
        if stats is not None:
            shipped.append(AdapterStats.build_kv_connector_stats if False else stats.to_dict())
        return stats

    rig.connector.get_kv_connector_stats = spy
    hot = prompt(10, 48)
    for tail in ([1], [2], [3]):
        rig.add(hot + tail, max_tokens=1)
        rig.run()
    total = rig.connector.build_kv_connector_stats()
    for data in shipped:  # what vLLM's logger does per interval
        total = total.aggregate(rig.connector.build_kv_connector_stats(data))
    reduced = total.reduce()
    assert reduced["pins"] == 3 and reduced["refreshes"] == 3  # deltas, summed once each
    assert reduced["gauges.pinned_blocks"] == 3  # a level, not a sum
    rig.shutdown()


def test_adapter_stats_protocol():
    a = AdapterStats.from_kvconnector(
        {
            "bytes_loaded": 10,
            "gauges": {"pinned": 2},
            "children": {"ttl": {"pins": 1, "gauges": {"pinned": 5}}},
        }
    )
    b = AdapterStats.from_kvconnector({"bytes_loaded": 5, "children": {"ttl": {"pins": 2}}})
    assert a.aggregate(b).reduce() == {
        "bytes_loaded": 15,
        "children.ttl.pins": 3,
        "gauges.pinned": 2,
        "gauges.children.ttl.pinned": 5,
    }
    assert AdapterStats.from_kvconnector(None).is_empty()


# ------------------------------------------------------------------- randomized
@pytest.mark.parametrize(
    ("name", "extra"), [("offload", offload(24)), ("multi", multi(TTL, offload(24)))]
)
def test_randomized_run_checks_every_block_byte_for_byte(name, extra):
    rig = VllmRig(
        extra, layout="LHBNC", num_gpu_blocks=20, max_num_seqs=6, max_num_batched_tokens=64
    )
    check_randomized_run(rig, seed=5, num_requests=96, min_layer_blocks=10_000)


@pytest.mark.parametrize("layout", ["BHLNC", "BLNHC"])
def test_randomized_transfers_are_byte_exact_ten_thousand_times(layout):
    """Over 10,000 layer-blocks stored to the CPU tier and loaded back into vLLM's tensors
    (GPU prefix cache dropped and every byte zeroed between rounds), each checked."""
    rng = random.Random(layout)
    prompts = [prompt(500 + i, 16 * rng.randrange(8, 17) + rng.randrange(1, 16)) for i in range(24)]
    rig = VllmRig(offload(512), layout=layout, num_gpu_blocks=160, max_num_batched_tokens=512)
    for p in prompts:
        rig.add(p, max_tokens=1)
    rig.run()
    for _ in range(60):  # ~30 rounds suffice; bounded so a connector that never loads fails
        if rig.stats.loaded_layer_blocks_checked >= 10_000:
            break
        assert rig.scheduler.reset_prefix_cache() is True
        rig.wipe()
        for p in rng.sample(prompts, 8):
            rig.add(p, max_tokens=1)
        rig.run()
    assert rig.stats.loaded_layer_blocks_checked >= 10_000, rig.stats.loaded_layer_blocks_checked
    assert_no_leak(rig)


# ------------------------------------------------------------------ failed loads
def test_failed_loads_are_reported_and_recomputed_by_vllm():
    from kvconnector_core.testing import FaultInjectingConnector

    rig = VllmRig(offload(64), num_gpu_blocks=40)
    p = prompt(11, 67)
    rig.add(p, max_tokens=2)
    rig.run()
    assert rig.scheduler.reset_prefix_cache() is True
    rig.wipe()
    sched_side = rig.connector
    for adapter in (sched_side, *rig.workers):  # the wrapped connector, behind the guard
        guard = (adapter.scheduler_side or adapter.worker_side).guard
        adapter.connector = guard.connector = FaultInjectingConnector(
            adapter.connector, load_failure_rate=1.0
        )
    rid = rig.add(p, max_tokens=2)
    rig.run()  # the checker verifies every block: the recomputed bytes are right
    # One failed load; vLLM then recomputes the prompt (the adapter answers its
    # re-query with no hit, so an always-failing tier cannot livelock the request).
    assert sched_side.connector.num_injected["loads"] == 1
    assert rig.stats.scheduled_tokens[rid] == 67 + 1
    assert rig.stats.finished == 2
    assert_no_leak(rig)


@pytest.mark.parametrize(
    "hook",
    [
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "build_connector_meta",
        "update_connector_output",
        "request_finished",
        "take_events",
        "get_kv_connector_stats",
        "bind_connector_metadata",
        "handle_preemptions",
        "start_load_kv",
        "wait_for_layer_load",
        "save_kv_layer",
        "wait_for_save",
        "get_block_ids_with_load_errors",
        "build_connector_worker_meta",
        "clear_connector_metadata",
    ],
)
def test_a_raising_hook_is_contained_inside_vllm(hook):
    """Through the guard, a connector hook that raises (every time) inside vLLM costs hits,
    never data: every request finishes, every block holds the right bytes, nothing leaks.

    (A connector whose get_transfer_results always raises never reports its transfers;
    that stalls any engine and is not in this list.)"""
    from kvconnector_core.testing import FaultInjectingConnector

    rig = VllmRig(offload(64), num_gpu_blocks=40)
    prompts = [prompt(20 + i, 67) for i in range(3)]
    for p in prompts:
        rig.add(p, max_tokens=2)
    rig.run()
    assert rig.scheduler.reset_prefix_cache() is True
    rig.wipe()
    for adapter in (rig.connector, *rig.workers):
        guard = (adapter.scheduler_side or adapter.worker_side).guard
        adapter.connector = guard.connector = FaultInjectingConnector(
            adapter.connector, raise_in={hook}
        )
    for p in prompts:
        rig.add(p, max_tokens=2)
    rig.run()  # byte-checked every step
    faulty = [a.connector for a in (rig.connector, *rig.workers)]
    assert sum(f.num_injected["raises"] for f in faulty) > 0
    assert rig.stats.finished == 6
    assert_no_leak(rig)


# ------------------------------------------------------------------------ events
def test_connector_events_reach_vllm_as_vllm_events():
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    rig = VllmRig(offload(64), num_gpu_blocks=40, kv_events=True)
    assert rig.connector.connector.config.enable_kv_cache_events is True
    seen = []
    forward = rig.connector.take_events

    def spy():
        events = forward()
        seen.extend(events)
        return events

    rig.connector.take_events = spy
    rig.add(prompt(12, 67), max_tokens=1)
    rig.run()
    stored = [e for e in seen if isinstance(e, BlockStored)]
    assert stored and all(e.medium == "CPU" and e.block_size == 16 for e in stored)
    import msgspec

    batch = msgspec.msgpack.decode(
        msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=stored)), type=KVEventBatch
    )
    assert batch.events == stored


def test_no_events_are_built_without_kv_events_config():
    """As vLLM: no kv_events_config, no KV events - the wrapped connector builds none."""
    rig = VllmRig(offload(64), num_gpu_blocks=40)
    assert rig.connector.connector.config.enable_kv_cache_events is False
    rig.add(prompt(12, 67), max_tokens=1)
    rig.run()
    assert list(rig.connector.take_events()) == []


# ----------------------------------------------------- the suite catches bad translations
def test_a_translation_that_copies_instead_of_viewing_is_caught(monkeypatch):
    """If the adapter handed the connector a copy of vLLM's tensor (reordered, then cloned),
    stores would read stale bytes and loads land in the copy: the byte check must fail."""
    from kvconnector_core.integrations.vllm import worker

    monkeypatch.setattr(
        worker, "block_dense_views", lambda name, t: {name: t.permute(0, 2, 1, 3).clone()}
    )
    rig = VllmRig(offload(64), layout="LBNHC", num_gpu_blocks=40)
    with pytest.raises(AssertionError, match="bytes? differs?"):
        _store_reset_load(rig, [prompt(1, 67)])


def test_a_translation_that_ignores_the_layout_is_caught(monkeypatch):
    """Treating LBNHC like LBHNC (split per head, no reorder) is refused at registration
    (the guard reports the connector's error; registration is not contained)."""
    from kvconnector_core.errors import ConnectorHookError
    from kvconnector_core.integrations.vllm import worker

    monkeypatch.setattr(
        worker,
        "block_dense_views",
        lambda name, t: {f"{name}#h{i}": t[:, i] for i in range(t.shape[1])},
    )
    with pytest.raises(ConnectorHookError, match="must be one contiguous chunk"):
        VllmRig(offload(64), layout="LBNHC", num_gpu_blocks=40)


# --------------------------------------------------------------------- benchmark
def test_benchmark_runs_and_checks_both_sides_did_the_same_work():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    run = subprocess.run(
        [
            sys.executable,
            str(root / "benchmarks" / "bench_vllm_adapter.py"),
            "--repeats",
            "1",
            "--requests",
            "40",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=root,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert (
        "| cpu_offload via KVConnectorAdapter |" in run.stdout and "Ratio ours / vLLM" in run.stdout
    )


def test_a_wrong_block_says_whose_bytes_it_holds():
    """The oracle names a known pattern in a wrong block: another TP shard's bytes for the
    same hash, another layer's, or zeros (never written)."""
    rig = VllmRig(offload(64), num_gpu_blocks=40, num_workers=2, check_every_step=False)
    rig.add(prompt(3, 67), max_tokens=8)
    for _ in range(3):
        rig.step()
    req = next(iter(rig.scheduler.running))
    block = rig.scheduler.kv_cache_manager.get_block_ids(req.request_id)[0][0]
    first, second = rig.layer_names[:2]
    cases = {
        "worker 1's bytes for this hash": lambda: rig.kv_caches[1][first][block].clone(),
        f"layer {second}'s bytes for this hash": lambda: rig.kv_caches[0][second][block].clone(),
        "zeros (never written)": lambda: torch.zeros_like(rig.kv_caches[0][first][block]),
    }
    good = rig.kv_caches[0][first][block].clone()
    for says, bytes_instead in cases.items():
        rig.kv_caches[0][first][block].copy_(bytes_instead())
        with pytest.raises(AssertionError, match=re.escape(f"it holds {says}")):
            rig.check_blocks()
        rig.kv_caches[0][first][block].copy_(good)
    rig.check_blocks()  # restored
    rig.run()
    rig.shutdown()
