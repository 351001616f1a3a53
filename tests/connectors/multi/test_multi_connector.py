"""MultiConnector: loader choice, fan-out, completions, failures, stats, events, shutdown."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from connectors.multi import (
    ChildConfig,
    FirstHitPolicy,
    LongestHitPolicy,
    MultiConnector,
    MultiKVConnectorWorkerMetadata,
    MultiSettings,
)
from kvconnector_core.connector import (
    ConnectorRegistry,
    KVConnectorConfig,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    check_metadata_roundtrip,
)
from kvconnector_core.errors import ConfigError, ConnectorHookError, ShutdownError
from kvconnector_core.kv_events import AllBlocksCleared, BlockRemoved
from kvconnector_core.testing import (
    ConnectorContract,
    RecordingConnector,
    empty_scheduler_output,
    make_block_pool,
    make_kv_cache_config,
    make_kv_cache_manager,
    make_request,
)

REC_PATH = "kvconnector_core.testing.recording"


class SlowSender(RecordingConnector):
    """Reports a delayed send ``send_delay`` get_finished calls after it could."""

    name = "SlowSender"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._countdown: dict[str, int] = {}

    def get_finished(self, finished_req_ids):
        sending, recving = super().get_finished(finished_req_ids)
        for req in sending or ():
            self._countdown[req] = self._config.extra_config.get("send_delay", 1)
        done = set()
        for req in list(self._countdown):
            self._countdown[req] -= 1
            if self._countdown[req] < 0:
                done.add(req)
                del self._countdown[req]
        return done or None, recving


class FailedReceiver(RecordingConnector):
    """Reports each of its asynchronous loads as a failed receive."""

    name = "FailedReceiver"

    def get_transfer_results(self, finished_req_ids):
        results = super().get_transfer_results(finished_req_ids)
        results.failed_recving |= results.finished_recving
        return results


class WorkerPending(RecordingConnector):
    """A worker side with tier events of its own and, if told, work still pending."""

    name = "WorkerPending"

    def get_kv_connector_kv_cache_events(self):
        return [BlockRemoved([self._config.extra_config["tag"]], "DISK")]

    def has_pending_work(self):
        return bool(self._config.extra_config.get("pending", False))


class Raising(RecordingConnector):
    """Raises from the hooks named in extra_config['raise_in']."""

    name = "Raising"

    def __getattribute__(self, attr: str) -> Any:
        if attr in object.__getattribute__(self, "_config").extra_config.get("raise_in", ()):
            def boom(*args, **kwargs):
                raise RuntimeError(f"{attr} exploded")
            return boom
        return object.__getattribute__(self, attr)


class Evented(RecordingConnector):
    """Emits events, load errors and stats."""

    name = "Evented"

    def take_events(self):
        return [BlockRemoved([self._config.extra_config["tag"]], "CPU")]

    def get_block_ids_with_load_errors(self):
        return set(self._config.extra_config.get("errors", ()))


class OtherMeta(KVConnectorMetadata):
    """A different metadata type, to check heterogeneous children survive msgpack."""

    numbers: list[int] = msgspec.field(default_factory=lambda: [1, 2, 3])


class OtherMetaConnector(RecordingConnector):
    """A child with its own metadata type."""

    name = "OtherMeta"
    metadata_type = OtherMeta

    def build_connector_meta(self, scheduler_output):
        super().build_connector_meta(scheduler_output)
        return OtherMeta()


class WrongMetaType(RecordingConnector):
    """Returns metadata of a type it does not declare."""

    name = "WrongMetaType"

    def build_connector_meta(self, scheduler_output):
        return OtherMeta()


REGISTRY = ConnectorRegistry()
for _cls in (RecordingConnector, SlowSender, FailedReceiver, WorkerPending, Raising, Evented,
             OtherMetaConnector, WrongMetaType):
    REGISTRY.add(_cls)


def child(name: str = "RecordingConnector", **extra: Any) -> dict[str, Any]:
    return {"name": name, "extra_config": extra}


def multi(*children: dict[str, Any], role=KVConnectorRole.SCHEDULER,
          **extra: Any) -> MultiConnector:
    # Distinct engine ids: identical children are rejected (they would store everything twice).
    children = tuple({"engine_id": f"child-{i}", **c} for i, c in enumerate(children))
    cfg = KVConnectorConfig(name="MultiConnector",
                            extra_config={"connectors": list(children), **extra})
    return MultiConnector(cfg, role, make_kv_cache_config(), registry=REGISTRY)


def pair(*children, **extra):
    return multi(*children, **extra), multi(*children, role=KVConnectorRole.WORKER, **extra)


class TestMultiContract(ConnectorContract):
    """MultiConnector with heterogeneous children passes the contract (built through the
    default registry)."""

    connector_config = KVConnectorConfig(name="MultiConnector", extra_config={"connectors": [
        {"name": "RecordingConnector", "module_path": REC_PATH},
        {"name": "OtherMetaConnector", "module_path": __name__},
    ]})


def admit(sched, manager, request):
    """Lookup, allocate (external tokens included), update_state_after_alloc; return the lookup."""
    _, local = manager.get_computed_blocks(request)
    hit = sched.get_num_new_matched_tokens(request, local)
    ext = hit[0] or 0
    assert manager.allocate_slots(request, request.num_tokens - local - ext,
                                  num_external_computed_tokens=ext)
    sched.update_state_after_alloc(request, manager.get_blocks(request.request_id), ext)
    return hit


def step(sched, worker, finished=()):
    """One empty engine step through msgpack; return (transfer results, load errors)."""
    out = empty_scheduler_output()
    out.finished_req_ids = set(finished)
    meta = check_metadata_roundtrip(sched.build_connector_meta(out))
    worker.bind_connector_metadata(meta)
    worker.start_load_kv()
    worker.wait_for_save()
    res = worker.get_transfer_results(out.finished_req_ids)
    errors = worker.get_block_ids_with_load_errors()
    worker.clear_connector_metadata()
    return res, errors


@pytest.mark.parametrize(("hits", "policy", "winner"), [
    ((4, 8, 8), "longest", 1), ((8, 4, 0), "longest", 0), ((0, 0, 0), "longest", None),
    ((0, 4, 8), "first", 1),
], ids=["longest-tie-earlier", "longest-first", "all-miss", "first-hit"])
def test_loader_choice_and_others_get_zero(hits, policy, winner):
    """The policy picks the loader; it gets the external tokens, the others 0, all the same
    blocks."""
    sched = multi(*(child(hit_tokens=h) for h in hits), loader_policy=policy)
    manager = make_kv_cache_manager()
    request = make_request(17)
    n, _ = admit(sched, manager, request)
    assert n == (hits[winner] if winner is not None else 0)
    block_ids = manager.get_block_ids(request.request_id)
    for i, c in enumerate(sched.children):
        ((_, (rid, blocks, ext)),) = [
            call for call in c.calls if call[0] == "update_state_after_alloc"]
        assert (rid, blocks) == (request.request_id, block_ids)
        assert ext == (n if i == winner else 0)


def test_policy_objects_and_unknown_policy():
    """Policies are plain objects; an unknown name is a ConfigError listing the known ones."""
    assert LongestHitPolicy().select([(3, False), (5, True), (5, False)]) == 1
    assert FirstHitPolicy().select([(0, False), (2, True)]) == 1
    with pytest.raises(ConfigError, match="first"):
        multi(child(), loader_policy="random")


def test_undecided_child_makes_multi_undecided():
    """A child answering None makes the multi answer (None, False)."""
    sched = multi(child(hit_tokens=8), child(hit_tokens=None))
    assert sched.get_num_new_matched_tokens(make_request(), 0) == (None, False)


def test_bad_configs():
    """Missing or malformed children are ConfigErrors; an unknown child name says which child."""
    with pytest.raises(ConfigError, match="connectors"):
        multi()
    with pytest.raises(ConfigError, match=r"\[0\]"):
        MultiConnector(KVConnectorConfig(name="MultiConnector", extra_config={"connectors": ["x"]}),
                       KVConnectorRole.SCHEDULER, registry=REGISTRY)
    with pytest.raises(ValueError, match=r"connectors'\]\[0\]: unknown connector 'Nope'"):
        multi(child("Nope"))
    same = {"name": "RecordingConnector", "extra_config": {"hit_tokens": 4}}
    with pytest.raises(ConfigError, match=r"\[1\] repeats child 0"):
        MultiConnector(KVConnectorConfig(name="MultiConnector",
                                         extra_config={"connectors": [same, same]}),
                       KVConnectorRole.SCHEDULER, registry=REGISTRY)


def test_settings_are_typed_child_configs():
    """extra_config converts to MultiSettings: one ChildConfig per child, the fields a child
    inherits left unset; a ready KVConnectorConfig child is taken whole (but for the
    worker fields, always the multi's: see test_multi_world_size.py)."""
    assert ChildConfig.__struct_fields__ == KVConnectorConfig.__struct_fields__
    ready = KVConnectorConfig(name="RecordingConnector", role="kv_producer", engine_id="r")
    cfg = KVConnectorConfig(name="MultiConnector", role="kv_consumer", extra_config={
        "connectors": [{"name": "RecordingConnector"}, ready], "loader_policy": "first"})
    connector = MultiConnector(cfg, KVConnectorRole.SCHEDULER, registry=REGISTRY)
    settings = connector.settings
    assert isinstance(settings, MultiSettings) and settings.loader_policy == "first"
    assert settings.connectors[0] == ChildConfig(name="RecordingConnector")
    assert [c.config.role for c in connector.children] == ["kv_consumer", "kv_producer"]
    assert connector.children[1].config == ready


def test_bind_gpu_block_pool_reaches_every_child():
    """bind_gpu_block_pool is forwarded to each child exactly once."""
    sched = multi(child(), child("Evented", tag=1))
    pool = make_block_pool()
    sched.bind_gpu_block_pool(pool)
    assert all(c.block_pool is pool and c.hooks_called().count("bind_gpu_block_pool") == 1
               for c in sched.children)


def test_delayed_free_reported_once_after_every_child():
    """A request delayed by two children is reported finished_sending once, after the slower one."""
    sched, worker = pair(child(delay_free=True),
                         child("SlowSender", delay_free=True, send_delay=2), child())
    request = make_request()
    delay, _ = sched.request_finished(request, [1, 2])
    assert delay is True
    reports = [step(sched, worker, finished={request.request_id})[0].finished_sending]
    reports += [step(sched, worker)[0].finished_sending for _ in range(4)]
    assert reports == [set(), set(), {request.request_id}, set(), set()]
    assert worker.num_request_states() == 0  # nothing kept once reported


def test_no_delay_when_no_child_asks_and_params_merge():
    """No child delays -> (False, merged params); an earlier child wins a clashing key."""
    sched = multi(child(params={"a": 1, "k": "first"}), child(params={"b": 2, "k": "second"}))
    assert sched.request_finished(make_request(), []) == (False, {"a": 1, "b": 2, "k": "first"})


def test_receives_errors_stats_events_aggregate():
    """Receives and load errors are unions; stats are per child with sums; events are chained."""
    sched, worker = pair(child("Evented", tag=1, errors=[3], stats={"bytes_loaded": 10}),
                         child("Evented", tag=2, errors=[4], stats={"bytes_loaded": 5, "x": 1}))
    _, errors = step(sched, worker)
    assert errors == {3, 4}
    stats = worker.get_kv_connector_stats()
    assert stats["children"] == {"Evented#0": {"bytes_loaded": 10},
                                 "Evented#1": {"bytes_loaded": 5, "x": 1}}
    assert stats["bytes_loaded"] == 15
    assert [e.block_hashes for e in sched.take_events()] == [[1], [2]]


def test_async_receives_are_unioned():
    """An async load by the winning child is reported as finished_recving through the multi."""
    sched, worker = pair(child(hit_tokens=0), child(hit_tokens=8, load_async=True))
    manager = make_kv_cache_manager()
    request = make_request(13)
    assert admit(sched, manager, request) == (8, True)
    res, errors = step(sched, worker)
    assert res.finished_recving == {request.request_id} and not res.failed_recving and not errors


def test_scheduler_hook_failure_is_contained_as_miss():
    """A child raising in get_num_new_matched_tokens is treated as a miss and counted."""
    sched = multi(child("Raising", raise_in=["get_num_new_matched_tokens"], hit_tokens=16),
                  child(hit_tokens=4))
    assert sched.get_num_new_matched_tokens(make_request(), 0) == (4, False)
    errors = sched.get_kv_connector_stats()["hook_errors"]
    assert errors == {"Raising.get_num_new_matched_tokens": 1}


@pytest.mark.parametrize("load_async", [False, True], ids=["sync", "async"])
def test_loader_failing_after_alloc_reports_failed_load(load_async):
    """If the loader raises in update_state_after_alloc, the worker reports its blocks (and
    async request) failed."""
    children = (child("Raising", raise_in=["update_state_after_alloc"], hit_tokens=8,
                      load_async=load_async),)
    sched, worker = pair(*children)
    manager = make_kv_cache_manager()
    request = make_request(13)
    admit(sched, manager, request)
    res, errors = step(sched, worker)
    assert errors == set(manager.get_block_ids(request.request_id)[0][:2])
    expected = {request.request_id} if load_async else set()
    assert res.finished_recving == expected and res.failed_recving == expected
    res, errors = step(sched, worker, finished={request.request_id})  # reported once only
    assert errors == set() and not res.finished_recving and not res.failed_recving
    assert worker.num_request_states() == 0  # the receive the child never reports is forgotten


def test_worker_load_hook_failure_fails_that_childs_loads():
    """A child raising in start_load_kv has the loads it planned this step reported failed."""
    children = (child("Raising", raise_in=["start_load_kv"], hit_tokens=8), child())
    sched, worker = pair(*children)
    manager = make_kv_cache_manager()
    request = make_request(13)
    admit(sched, manager, request)
    _, errors = step(sched, worker)
    assert errors == set(manager.get_block_ids(request.request_id)[0][:2])
    assert "start_load_kv" in worker.children[1].hooks_called()  # the others still ran


def test_a_childs_load_failure_leaves_the_other_childs_loads_alone():
    """Only the loads the failing child planned are reported failed: a load planned by
    another child in the same step is not (its request would be recomputed for nothing)."""
    children = (child(hit_tokens=8), child("Raising", raise_in=["start_load_kv"], hit_tokens=4))
    sched, worker = pair(*children)
    request = make_request(13)
    assert admit(sched, make_kv_cache_manager(), request) == (8, False)  # child 0 loads it
    res, errors = step(sched, worker)
    assert errors == set() and not res.failed_recving
    assert worker.get_kv_connector_stats()["hook_errors"] == {"Raising.start_load_kv": 1}


def test_an_async_load_failed_by_the_multi_is_reported_once_and_forgotten():
    """The multi reports a failing child's async load as a failed receive itself; the
    child's own late report of that receive is swallowed, and no state is kept for it."""
    children = (child("Raising", raise_in=["start_load_kv"], hit_tokens=8, load_async=True),)
    sched, worker = pair(*children)
    request = make_request(13)
    admit(sched, make_kv_cache_manager(), request)
    res, _ = step(sched, worker)
    assert res.finished_recving == {request.request_id} == res.failed_recving
    assert worker.num_request_states() == 0
    res, _ = step(sched, worker)
    assert not res.finished_recving and not res.failed_recving


def test_a_childs_own_failed_receive_is_reported_failed():
    sched, worker = pair(child(), child("FailedReceiver", hit_tokens=8, load_async=True))
    request = make_request(13)
    assert admit(sched, make_kv_cache_manager(), request) == (8, True)
    res, _ = step(sched, worker)
    assert res.finished_recving == {request.request_id} == res.failed_recving


def test_the_worker_report_names_the_child_whose_loads_failed():
    """The step's report tells the scheduler side which child's loads failed (it then
    tells that child plan_failed)."""
    sched, worker = pair(child(), child("Raising", raise_in=["start_load_kv"]))
    step(sched, worker)
    plan = sched.build_connector_meta(empty_scheduler_output())
    worker.bind_connector_metadata(check_metadata_roundtrip(plan))
    worker.start_load_kv()
    meta = worker.build_connector_worker_meta()
    assert meta is not None and meta.loads_failed == (1,) and meta.stores_failed == ()
    assert meta.step == plan.step  # the step whose plan failed, under async scheduling too
    assert worker.build_connector_worker_meta() is None  # reported once


def test_worker_events_and_pending_work_come_from_every_child():
    _, worker = pair(child("WorkerPending", tag=1), child("WorkerPending", tag=2))
    assert [e.block_hashes for e in worker.get_kv_connector_kv_cache_events()] == [[1], [2]]
    assert not worker.has_pending_work()
    _, worker = pair(child("WorkerPending", tag=1), child("WorkerPending", tag=2, pending=True))
    assert worker.has_pending_work()


def test_child_with_undeclared_metadata_type_is_skipped():
    """A child returning a metadata type it does not declare is skipped for the step, loudly."""
    sched, worker = pair(child("WrongMetaType"), child())
    step(sched, worker)
    assert "start_load_kv" not in worker.children[0].hooks_called()
    assert "start_load_kv" in worker.children[1].hooks_called()
    errors = sched.get_kv_connector_stats()["hook_errors"]
    assert errors == {"WrongMetaType.build_connector_meta": 1}


def test_save_hook_failure_fails_that_childs_stores_and_tells_its_scheduler_side():
    """A child raising in wait_for_save is contained: the others still save, and the child's
    scheduler side is told that its plan's stores failed (they must never become visible)."""
    sched, worker = pair(child("Raising", raise_in=["wait_for_save"]), child())
    meta = sched.build_connector_meta(empty_scheduler_output())
    worker.bind_connector_metadata(meta)
    worker.wait_for_save()
    assert "wait_for_save" in worker.children[1].hooks_called()
    worker_meta = worker.build_connector_worker_meta()
    assert worker_meta is not None
    assert worker_meta.stores_failed == (0,) and worker_meta.loads_failed == ()
    failed: list[tuple[object, bool, bool]] = []
    first = sched.children[0]
    def plan_failed(plan, *, loads_failed, stores_failed):
        failed.append((plan, loads_failed, stores_failed))
    first.plan_failed = plan_failed  # type: ignore[method-assign]
    sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=worker_meta))
    assert len(failed) == 1 and failed[0][1:] == (False, True)
    assert isinstance(failed[0][0], first.metadata_type)
    assert worker.get_kv_connector_stats()["hook_errors"] == {"Raising.wait_for_save": 1}


def test_update_connector_output_reaches_every_child():
    """update_connector_output is forwarded to each child."""
    sched = multi(child(), child())
    out = KVConnectorOutput(finished_recving={"r"})
    sched.update_connector_output(out)
    assert all(("update_connector_output", (out,)) in c.calls for c in sched.children)


def test_shutdown_reaches_every_child_and_lists_failures():
    """shutdown calls every child once and raises one ShutdownError listing all failures."""
    sched = multi(child("Raising", raise_in=["shutdown"]), child(),
                  child("Raising", raise_in=["shutdown"]))
    with pytest.raises(ShutdownError) as info:
        sched.shutdown()
    assert [name for name, _ in info.value.failures] == ["Raising#0", "Raising#2"]
    assert sched.children[1].is_shut_down
    sched.shutdown()  # idempotent


def test_events_from_real_children_types():
    """take_events tolerates children returning any iterable (tuple default included)."""
    sched = multi(child("Evented", tag=7), child())
    events = list(sched.take_events())
    assert len(events) == 1 and not isinstance(events[0], AllBlocksCleared)


# ------------------------------------------------------- worker metadata, preemptions


class Preempting(RecordingConnector):
    """Records handle_preemptions and reports worker metadata / stats tagged by its config."""

    name = "Preempting"
    metadata_type = OtherMeta

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.preempted_with: list[Any] = []
        self.outputs: list[KVConnectorOutput] = []

    def build_connector_meta(self, scheduler_output):
        super().build_connector_meta(scheduler_output)
        return OtherMeta(numbers=[self._config.extra_config["tag"]])

    def handle_preemptions(self, connector_metadata):
        self.preempted_with.append(connector_metadata)

    def build_connector_worker_meta(self):
        return {"worker_meta_of": self._config.extra_config["tag"]}

    def get_kv_connector_stats(self):
        return {"tag": self._config.extra_config["tag"], "bytes_stored": 1}

    def update_connector_output(self, connector_output):
        self.outputs.append(connector_output)


REGISTRY.add(Preempting)


def test_handle_preemptions_reaches_children_with_their_own_plans():
    """handle_preemptions is forwarded to each bound child with that child's decoded plan."""
    sched, worker = pair(child("Preempting", tag=1), child(), child("Preempting", tag=3))
    meta = check_metadata_roundtrip(sched.build_connector_meta(empty_scheduler_output()))
    worker.bind_connector_metadata(meta)
    worker.handle_preemptions(meta)
    first, _, third = worker.children
    assert first.preempted_with == [OtherMeta(numbers=[1])]
    assert third.preempted_with == [OtherMeta(numbers=[3])]
    worker.clear_connector_metadata()


def test_worker_meta_and_stats_reach_their_own_child():
    """Worker metadata is aggregated by position; each child gets back only its own, and its
    own stats."""
    sched, worker = pair(child("Preempting", tag=1), child(), child("Preempting", tag=3))
    meta = sched.build_connector_meta(empty_scheduler_output())
    worker.bind_connector_metadata(meta)
    stats = worker.get_kv_connector_stats()
    wmeta = worker.build_connector_worker_meta()
    worker.clear_connector_metadata()
    assert wmeta.metadata == ({"worker_meta_of": 1}, None, {"worker_meta_of": 3})
    out = KVConnectorOutput(finished_sending={"r"}, kv_connector_stats=stats,
                            kv_connector_worker_meta=wmeta)
    sched.update_connector_output(out)
    first, middle, third = sched.children
    assert first.outputs[0].kv_connector_worker_meta == {"worker_meta_of": 1}
    assert third.outputs[0].kv_connector_worker_meta == {"worker_meta_of": 3}
    assert first.outputs[0].kv_connector_stats == {"tag": 1, "bytes_stored": 1}
    assert third.outputs[0].kv_connector_stats == {"tag": 3, "bytes_stored": 1}
    assert first.outputs[0].finished_sending == {"r"}
    middle_out = next(args[0] for name, args in middle.calls if name == "update_connector_output")
    assert middle_out.kv_connector_worker_meta is None and middle_out.kv_connector_stats is None


def test_no_worker_meta_when_no_child_has_any():
    """Children without worker metadata make the multi report None (no empty tuple on the wire)."""
    _, worker = pair(child(), child())
    assert worker.build_connector_worker_meta() is None


@pytest.mark.parametrize("hook", ["get_transfer_results", "get_block_ids_with_load_errors"])
def test_worker_report_hook_failure_is_contained(hook):
    """A child raising from a report hook is logged and counted; the others' results still
    come back."""
    children = (child("Raising", raise_in=[hook, "get_finished"]),
                child("Evented", tag=1, errors=[5]),
                child("SlowSender", send_delay=0, delay_free=True))
    sched, worker = pair(*children)
    manager = make_kv_cache_manager()
    sched.bind_gpu_block_pool(manager.block_pool)
    request = make_request()
    admit(sched, manager, request)
    delay, _ = sched.request_finished(request, manager.get_block_ids(request.request_id)[0])
    assert delay
    if hook == "get_transfer_results":
        res, errors = step(sched, worker, finished=[request.request_id])
        assert res.finished_sending == {request.request_id}
        assert 5 in errors
    else:
        # Which loads failed is unknown: the multi says so, and the guard above it then
        # fails every load of the step (the others' sends still come back).
        with pytest.raises(ConnectorHookError, match="Raising") as info:
            step(sched, worker, finished=[request.request_id])
        assert info.value.hook == hook
    assert worker.get_kv_connector_stats()["hook_errors"][f"Raising.{hook}"] == 1


def test_guide_multiconnector_example_builds_in_both_roles():
    """The MultiConnector JSON in docs/writing-a-connector.md ("Composing: MultiConnector")
    creates a working connector."""
    import json
    import pathlib
    import re

    from kvconnector_core.connector import create_connector

    guide = (pathlib.Path(__file__).parents[3] / "docs" / "writing-a-connector.md").read_text()
    # Found by its heading, not its number: the guide's sections get renumbered.
    section = guide.split(". Composing: MultiConnector")[1].split("\n## ")[0]
    (block,) = re.findall(r"```json\n(.*?)```", section, flags=re.S)
    config = KVConnectorConfig.from_dict(json.loads(block))
    for role in KVConnectorRole:
        conn = create_connector(config, role, make_kv_cache_config())
        names = [type(c).__name__ for c in conn.children]
        assert names == ["TTLPinConnector", "OffloadingConnector"]
        conn.shutdown()


class NeverSends(RecordingConnector):
    """Delays every free and never reports it in finished_sending."""

    name = "NeverSends"

    def request_finished(self, request, block_ids):
        super().request_finished(request, block_ids)
        return True, None

    def get_finished(self, finished_req_ids):
        return None, None


@pytest.mark.parametrize("wrapped", [False, True], ids=["alone", "in-multi"])
def test_contract_catches_a_delayed_free_never_reported(wrapped):
    """The kit's delayed-free check fails for a connector that never reports its delayed free."""
    config = (KVConnectorConfig(name="MultiConnector", extra_config={"connectors": [
        {"name": "NeverSends", "module_path": __name__}]}) if wrapped
        else KVConnectorConfig(name="NeverSends", module_path=__name__))

    class Broken(ConnectorContract):
        connector_config = config

    with pytest.raises(AssertionError, match="reported 0 times"):
        Broken().test_delayed_free_is_eventually_reported()


def test_planned_load_names_only_the_blocks_it_writes():
    """The plan's MultiLoad lists the blocks from the local hit's end to the block holding
    the last loaded token (a partly loaded block included)."""
    sched = multi(child(hit_tokens=6))
    manager = make_kv_cache_manager()
    seed = make_request(prompt_token_ids=list(range(8)))
    assert manager.allocate_slots(seed, 8) is not None  # caches blocks 0-1
    manager.free(seed)
    request = make_request(prompt_token_ids=list(range(17)))
    hit_blocks, local = manager.get_computed_blocks(request)
    assert local == 8
    ext, _ = sched.get_num_new_matched_tokens(request, local)
    assert ext == 6
    assert manager.allocate_slots(request, request.num_tokens - local - ext, local, hit_blocks,
                                  num_external_computed_tokens=ext)
    sched.update_state_after_alloc(request, manager.get_blocks(request.request_id), ext)
    ids = manager.get_block_ids(request.request_id)[0]
    plan = sched.build_connector_meta(empty_scheduler_output())
    assert plan.loads[request.request_id].block_ids == ids[2:4]  # tokens 8..13


def test_a_miss_leaves_no_loader_state():
    """When no child hits, the multi keeps nothing for the request."""
    sched = multi(child(hit_tokens=0), child(hit_tokens=0))
    assert sched.get_num_new_matched_tokens(make_request(), 0) == (0, False)
    assert sched.num_request_states() == 0


def test_a_claim_the_scheduler_did_not_take_plans_no_load():
    """A child that claimed tokens but was offered 0 external tokens plans no load."""
    sched = multi(child(hit_tokens=8))
    manager = make_kv_cache_manager()
    request = make_request()
    assert sched.get_num_new_matched_tokens(request, 0)[0] == 8
    assert manager.allocate_slots(request, request.num_tokens)
    sched.update_state_after_alloc(request, manager.get_blocks(request.request_id), 0)
    plan = sched.build_connector_meta(empty_scheduler_output())
    assert plan.loads == {} and plan.failed_loads == {}


def test_a_lost_child_plan_fails_its_loads_and_forgets_their_requests():
    """A child whose plan is lost (its build_connector_meta raised) cannot carry out the
    loads it planned this step: they fail now, and the child forgets their requests (an
    async load's request is not in the step's scheduler output, so only the multi knows)."""
    sched = multi(child("Raising", hit_tokens=8, load_async=True,
                        raise_in=["build_connector_meta"]), child())
    forgot: list[set[str]] = []
    def forget(ids):
        forgot.append(set(ids))
    sched.children[0].forget_requests = forget  # type: ignore[method-assign]
    request = make_request()
    admit(sched, make_kv_cache_manager(), request)
    plan = sched.build_connector_meta(empty_scheduler_output())
    assert plan.skipped_children == [0]
    assert plan.loads == {} and list(plan.failed_loads) == [request.request_id]
    assert forgot == [{request.request_id}]


def test_a_forgotten_request_fails_its_planned_load():
    """forget_requests turns a load planned this step into a failed one."""
    sched = multi(child(hit_tokens=8))
    request = make_request()
    admit(sched, make_kv_cache_manager(), request)
    sched.forget_requests({request.request_id})
    plan = sched.build_connector_meta(empty_scheduler_output())
    assert plan.loads == {} and list(plan.failed_loads) == [request.request_id]


def test_failed_loads_reach_only_the_child_whose_loads_failed():
    """A worker report that child 0's loads failed tells child 0's scheduler side (with
    its own plan), and no other child."""
    sched = multi(child(), child())
    failed: dict[int, list[tuple[bool, bool]]] = {0: [], 1: []}
    for i, c in enumerate(sched.children):
        def plan_failed(plan, *, loads_failed, stores_failed, i=i):
            failed[i].append((loads_failed, stores_failed))
        c.plan_failed = plan_failed  # type: ignore[method-assign]
    sched.build_connector_meta(empty_scheduler_output())
    meta = MultiKVConnectorWorkerMetadata((None, None), loads_failed=(0,))
    sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=meta))
    assert failed == {0: [(True, False)], 1: []}


def _delayed_free():
    sched = multi(child(delay_free=True))
    request = make_request()
    assert sched.request_finished(request, [1])[0] is True
    return sched, request.request_id


def test_a_reported_delayed_free_is_settled_in_the_next_plan():
    """A delayed free reported sent keeps the multi pending until the next plan says so."""
    sched, rid = _delayed_free()
    assert sched.build_connector_meta(empty_scheduler_output()).delayed_sends == {rid: [0]}
    sched.update_connector_output(KVConnectorOutput(finished_sending={rid}))
    assert sched.has_pending_work()
    plan = sched.build_connector_meta(empty_scheduler_output())
    assert plan.settled_sends == [rid] and plan.delayed_sends == {}


def test_failed_stores_resend_the_plans_delayed_frees_unless_already_reported():
    """stores_failed re-sends the failed plan's delayed frees (loads_failed alone does not);
    a re-sent free reported sent meanwhile is not sent again."""
    sched, rid = _delayed_free()
    plan = sched.build_connector_meta(empty_scheduler_output())
    sched.plan_failed(plan, loads_failed=True, stores_failed=False)
    assert sched.build_connector_meta(empty_scheduler_output()).delayed_sends == {}
    sched.plan_failed(plan, loads_failed=False, stores_failed=True)
    assert sched.has_pending_work()
    sched.update_connector_output(KVConnectorOutput(finished_sending={rid}))
    assert sched.build_connector_meta(empty_scheduler_output()).delayed_sends == {}


def test_plan_failed_reaches_children_that_built_a_plan_only():
    """plan_failed goes to the children whose plan the failed plan carries, not to one
    whose plan was lost."""
    sched = multi(child("Raising", raise_in=["build_connector_meta"]), child())
    told: list[int] = []
    for i, c in enumerate(sched.children):
        tell = (lambda i: lambda plan, **kw: told.append(i))(i)
        c.plan_failed = tell  # type: ignore[method-assign]
    plan = sched.build_connector_meta(empty_scheduler_output())
    sched.plan_failed(plan, loads_failed=True, stores_failed=True)
    assert told == [1]


def test_reset_cache_succeeds_only_if_every_child_resets():
    """reset_cache is True only when every child reset (each is asked)."""
    sched = multi(child(), child())
    sched.children[1].reset_cache = lambda: False  # type: ignore[method-assign]
    assert sched.reset_cache() is False


def test_a_failed_load_keeps_the_multi_pending_until_planned():
    """A load that failed before any plan carried it keeps the multi stepping."""
    sched = multi(child(hit_tokens=8))
    request = make_request()
    admit(sched, make_kv_cache_manager(), request)
    sched.forget_requests({request.request_id})
    assert sched.has_pending_work()
    sched.build_connector_meta(empty_scheduler_output())
    assert not sched.has_pending_work()


def test_a_resent_delayed_free_the_children_already_reported_is_settled_on_the_worker():
    """A delayed free re-sent after a failed plan can reach the worker after its child
    reported it (children report a request once); the plan that settles it makes the
    worker side stop waiting, so it keeps no state for the request."""
    sched, worker = pair(child(delay_free=True))
    request = make_request()
    rid = request.request_id
    assert sched.request_finished(request, [1])[0] is True
    finished = empty_scheduler_output()
    finished.finished_req_ids = {rid}
    first = check_metadata_roundtrip(sched.build_connector_meta(finished))
    # its delayed free is sent again
    sched.plan_failed(first, loads_failed=False, stores_failed=True)
    resent = check_metadata_roundtrip(sched.build_connector_meta(empty_scheduler_output()))
    assert resent.delayed_sends == {rid: [0]}
    reports = []
    for plan, done in ((first, {rid}), (resent, set())):
        worker.bind_connector_metadata(plan)
        worker.start_load_kv()
        worker.wait_for_save()
        reports.append(worker.get_transfer_results(done).finished_sending)
        worker.clear_connector_metadata()
    assert reports == [{rid}, set()]
    sched.update_connector_output(KVConnectorOutput(finished_sending={rid}))
    settling = check_metadata_roundtrip(sched.build_connector_meta(empty_scheduler_output()))
    assert settling.settled_sends == [rid]
    worker.bind_connector_metadata(settling)
    assert worker.num_request_states() == 0
