"""Scheduler-side hooks raising around a planned load, under vLLM 0.33's own Scheduler.

When the connector's ``build_connector_meta`` raises in a step that admitted an
asynchronous load, vLLM is told the receive failed and frees (or reuses) the request's
blocks; the connector must then never run that load, or it writes into blocks another
request owns. When ``update_state_after_alloc`` raises while a synchronous load is planned,
the load's blocks (not the blocks the step computes) must be reported invalid.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM 0.33 is not installed (make test-vllm)")

from _harness import VllmRig, assert_no_leak, offload, prompt  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[3] / "examples" / "disk_connector"))


def _scheduler_connector(rig: VllmRig):
    """The connector the scheduler-side adapter wraps."""
    return rig.connector.scheduler_side.guard.connector


def _check_after_each_update(rig: VllmRig) -> None:
    update = rig._update  # noqa: SLF001

    def update_then_check(so, out):
        update(so, out)
        rig.check_blocks()

    rig._update = update_then_check  # noqa: SLF001


def test_an_async_load_whose_plan_failed_never_writes_into_reused_blocks():
    """The plan of the step that admitted an asynchronous CPU hit fails: vLLM recomputes
    the request (a failed receive) and gives its blocks to others; the load never runs."""
    rig = VllmRig(offload(64), num_gpu_blocks=24, check_every_step=False)
    first = prompt(81, 64 + 3)
    rig.add(first, max_tokens=1)
    rig.run()
    assert rig.scheduler.reset_prefix_cache() is True
    rig.wipe()
    inner = _scheduler_connector(rig)
    forward_alloc, forward_build = inner.update_state_after_alloc, inner.build_connector_meta
    armed: list[str] = []

    def note(request, blocks, num_external_tokens):
        forward_alloc(request, blocks, num_external_tokens)
        if num_external_tokens:
            armed.append(request.request_id)

    def build(scheduler_output):
        if armed and armed[0] != "done":
            armed[:] = ["done"]
            raise RuntimeError("injected: build_connector_meta failed")
        return forward_build(scheduler_output)

    inner.update_state_after_alloc, inner.build_connector_meta = note, build
    _check_after_each_update(rig)
    rid = rig.add(first, max_tokens=2)  # an async CPU hit whose plan fails
    others = [rig.add(prompt(90 + i, 40), max_tokens=8) for i in range(3)]  # reuse blocks
    rig.run(max_steps=500)
    assert armed == ["done"], "the test needs a failed plan over an async load"
    assert all(rig.status(r) == "FREED" for r in [rid, *others])
    assert_no_leak(rig)
    rig.shutdown()


def _disk(path: Path) -> dict:
    return {"kvconnector": {"name": "DiskConnector", "module_path": "disk_connector.connector",
                            "extra_config": {"path": str(path)}}}


@pytest.mark.parametrize(("hook", "async_scheduling"), [
    ("update_state_after_alloc", False), ("update_state_after_alloc", True),
    ("build_connector_meta", False)], ids=["alloc-sync-sched", "alloc-async-sched", "build"])
def test_a_sync_load_whose_planning_raised_reports_the_loads_blocks(tmp_path, hook,
                                                                      async_scheduling):
    """vLLM hashes a synchronous load's blocks before ``update_state_after_alloc``; when
    planning the load raises, the blocks the load would have written are the ones to
    report invalid, so vLLM recomputes them instead of serving the zeros there."""
    rig = VllmRig(_disk(tmp_path), layout="BLHNC", num_gpu_blocks=40,
                  async_scheduling=async_scheduling, check_every_step=False)
    prefix = prompt(61, 64)
    rig.add(prefix + [7], max_tokens=1)
    rig.run()
    assert rig.scheduler.reset_prefix_cache() is True
    rig.wipe()
    inner = _scheduler_connector(rig)
    forward = getattr(inner, hook)
    raised: list[str] = []

    def raising(*args):
        loads = args[2] if hook == "update_state_after_alloc" else len(inner._plan.loads)  # noqa: SLF001
        if loads and not raised:
            raised.append(hook)
            raise RuntimeError(f"injected: {hook} failed")
        return forward(*args)

    setattr(inner, hook, raising)
    _check_after_each_update(rig)
    rid = rig.add(prefix + prompt(62, 20), max_tokens=2)
    rig.run(max_steps=500)
    assert raised == [hook]
    assert rig.status(rid) == "FREED" and len(rig.stats.outputs[rid]) == 2
    assert_no_leak(rig)
    rig.shutdown()
