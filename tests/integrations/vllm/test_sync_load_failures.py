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
    assert rig.stats.scheduled_tokens[rid] >= 20 + 64 + 20 + 2
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


def test_under_async_scheduling_the_step_planned_before_a_failed_load_was_known_saves_nothing():
    """vLLM's async scheduling plans step N+1 before it processes step N's output. When a
    synchronous load fails in step N, step N+1 still computes its request on the failed
    blocks (its rollback comes later), so neither step's saves may reach the connector;
    the first step planned after the failure's report saves again."""
    rig = VllmRig(PLAIN, num_gpu_blocks=64, async_scheduling=True, check_every_step=False)
    prefix = prompt(61, 64)
    _stored_prefix(rig, prefix)
    raised = _raise_once_in_a_step_with_loads(rig, "start_load_kv")
    inner = rig.workers[0].worker_side.guard.connector
    saves: list[tuple[int, int]] = []  # (step, blocks planned to store) of each call
    forward = inner.wait_for_save

    def counting_wait_for_save():
        saves.append((rig.stats.steps, len(inner.get_connector_metadata().stores)))
        forward()

    inner.wait_for_save = counting_wait_for_save
    planned: dict[int, int] = {}  # step -> blocks its plan stores
    bind = inner.bind_connector_metadata

    def recording_bind(plan):
        planned[rig.stats.steps] = len(plan.stores)
        bind(plan)

    inner.bind_connector_metadata = recording_bind
    rig.add(prefix + prompt(62, 300), max_tokens=2)  # two prefill steps after the load
    rig.run(max_steps=500)
    assert raised
    failed_step = raised[0]
    assert [s for s, _ in saves if s in (failed_step, failed_step + 1)] == []
    assert any(s > failed_step + 1 for s, _ in saves), "saves resume after the report"
    assert planned[failed_step + 1] > 0, "the test needs stores planned in the step after"
    assert_no_leak(rig)
    rig.shutdown()
