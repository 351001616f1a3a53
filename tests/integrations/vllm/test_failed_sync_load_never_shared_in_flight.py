"""A synchronous load that fails while the next step, already scheduled under async
scheduling, could hit the same blocks in vLLM's prefix cache.

vLLM 0.33 caches a synchronous load's blocks when it allocates them. Under async
scheduling, step N+1 is scheduled before step N's output is processed, so a request that
arrives then would take the blocks step N is loading as a prefix-cache hit and compute its
tokens on them in step N+1; when step N reports the blocks invalid,
``Scheduler._update_requests_with_invalid_blocks`` rolls back the loading request but, as
the blocks are "already marked for recomputation" by it, keeps the sharing request's
tokens. The adapter presents every load to vLLM as a receive, whose blocks are cached only
once it is reported, so no request can hit a load in flight.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM 0.33 is not installed (make test-vllm)")

from _harness import VllmRig, prompt

from kvconnector_core.testing.vllm import adapter_config

PLAIN = {"kvconnector": {"name": "PlainSyncConnector", "module_path": "_plain_sync_connector"}}


def test_no_request_computes_on_a_failing_synchronous_load_in_flight():
    rig = VllmRig.from_kv_transfer_config(adapter_config(PLAIN), num_gpu_blocks=40,
                                          async_scheduling=True, check_every_step=False)
    prefix = prompt(61, 64)  # 4 blocks stored, then vLLM's prefix cache dropped
    rig.add(prefix + [7], max_tokens=1)
    rig.run()
    assert rig.scheduler.reset_prefix_cache()
    rig.wipe()  # a load that does not run leaves zeros
    inner = rig.workers[0].worker_side.guard.connector
    start_load_kv, raised = inner.start_load_kv, []

    def raising_once(*args, **kwargs):
        if not raised and inner.get_connector_metadata().loads:
            raised.append(rig.stats.steps)
            raise RuntimeError("injected: start_load_kv failed")
        return start_load_kv(*args, **kwargs)

    inner.start_load_kv = raising_once
    loading = rig.add(prefix + prompt(62, 16), max_tokens=2)
    rig.step()  # schedules and runs step N: the synchronous load (it raises)
    sharing = rig.add(prefix + prompt(63, 7), max_tokens=2)
    update = rig._update  # noqa: SLF001 - check what vLLM keeps after each update

    def update_then_check(so, out):
        update(so, out)
        rig.check_blocks()  # raises on a wrong byte in a block a running request computed

    rig._update = update_then_check  # noqa: SLF001
    rig.run(max_steps=200)
    assert raised, "the test needs a step whose load raised"
    assert rig.stats.scheduled_tokens[loading] >= 64 + 16, "the failed load was recomputed"
    assert len(rig.stats.outputs[sharing]) == 2 and len(rig.stats.outputs[loading]) == 2
