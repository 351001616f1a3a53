"""Regression tests for adapter defects found in review, under vLLM 0.33's own Scheduler."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM 0.33 is not installed (make test-vllm)")

from _harness import VllmRig, assert_no_leak, offload, prompt  # noqa: E402


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_reused_request_id_gets_its_delayed_free_reported_again(async_scheduling):
    """vLLM's scheduler takes a request id again once the first request with it is gone
    (``Scheduler.add_request`` only checks ``self.requests``). The adapter reports each
    send once; the second request's send must still reach vLLM, or its blocks are
    never freed and vLLM waits for it forever."""
    rig = VllmRig(offload(64), num_gpu_blocks=40, async_scheduling=async_scheduling)
    for seed in (1, 2, 3):  # three incarnations of the same id, each a new prompt (a store)
        rig.add(prompt(seed, 67), max_tokens=2, request_id="same-id")
        delayed = False
        for _ in range(200):
            if not (rig.scheduler.has_requests() or rig._in_flight):  # noqa: SLF001
                break
            rig.step()
            delayed |= rig.connector.has_pending_block_frees()
        assert delayed, "the test needs a free the connector delays for its store"
        assert rig.status("same-id") == "FREED"
        assert_no_leak(rig)
    rig.shutdown()
