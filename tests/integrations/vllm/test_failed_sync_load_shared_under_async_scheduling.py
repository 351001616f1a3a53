"""A synchronous load that fails while the next step, already scheduled under async
scheduling, hits the same blocks in vLLM's prefix cache (found by the vLLM fault sweep).

vLLM 0.33 caches a synchronous load's blocks when it allocates them. Under async
scheduling, step N+1 is scheduled before step N's output is processed, so a request that
arrives then takes the blocks step N is loading as a prefix-cache hit and computes its
tokens on them in step N+1. When step N reports the load's blocks invalid,
``Scheduler._update_requests_with_invalid_blocks`` rolls back the loading request and, as
the blocks are "already marked for recomputation" by it, leaves the sharing request's
computed tokens as they are: its step N+1 ran on the garbage the failed load left.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM 0.33 is not installed (make test-vllm)")

from _harness import VllmRig, prompt

from kvconnector_core.testing.vllm import adapter_config, with_faults

PLAIN = {"kvconnector": {"name": "PlainSyncConnector", "module_path": "_plain_sync_connector"}}


@pytest.mark.xfail(strict=True, reason="adapter: a failed synchronous load's blocks, hit in "
                   "the step vLLM scheduled before it learned of the failure (issue 21 sweep)")
def test_a_request_that_hit_a_failing_loads_blocks_in_the_step_in_flight_recomputes():
    config = with_faults(adapter_config(PLAIN), {"load_failure_rate": 1.0})
    rig = VllmRig.from_kv_transfer_config(config, num_gpu_blocks=40, async_scheduling=True,
                                          check_every_step=False, raise_on_wrong=False)
    prefix = prompt(61, 64)  # 4 blocks stored, then vLLM's prefix cache dropped
    rig.add(prefix + [7], max_tokens=1)
    rig.run()
    assert rig.scheduler.reset_prefix_cache()
    rig.wipe()
    loading = rig.add(prefix + prompt(62, 16), max_tokens=2)
    rig.step()  # schedules and runs step N: the synchronous load (it fails)
    sharing = rig.add(prefix + prompt(63, 7), max_tokens=2)
    update = rig._update  # noqa: SLF001 - check what vLLM keeps after each update

    def update_then_check(so, out):
        update(so, out)
        rig.check_blocks()

    rig._update = update_then_check  # noqa: SLF001
    rig.run(max_steps=200)
    assert rig.stats.scheduled_tokens[loading] >= 64 + 16, "the failed load was recomputed"
    assert rig.oracle.wrong == [], rig.oracle.wrong[0].describe()
    assert rig.stats.scheduled_tokens[sharing] >= 64 + 7, (
        "the sharing request computed its tokens on the failed load's blocks and kept them")
