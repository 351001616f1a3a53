"""cpu_offload under vLLM 0.33's hybrid KV cache manager (HMA).

The offload connector declares several KV cache groups
(``supports_multiple_kv_cache_groups``), so ``KVConnectorAdapterHMA`` runs it with HMA on:
vLLM keeps its hybrid allocator (a full-attention group and a sliding-window group
sharing one physical pool) and the connector offloads and loads both groups, only the
sliding-window group's in-window blocks, byte for byte into vLLM's tensors.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM 0.33 is not installed (make test-vllm)")

from _harness import (  # noqa: E402
    VllmRig,
    assert_no_leak,
    check_randomized_run,
    make_vllm_config,
    offload,
    prompt,
)

HMA = {"kv_connector": "KVConnectorAdapterHMA"}


def test_offload_keeps_vllms_hybrid_manager_on():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    cfg = make_vllm_config(offload(), hma=None, kv_transfer=HMA)  # vLLM's default: auto
    assert cfg.scheduler_config.disable_hybrid_kv_cache_manager is False
    assert KVConnectorFactory.supports_hma_config(cfg.kv_transfer_config)


@pytest.mark.parametrize("window", [40, 24])
def test_hybrid_loads_are_byte_exact_and_only_in_window(window):
    rig = VllmRig(offload(128), num_gpu_blocks=64, sliding_window=window, hma=True, kv_transfer=HMA)
    assert type(rig.scheduler.kv_cache_manager.coordinator).__name__ == "HybridKVCacheCoordinator"
    assert len(rig.kv_cache_config.kv_cache_groups) == 2
    prompts = [prompt(1, 99), prompt(2, 70)]
    for p in prompts:
        rig.add(p)
    rig.run()
    assert rig.scheduler.reset_prefix_cache() is True
    rig.wipe()  # only loads can bring the bytes back
    for p in prompts:
        rig.add(p)
    rig.run()
    # Hits end one block short of each prompt's end, at 96 and 64 tokens.
    assert rig.stats.hit_tokens == 96 + 64 and rig.stats.async_loads == 2
    # Full group: every block of the hit; sliding group: the blocks its window reaches
    # back to from the hit's end (vLLM allocates the null block for the others).
    window_blocks = sum(len(range((end - window + 1) // 16, end // 16)) for end in (96, 64))
    layers_per_group = 2
    assert rig.stats.loaded_layer_blocks_checked == (6 + 4 + window_blocks) * layers_per_group
    assert window_blocks < 6 + 4  # a partial load
    assert_no_leak(rig)
    rig.shutdown()


def test_hybrid_randomized_run_checks_every_block_of_both_groups_every_step():
    """Preemptions, async loads and prefix-cache drops under HMA; every full in-window
    block of both groups is checked byte for byte after every step."""
    rig = VllmRig(
        offload(48),
        layout="LHBNC",
        num_gpu_blocks=40,
        max_num_seqs=6,
        max_num_batched_tokens=64,
        sliding_window=40,
        hma=True,
        kv_transfer=HMA,
    )
    check_randomized_run(rig, seed=7, num_requests=64, min_layer_blocks=5_000)
