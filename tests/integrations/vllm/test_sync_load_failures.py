"""A synchronous load that fails by raising, under vLLM 0.33's own Scheduler.

The disk example loads synchronously (its blocks are read in ``start_load_kv``, before
the forward). When a worker hook raises in a step with such a load, the blocks it was
writing hold whatever was there before. vLLM must learn it in that same step, as invalid
blocks, or it counts the garbage as computed, and the request (and every later request
that hits those blocks in vLLM's prefix cache) runs on it.

Blocks are checked after every ``update_from_output``: by then vLLM has rolled a request
whose load failed back to its first bad block, so every block below a running request's
computed tokens must hold what the model wrote for its hash.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM 0.33 is not installed (make test-vllm)")

from _harness import VllmRig, assert_no_leak, prompt  # noqa: E402

from kvconnector_core.testing.vllm import adapter_config, with_faults  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[3] / "examples" / "disk_connector"))

LOAD_HOOKS = ("bind_connector_metadata", "start_load_kv", "wait_for_layer_load")


def _disk(path: Path) -> dict:
    return {"kvconnector": {"name": "DiskConnector", "module_path": "disk_connector.connector",
                            "extra_config": {"path": str(path)}}}


def _raise_once_in_a_step_with_loads(rig: VllmRig, hook: str) -> list[int]:
    """Make ``hook`` of the worker's wrapped connector raise once, in the first step whose
    plan carries loads; returns a list that gets the step's number when it raised."""
    worker = rig.workers[0]
    inner = worker.worker_side.guard.connector  # the wrapped DiskConnector
    raised: list[int] = []
    forward = getattr(inner, hook)

    def raising(*args, **kwargs):
        plan = args[0] if hook == "bind_connector_metadata" else inner.get_connector_metadata()
        if not raised and plan is not None and plan.loads:
            raised.append(rig.stats.steps)
            raise RuntimeError(f"injected: {hook} failed")
        return forward(*args, **kwargs)

    setattr(inner, hook, raising)
    return raised


def _check_after_each_update(rig: VllmRig) -> None:
    """Check every running request's computed blocks right after each
    ``update_from_output`` (with async scheduling, a step's output is processed a step
    after it was scheduled)."""
    update = rig._update  # noqa: SLF001

    def update_then_check(so, out):
        update(so, out)
        rig.check_blocks()

    rig._update = update_then_check  # noqa: SLF001


def _stored_prefix(rig: VllmRig, prefix: list[int]) -> None:
    """Store ``prefix`` on disk, then empty vLLM's prefix cache and zero every KV byte:
    only a load can bring the prefix's bytes back."""
    rig.add(prefix + [7], max_tokens=1)
    rig.run()
    assert rig.scheduler.reset_prefix_cache() is True
    rig.wipe()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync-sched", "async-sched"])
@pytest.mark.parametrize("hook", LOAD_HOOKS)
def test_a_raising_synchronous_load_is_recomputed_not_served(tmp_path, hook, async_scheduling):
    """Under ``recompute``: the request whose load raised recomputes the prefix (it is
    scheduled for every token), finishes, and its blocks and those a later request hits
    hold the model's bytes."""
    rig = VllmRig(_disk(tmp_path), layout="BLHNC", num_gpu_blocks=40,
                  async_scheduling=async_scheduling, check_every_step=False)
    prefix = prompt(61, 64)  # 4 blocks on disk
    _stored_prefix(rig, prefix)
    raised = _raise_once_in_a_step_with_loads(rig, hook)
    _check_after_each_update(rig)
    rid = rig.add(prefix + prompt(62, 20), max_tokens=3)
    rig.run(max_steps=500)
    assert raised, "the test needs a step with a synchronous load"
    assert rig.status(rid) == "FREED" and len(rig.stats.outputs[rid]) == 3
    # the failed load's 64 tokens were computed, not taken from garbage
    assert rig.stats.scheduled_tokens[rid] >= 64 + 20 + 2
    later = rig.add(prefix + prompt(63, 5), max_tokens=1)  # hits the recomputed prefix
    rig.run(max_steps=500)
    assert rig.stats.scheduled_tokens[later] == 5
    assert_no_leak(rig)
    rig.shutdown()


@pytest.mark.parametrize("hook", ["bind_connector_metadata", "start_load_kv"])
def test_a_raising_synchronous_load_fails_its_request_under_the_fail_policy(tmp_path, hook):
    """Under vLLM's default ``fail``: the request whose load raised ends with an error,
    and its blocks are evicted, so a later request with the same prefix does not hit
    the garbage in vLLM's prefix cache."""
    rig = VllmRig(_disk(tmp_path), layout="BLHNC", num_gpu_blocks=40, check_every_step=False,
                  load_failure_policy="fail")
    prefix = prompt(61, 64)
    _stored_prefix(rig, prefix)
    raised = _raise_once_in_a_step_with_loads(rig, hook)
    _check_after_each_update(rig)
    rid = rig.add(prefix + prompt(62, 20), max_tokens=3)
    rig.run(max_steps=500)
    assert raised, "the test needs a step with a synchronous load"
    assert rig.status(rid) == "FREED" and len(rig.stats.outputs.get(rid, [])) < 3
    later = rig.add(prefix + prompt(63, 5), max_tokens=1)  # loads the prefix from disk again
    rig.run(max_steps=500)
    assert rig.status(later) == "FREED" and len(rig.stats.outputs[later]) == 1
    assert_no_leak(rig)
    rig.shutdown()


PLAIN = {"kvconnector": {"name": "PlainSyncConnector", "module_path": "_plain_sync_connector"}}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync-sched", "async-sched"])
def test_a_connector_without_failure_handling_never_serves_stores_built_on_a_failed_load(
        async_scheduling):
    """A synchronous load raises while its request's prefill continues for another step.
    The stores of that step, and under async scheduling those of the step vLLM scheduled
    before it learned of the failure, hold KV computed on blocks never loaded; the
    connector has no code to drop them, so none of them may reach it. A later request
    that loads the whole prompt must get the model's bytes."""
    rig = VllmRig(PLAIN, num_gpu_blocks=64, async_scheduling=async_scheduling,
                  check_every_step=False)
    prefix = prompt(61, 64)
    _stored_prefix(rig, prefix)
    raised = _raise_once_in_a_step_with_loads(rig, "start_load_kv")
    _check_after_each_update(rig)
    long_prompt = prefix + prompt(62, 300)  # a prefill of two steps after the load
    rig.add(long_prompt, max_tokens=2)
    rig.run(max_steps=500)
    assert raised, "the test needs a step with a synchronous load"
    assert rig.scheduler.reset_prefix_cache() is True
    rig.wipe()
    later = rig.add(long_prompt + [9], max_tokens=1)  # loads every stored block
    rig.run(max_steps=500)
    assert rig.status(later) == "FREED"
    assert_no_leak(rig)
    rig.shutdown()


def test_under_async_scheduling_nothing_computed_on_a_failed_load_is_stored():
    """vLLM's async scheduling plans step N+1 before it processes step N's output. A
    request whose synchronous load fails in step N must not compute on the failed blocks
    in step N+1 and store the result: every block the connector (which has no failure
    handling of its own) stores afterwards holds what the model wrote for its hash, so a
    later request loads the whole prompt, byte-checked."""
    rig = VllmRig(PLAIN, num_gpu_blocks=64, async_scheduling=True, check_every_step=False)
    prefix = prompt(61, 64)
    _stored_prefix(rig, prefix)
    raised = _raise_once_in_a_step_with_loads(rig, "start_load_kv")
    longer = prefix + prompt(62, 300)  # two prefill steps after the load
    rig.add(longer, max_tokens=2)
    rig.run(max_steps=500)
    assert raised
    assert rig.scheduler.reset_prefix_cache() is True
    rig.wipe()
    rig.check_every_step = True  # raises on a wrong byte in any loaded block
    again = rig.add(longer + [9], max_tokens=1)
    rig.run(max_steps=500)
    full = len(longer) // 16 * 16
    assert rig.stats.scheduled_tokens[again] == len(longer) + 1 - full
    assert_no_leak(rig)
    rig.shutdown()


def test_a_load_that_always_fails_by_block_is_recomputed_not_retried():
    """Load errors reported by block (not as a failed receive) fail the request's load:
    vLLM frees a receive that loaded nothing and admits the request again, and the adapter
    then answers "no hit", so a tier whose every load fails cannot keep it waiting."""
    config = with_faults(adapter_config(PLAIN), {"load_failure_rate": 1.0})
    rig = VllmRig.from_kv_transfer_config(config, num_gpu_blocks=40, check_every_step=False)
    _stored_prefix(rig, prompt(61, 64))
    rid = rig.add(prompt(61, 64) + prompt(62, 16), max_tokens=2)
    rig.run(max_steps=200)
    assert len(rig.stats.outputs[rid]) == 2
    assert rig.stats.scheduled_tokens[rid] == 64 + 16 + 1
    assert_no_leak(rig)
    rig.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync-sched", "async-sched"])
def test_a_synchronous_load_failing_on_one_of_two_workers_is_recomputed(async_scheduling):
    """Two TP workers; one worker's ``start_load_kv`` raises in the step with the load. The
    worker reports the receive failed, the other received: vLLM takes the receive as failed
    (any worker's failure counts) and recomputes, and no worker's blocks are served wrong."""
    rig = VllmRig(PLAIN, num_gpu_blocks=64, num_workers=2, async_scheduling=async_scheduling,
                  check_every_step=False)
    prefix = prompt(61, 64)
    _stored_prefix(rig, prefix)
    inner = rig.workers[1].worker_side.guard.connector
    start_load_kv, raised = inner.start_load_kv, []

    def raising_once(*args, **kwargs):
        if not raised and inner.get_connector_metadata().loads:
            raised.append(rig.stats.steps)
            raise RuntimeError("injected: start_load_kv failed on worker 1")
        return start_load_kv(*args, **kwargs)

    inner.start_load_kv = raising_once
    _check_after_each_update(rig)
    rid = rig.add(prefix + prompt(62, 20), max_tokens=2)
    rig.run(max_steps=500)
    assert raised
    assert len(rig.stats.outputs[rid]) == 2
    assert rig.stats.scheduled_tokens[rid] == 64 + 20 + 1  # the failed load recomputed
    assert_no_leak(rig)
    rig.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync-sched", "async-sched"])
def test_a_load_planned_when_its_request_is_scheduled_is_caught(async_scheduling):
    """A connector that emits a synchronous load only once its request appears in
    ``scheduled_new_reqs`` (vLLM's ExampleConnector style) loads a step late behind the
    adapter, after the request computed on the unloaded blocks: the rig's stub model
    writes wrong KV for those tokens, and the check names the block."""
    late = {"kvconnector": {"name": "LatePlanningConnector",
                            "module_path": "_late_planning_connector"}}
    rig = VllmRig(late, num_gpu_blocks=64, async_scheduling=async_scheduling,
                  raise_on_wrong=False)
    prefix = prompt(61, 64)
    _stored_prefix(rig, prefix)
    rig.add(prefix + prompt(62, 20), max_tokens=4)
    report = rig.check()
    assert not report.ok and report.wrong_bytes_other > 0
    assert report.first_bad_block is not None and "block #4" in report.first_bad_block


def test_the_same_connector_planning_at_admission_passes():
    """The same connector with its load in the plan right after ``update_state_after_alloc``
    (the documented shape) passes the same check."""
    rig = VllmRig(PLAIN, num_gpu_blocks=64, raise_on_wrong=False)
    prefix = prompt(61, 64)
    _stored_prefix(rig, prefix)
    rig.add(prefix + prompt(62, 20), max_tokens=4)
    report = rig.check()
    assert report.ok, report.format()
    assert report.loaded_layer_blocks_checked > 0
