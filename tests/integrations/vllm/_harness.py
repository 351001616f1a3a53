"""The vLLM suite's rig: re-exports :mod:`kvconnector_core.testing.vllm`, plus one check.

Primitives: :func:`check_randomized_run` (the rest is the public rig's).
"""

from __future__ import annotations

from kvconnector_core.integrations.vllm.cpu_config import make_vllm_config
from kvconnector_core.testing.vllm import (
    LAYOUTS,
    Stats,
    VllmRig,
    assert_no_leak,
    connector,
    multi,
    offload,
    prompt,
    randomized,
)
from kvconnector_core.testing.vllm.model import EOS

__all__ = ["EOS", "LAYOUTS", "Stats", "VllmRig", "assert_no_leak", "check_randomized_run",
           "connector", "make_vllm_config", "multi", "offload", "prompt", "randomized"]


def check_randomized_run(rig: VllmRig, seed: int, num_requests: int, min_layer_blocks: int) -> None:
    """:func:`randomized`, then check that it finished everything with preemptions,
    async loads and hits, byte-checked at least ``min_layer_blocks`` layer-blocks (some
    of them loaded), leaked no block; shuts the rig down."""
    randomized(rig, seed=seed, num_requests=num_requests)
    s = rig.stats
    assert s.finished == num_requests
    assert s.preemptions > 0 and s.async_loads > 0 and s.hit_tokens > 0
    assert s.layer_blocks_checked >= min_layer_blocks, s.layer_blocks_checked
    assert s.loaded_layer_blocks_checked > 0
    assert_no_leak(rig)
    rig.shutdown()
