"""The guard's per-hook consequences (docs/failure-contract.md), one connector method at a time."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from kvconnector_core.connector import (
    KVConnectorBase_V1,
    KVConnectorConfig,
    KVConnectorMetadata,
    KVConnectorRole,
)
from kvconnector_core.connector.guard import (
    EVENT_SNAPSHOT_ATTEMPTS,
    MAX_PENDING_STEPS,
    GuardedScheduler,
    GuardedWorker,
)
from kvconnector_core.connector.metadata import KVConnectorOutput, KVConnectorTransferResults
from kvconnector_core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvconnector_core.request import Request
from kvconnector_core.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput


@pytest.fixture(autouse=True)
def _quiet(caplog):
    caplog.set_level(logging.CRITICAL)  # every contained raise is logged with a traceback


class Probe(KVConnectorBase_V1):
    """Records every call; ``fail`` maps a hook name to how many of its next calls raise."""

    name = "Probe"

    def __init__(self, role: KVConnectorRole = KVConnectorRole.SCHEDULER) -> None:
        super().__init__(KVConnectorConfig(name="Probe"), role)
        self.calls: list[tuple[str, Any]] = []
        self.fail: dict[str, int] = {}
        self.answer: Any = (4, True)

    def _rec(self, hook: str, arg: Any = None) -> None:
        self.calls.append((hook, arg))
        if self.fail.get(hook, 0) > 0:
            self.fail[hook] -= 1
            msg = f"injected: {hook}"
            raise RuntimeError(msg)

    def hooks(self) -> list[str]:
        return [h for h, _ in self.calls]

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self._rec("get_num_new_matched_tokens", request.request_id)
        return self.answer

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self._rec("update_state_after_alloc", request.request_id)

    def build_connector_meta(self, scheduler_output):
        self._rec("build_connector_meta", scheduler_output)
        return KVConnectorMetadata()

    def update_connector_output(self, connector_output):
        self._rec("update_connector_output", connector_output)

    def request_finished(self, request, block_ids):
        self._rec("request_finished", request.request_id)
        return True, {"k": 1}

    def forget_requests(self, request_ids):
        self._rec("forget_requests", set(request_ids))

    def plan_failed(self, connector_metadata, *, loads_failed, stores_failed):
        self._rec("plan_failed", (loads_failed, stores_failed))

    def bind_connector_metadata(self, connector_metadata):
        self._rec("bind_connector_metadata")
        super().bind_connector_metadata(connector_metadata)

    def handle_preemptions(self, connector_metadata):
        self._rec("handle_preemptions")

    def start_load_kv(self, forward_context=None):
        self._rec("start_load_kv")

    def wait_for_layer_load(self, layer_name):
        self._rec("wait_for_layer_load")

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata=None):
        self._rec("save_kv_layer")

    def wait_for_save(self):
        self._rec("wait_for_save")

    def get_block_ids_with_load_errors(self):
        self._rec("get_block_ids_with_load_errors")
        return {7}


def request(rid: str = "a") -> Request:
    return Request(rid, list(range(8)), 2, hash_block_size=4)


def output(
    new: tuple[str, ...] = (), cached: tuple[str, ...] = (), preempted: tuple[str, ...] = ()
) -> SchedulerOutput:
    so = SchedulerOutput.make_empty()
    so.scheduled_new_reqs = [NewRequestData(r, [1, 2], ([1],), 0) for r in new]
    so.scheduled_cached_reqs = CachedRequestData(
        list(cached), set(), [[] for _ in cached], [None for _ in cached], [4 for _ in cached]
    )
    so.num_scheduled_tokens = {r: 2 for r in (*new, *cached)}
    so.total_num_scheduled_tokens = 2 * len(new + cached)
    so.preempted_req_ids = set(preempted)
    return so


# ------------------------------------------------------------------ scheduler side


def test_lookup_raise_or_malformed_answer_is_a_miss():
    probe = Probe()
    guard = GuardedScheduler(probe)
    probe.fail["get_num_new_matched_tokens"] = 1
    assert guard.get_num_new_matched_tokens(request(), 0) == (0, False)
    probe.answer = "garbage"
    assert guard.get_num_new_matched_tokens(request(), 0) == (0, False)
    assert guard.errors == {"get_num_new_matched_tokens": 2}
    probe.answer = (None, True)
    assert guard.get_num_new_matched_tokens(request(), 0) == (None, False)  # ask again is kept


@pytest.mark.parametrize(
    ("answer", "safe"),
    [
        ((-4, True), (0, False)),
        ((0, True), (0, False)),
        ((4, 1), (4, True)),
        ((4, None), (4, False)),
    ],
)
def test_lookup_answer_is_normalized(answer, safe):
    """A negative hit is no hit, and an async load of nothing is no async load."""
    probe = Probe()
    probe.answer = answer
    assert GuardedScheduler(probe).get_num_new_matched_tokens(request(), 0) == safe


def test_failed_admission_forgets_the_request_and_detaches_it():
    probe = Probe()
    guard = GuardedScheduler(probe)
    probe.fail["update_state_after_alloc"] = 1
    assert guard.update_state_after_alloc(request(), None, 8) is False
    assert ("forget_requests", {"a"}) in probe.calls and guard.detached == {"a"}
    # A detached request is a miss without asking, and never shown in a plan again.
    probe.calls.clear()
    assert guard.get_num_new_matched_tokens(request(), 0) == (0, False)
    guard.build_connector_meta(output(new=("a", "b")))
    shown = probe.calls[-1][1]
    assert [n.req_id for n in shown.scheduled_new_reqs] == ["b"] and shown.num_scheduled_tokens == {
        "b": 2
    }
    assert "get_num_new_matched_tokens" not in probe.hooks()
    # request_finished still reaches it, and ends the detachment.
    assert guard.request_finished(request(), [1]) == (True, {"k": 1})
    assert not guard.detached


def test_failed_plan_forgets_the_steps_requests():
    """The requests of a failed plan are forgotten and hidden from later plans (otherwise
    offload would store wrong blocks under a hash after one failed plan)."""
    probe = Probe()
    guard = GuardedScheduler(probe)
    probe.fail["build_connector_meta"] = 1
    assert guard.build_connector_meta(output(new=("a",), cached=("b",), preempted=("c",))) is None
    assert ("forget_requests", {"a", "b", "c"}) in probe.calls
    guard.build_connector_meta(output(new=("d",), cached=("a", "b")))
    shown = probe.calls[-1][1]
    assert [n.req_id for n in shown.scheduled_new_reqs] == ["d"]
    assert shown.scheduled_cached_reqs.req_ids == [] and shown.total_num_scheduled_tokens == 2


def test_a_request_is_forgotten_once_however_often_it_fails():
    """A request already detached is not forgotten again: a second failed plan naming it
    asks the connector to forget only the requests it had not forgotten yet."""
    probe = Probe()
    guard = GuardedScheduler(probe)
    probe.fail["build_connector_meta"] = 2
    guard.build_connector_meta(output(new=("a",)))
    guard.build_connector_meta(output(cached=("a",), new=("b",)))
    forgets = [arg for hook, arg in probe.calls if hook == "forget_requests"]
    assert forgets == [{"a"}, {"b"}]


def test_a_report_the_connector_raised_on_is_delivered_again_first():
    """Nothing is lost when update_connector_output raises (no CPU slots stuck)."""
    probe = Probe()
    guard = GuardedScheduler(probe)
    first, second = (
        KVConnectorOutput(finished_sending={"x"}),
        KVConnectorOutput(finished_sending={"y"}),
    )
    probe.fail["update_connector_output"] = 1
    guard.update_connector_output(first)
    guard.update_connector_output(second)
    delivered = [arg for hook, arg in probe.calls if hook == "update_connector_output"]
    assert delivered == [first, first, second]
    assert guard.errors == {"update_connector_output": 1}


def test_plan_failures_in_the_report_reach_the_connector_before_the_report():
    probe = Probe()
    guard = GuardedScheduler(probe)
    plan = KVConnectorMetadata()
    guard.update_connector_output(KVConnectorOutput(loads_failed=True), plan)
    assert probe.hooks() == ["plan_failed", "update_connector_output"]
    assert probe.calls[0][1] == (True, False)


def test_request_finished_raising_frees_now_and_forgets_first():
    probe = Probe()
    guard = GuardedScheduler(probe)
    probe.fail["request_finished"] = 1
    assert guard.request_finished(request(), [1]) == (False, None)
    assert probe.hooks() == ["request_finished", "forget_requests"] and not guard.detached


class Events(Probe):
    """Holds blocks; take_events drains its queue and then may raise."""

    def __init__(self) -> None:
        super().__init__()
        self.held: set[int] = set()
        self.queue: list[Any] = []

    def store(self, h: int) -> None:
        self.held.add(h)
        self.queue.append(BlockStored([h], None, [], 4, None, "CPU", None))

    def remove(self, h: int) -> None:
        self.held.discard(h)
        self.queue.append(BlockRemoved([h], "CPU"))

    def take_events(self):
        events, self.queue = self.queue, []
        self._rec("take_events")
        return events

    def get_event_snapshot(self):
        self._rec("get_event_snapshot")
        return [
            AllBlocksCleared(),
            *(BlockStored([h], None, [], 4, None, "CPU", None) for h in sorted(self.held)),
        ]


def replay(events: list[Any], state: set[int]) -> set[int]:
    for ev in events:
        if isinstance(ev, AllBlocksCleared):
            state.clear()
        elif isinstance(ev, BlockStored):
            state.update(ev.block_hashes)
        else:
            state.difference_update(ev.block_hashes)
    return state


def test_events_lost_in_a_raising_take_events_are_replaced_by_a_snapshot():
    """take_events drained, then raised: a replica applying the stream stays exact."""
    conn = Events()
    guard = GuardedScheduler(conn)
    replica: set[int] = set()
    conn.store(1)
    conn.store(2)
    replay(guard.take_events(), replica)
    conn.remove(1)
    conn.store(3)
    conn.fail["take_events"] = 1
    replay(guard.take_events(), replica)
    assert replica == conn.held == {2, 3}
    conn.store(4)
    replay(guard.take_events(), replica)
    assert replica == {2, 3, 4} and guard.errors == {"take_events": 1}


def test_a_failed_snapshot_is_retried_in_the_same_call_without_draining():
    """A failed snapshot is retried in the same call, so the replica is never short for steps."""
    conn = Events()
    guard = GuardedScheduler(conn)
    conn.store(1)
    conn.fail.update(take_events=1, get_event_snapshot=EVENT_SNAPSHOT_ATTEMPTS - 1)
    assert replay(guard.take_events(), {99}) == {1}
    assert conn.hooks().count("take_events") == 1  # no drain: the snapshot supersedes the queue
    conn.store(5)
    assert replay(guard.take_events(), {1}) == {1, 5}


def test_a_snapshot_that_keeps_failing_clears_the_media_once_and_is_retried_later():
    """The stream says so: a replica holds nothing of the connector's media until the
    snapshot comes, never a block the connector may have dropped."""
    conn = Events()
    guard = GuardedScheduler(conn)
    guard.quarantine_after = None  # nine snapshot raises in a row would quarantine it
    conn.store(1)
    replica = replay(guard.take_events(), set())
    conn.remove(1)
    conn.store(2)
    conn.fail.update(take_events=1, get_event_snapshot=2 * EVENT_SNAPSHOT_ATTEMPTS + 1)
    gap = guard.take_events()
    assert [(type(e).__name__, e.medium) for e in gap] == [("AllBlocksCleared", "CPU")]
    assert replay(gap, replica) == set() and guard.errors["event_gap"] == 1
    conn.store(3)
    assert guard.take_events() == []  # still no snapshot: the gap marker is not repeated
    assert replay(guard.take_events(), replica) == {2, 3}
    assert guard.errors == {
        "take_events": 1,
        "get_event_snapshot": 2 * EVENT_SNAPSHOT_ATTEMPTS + 1,
        "event_gap": 1,
    }
    conn.store(4)
    assert replay(guard.take_events(), replica) == {2, 3, 4}


def test_pending_work_keeps_the_engine_stepping_for_at_most_max_pending_steps():
    """A connector that always has pending work keeps the engine stepping for exactly
    MAX_PENDING_STEPS asks in a row; a "no" in between starts the count again."""
    probe = Probe()
    probe.has_pending_work = lambda: True
    guard = GuardedScheduler(probe)
    assert all(guard.has_pending_work() for _ in range(MAX_PENDING_STEPS))
    assert guard.has_pending_work() is False
    probe.has_pending_work = lambda: False
    assert guard.has_pending_work() is False
    probe.has_pending_work = lambda: True
    assert guard.has_pending_work() is True


def test_bind_gpu_block_pool_is_not_contained():
    probe = Probe()
    probe.bind_gpu_block_pool = lambda pool: probe._rec("bind_gpu_block_pool")  # type: ignore[method-assign]
    probe.fail["bind_gpu_block_pool"] = 1
    with pytest.raises(RuntimeError, match="raised in bind_gpu_block_pool"):
        GuardedScheduler(probe).bind_gpu_block_pool(None)


# --------------------------------------------------------------------- worker side


def test_failed_bind_fails_the_steps_loads_and_stores_and_skips_its_plan_hooks():
    """A raise in bind does not deadlock the engine: the step is reported failed."""
    probe = Probe(KVConnectorRole.WORKER)
    guard = GuardedWorker(probe)
    guard.begin_step()
    probe.fail["bind_connector_metadata"] = 1
    plan = KVConnectorMetadata()
    assert guard.bind_connector_metadata(plan) is False
    guard.handle_preemptions(plan)
    guard.start_load_kv()
    guard.wait_for_layer_load("l0")
    guard.save_kv_layer("l0", None)
    guard.wait_for_save()
    assert probe.hooks() == ["bind_connector_metadata", "handle_preemptions"]
    assert guard.loads_failed and guard.stores_failed
    guard.begin_step()
    assert not (guard.loads_failed or guard.stores_failed)


@pytest.mark.parametrize(
    ("hook", "loads", "stores"),
    [
        ("handle_preemptions", False, True),
        ("start_load_kv", True, False),
        ("wait_for_layer_load", True, False),
        ("save_kv_layer", False, True),
        ("wait_for_save", False, True),
    ],
)
def test_worker_hook_raise_fails_the_right_transfers(hook, loads, stores):
    """In a step without synchronous loads (the forward reads no block being loaded)."""
    probe = Probe(KVConnectorRole.WORKER)
    guard = GuardedWorker(probe)
    guard.begin_step(sync_loads=False)
    probe.fail[hook] = 1
    plan = KVConnectorMetadata()
    assert guard.bind_connector_metadata(plan)
    guard.handle_preemptions(plan)
    guard.start_load_kv()
    guard.wait_for_layer_load("l0")
    guard.save_kv_layer("l0", None)
    guard.save_kv_layer("l1", None)
    guard.wait_for_save()
    assert (guard.loads_failed, guard.stores_failed) == (loads, stores)
    assert guard.errors == {hook: 1}
    assert "wait_for_save" in probe.hooks()  # the connector's end-of-step bookkeeping still runs
    if hook == "save_kv_layer":
        assert probe.hooks().count("save_kv_layer") == 1  # later layers skip the failed save


def test_unknown_load_errors_fail_the_steps_loads():
    probe = Probe(KVConnectorRole.WORKER)
    guard = GuardedWorker(probe)
    guard.begin_step()
    assert guard.get_block_ids_with_load_errors() == {7}
    probe.fail["get_block_ids_with_load_errors"] = 1
    assert guard.get_block_ids_with_load_errors() == set()
    assert guard.load_errors_unknown and guard.loads_failed


def test_a_repair_that_raises_is_retried_in_order_before_the_next_report():
    """plan_failed / forget_requests raising must not leave what the plan held (CPU slots)
    held for good: they are retried, in order, before the next report."""
    probe = Probe()
    guard = GuardedScheduler(probe)
    probe.fail["plan_failed"] = 1
    guard.update_connector_output(KVConnectorOutput(stores_failed=True), KVConnectorMetadata())
    assert "plan_failed" in probe.hooks() and guard.errors == {"plan_failed": 1}
    probe.calls.clear()
    probe.fail["forget_requests"] = 1
    probe.fail["request_finished"] = 1
    guard.request_finished(request("b"), [1])
    # The pending plan_failed ran first (now it succeeds); the forget raised and waits.
    assert probe.hooks() == ["request_finished", "plan_failed", "forget_requests"]
    assert guard.errors == {"plan_failed": 1, "request_finished": 1, "forget_requests": 1}
    probe.calls.clear()
    guard.update_connector_output(KVConnectorOutput())
    assert probe.hooks() == ["forget_requests", "update_connector_output"]


def test_finished_ids_a_raising_get_transfer_results_missed_are_passed_again():
    """Finished ids are passed again, so a delayed free is reported (no deadlock)."""
    seen: list[set[str]] = []
    probe = Probe(KVConnectorRole.WORKER)

    def results(finished_req_ids):
        seen.append(set(finished_req_ids))
        probe._rec("get_transfer_results")
        return KVConnectorTransferResults()

    probe.get_transfer_results = results  # type: ignore[method-assign]
    guard = GuardedWorker(probe)
    probe.fail["get_transfer_results"] = 1
    guard.get_transfer_results({"a"})
    guard.get_transfer_results({"b"})
    guard.get_transfer_results(set())
    assert seen == [{"a"}, {"a", "b"}, set()]


def test_failed_admission_is_counted():
    probe = Probe()
    probe.fail["update_state_after_alloc"] = 1
    guard = GuardedScheduler(probe)
    guard.update_state_after_alloc(request(), None, 0)
    assert guard.errors == {"update_state_after_alloc": 1}


def test_after_a_failed_layer_load_later_layers_are_not_waited_for():
    """Once a layer's load failed, the step's loads have failed: the other layers skip
    wait_for_layer_load (a broken load is not waited on layer after layer)."""
    probe = Probe(KVConnectorRole.WORKER)
    guard = GuardedWorker(probe)
    guard.begin_step()
    guard.bind_connector_metadata(KVConnectorMetadata())
    probe.fail["wait_for_layer_load"] = 1
    for layer in ("l0", "l1", "l2"):
        guard.wait_for_layer_load(layer)
    assert probe.hooks().count("wait_for_layer_load") == 1 and guard.loads_failed


def test_a_plan_that_could_not_be_cleared_keeps_the_worker_pending_until_cleared():
    """clear_connector_metadata raising leaves the plan bound: the worker side has pending
    work until a later clear succeeds."""
    probe = Probe(KVConnectorRole.WORKER)
    probe.clear_connector_metadata = lambda: probe._rec("clear_connector_metadata")  # type: ignore[method-assign]
    guard = GuardedWorker(probe)
    probe.fail["clear_connector_metadata"] = 1
    guard.clear_connector_metadata()
    assert guard.has_pending_work()
    guard.clear_connector_metadata()
    assert not guard.has_pending_work()


def test_a_detached_request_is_left_out_of_the_resumed_ids_too():
    probe = Probe()
    guard = GuardedScheduler(probe)
    guard.forget_requests({"a"})
    so = output(cached=("a", "b"))
    so.scheduled_cached_reqs.resumed_req_ids = {"a", "b"}
    guard.build_connector_meta(so)
    shown = probe.calls[-1][1].scheduled_cached_reqs
    assert shown.req_ids == ["b"] and shown.resumed_req_ids == {"b"}


def test_a_failed_receive_is_reported_only_with_its_finish():
    """failed_recving is the failed subset of finished_recving: a failure reported
    without its finish is dropped (the scheduler would wait on it forever otherwise)."""
    probe = Probe(KVConnectorRole.WORKER)
    probe.get_transfer_results = lambda finished: KVConnectorTransferResults(  # type: ignore[method-assign]
        finished_recving={"b"}, failed_recving={"a", "b"}
    )
    res = GuardedWorker(probe).get_transfer_results(set())
    assert res.finished_recving == {"b"} and res.failed_recving == {"b"}


def test_empty_worker_stats_are_no_stats():
    probe = Probe(KVConnectorRole.WORKER)
    probe.get_kv_connector_stats = lambda: {}  # type: ignore[method-assign]
    assert GuardedWorker(probe).get_kv_connector_stats() is None


@pytest.mark.parametrize("hook", ["start_load_kv", "wait_for_layer_load"])
def test_a_raising_sync_load_skips_the_steps_remaining_saves(hook):
    """In a step with synchronous loads the forward computes on the blocks being loaded:
    once a load raised, no later save reaches the connector and the stores fail."""
    probe = Probe(KVConnectorRole.WORKER)
    guard = GuardedWorker(probe)
    guard.begin_step(sync_loads=True)
    probe.fail[hook] = 1
    plan = KVConnectorMetadata()
    assert guard.bind_connector_metadata(plan)
    guard.start_load_kv()
    guard.wait_for_layer_load("l0")
    guard.save_kv_layer("l0", None)
    guard.wait_for_save()
    assert guard.loads_failed and guard.stores_failed
    assert "save_kv_layer" not in probe.hooks() and "wait_for_save" not in probe.hooks()


def test_a_reported_sync_load_error_skips_wait_for_save_and_is_still_reported():
    """Load errors are read before ``wait_for_save`` in a step with synchronous loads: a
    reported bad block fails the step's stores (never written), and the step's own
    ``get_block_ids_with_load_errors`` still returns it."""
    probe = Probe(KVConnectorRole.WORKER)
    guard = GuardedWorker(probe)
    probe.get_block_ids_with_load_errors = lambda: {7}
    guard.begin_step(sync_loads=True)
    assert guard.bind_connector_metadata(KVConnectorMetadata())
    guard.start_load_kv()
    guard.save_kv_layer("l0", None)
    guard.wait_for_save()
    assert guard.stores_failed and not guard.loads_failed
    assert "wait_for_save" not in probe.hooks()
    assert guard.get_block_ids_with_load_errors() == {7}


def test_without_sync_loads_load_errors_are_read_once_after_the_saves():
    """A step of asynchronous loads only: the forward reads no block being loaded, so the
    saves run and the load errors are read once, after them."""
    probe = Probe(KVConnectorRole.WORKER)
    guard = GuardedWorker(probe)
    guard.begin_step(sync_loads=False)
    assert guard.bind_connector_metadata(KVConnectorMetadata())
    guard.wait_for_save()
    guard.get_block_ids_with_load_errors()
    assert probe.hooks()[-2:] == ["wait_for_save", "get_block_ids_with_load_errors"]
    assert not guard.stores_failed
