"""Under async scheduling a MultiConnector child's failure reaches its own step's plan.

Not the plan of the last step built, i.e. of step N+1 when step N's report comes back
after N+1's plan (vLLM's async scheduling): for cpu_offload that would unpin step N+1's
loads while the worker still ran them, and never release step N's.
"""

from __future__ import annotations

from connectors.multi import MultiKVConnectorWorkerMetadata
from kvconnector_core.connector import KVConnectorOutput
from kvconnector_core.testing import empty_scheduler_output

from tests.connectors.multi.test_multi_connector import child, multi


def test_childs_failure_reaches_its_own_steps_plan() -> None:
    sched = multi(child(), child())
    first = sched.children[0]
    built: list[object] = []
    real_build = first.build_connector_meta

    def build(so):  # record the child's plan of each step
        plan = real_build(so)
        built.append(plan)
        return plan

    first.build_connector_meta = build  # type: ignore[method-assign]
    failed: list[object] = []
    def plan_failed(plan, *, loads_failed, stores_failed):
        failed.append(plan)
    first.plan_failed = plan_failed  # type: ignore[method-assign]
    plan_n = sched.build_connector_meta(empty_scheduler_output())  # step N
    sched.build_connector_meta(empty_scheduler_output())  # step N+1, before N's report
    assert len(built) == 2 and built[0] is not built[1]
    # The worker side echoes the step of the plan it reports on.
    report_n = MultiKVConnectorWorkerMetadata((None, None), loads_failed=(0,), step=plan_n.step)
    sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=report_n))
    assert len(failed) == 1
    assert failed[0] is built[0]
