"""Scheduler policies that a one-line slip would break silently: who is preempted and where
it waits, max_num_seqs, first-come-first-served admission, what an async load allocates,
stop tokens, and what an aborted or finished request leaves behind."""

from __future__ import annotations

from kvconnector_core import Request, RequestStatus
from kvconnector_core.kv_events import AllBlocksCleared
from kvconnector_core.scheduler.output import ModelRunnerOutput

from test_scheduler import BS, ScriptedConnector, fake_model_output, make_connector, make_scheduler, req


def step(s, **kv):
    out = s.schedule()
    return out, s.update_from_output(out, fake_model_output(s, out, **kv))


# -- preemption ----------------------------------------------------------------------------------


def test_preemption_takes_the_newest_running_request_and_requeues_it_first():
    """Out of blocks, the newest running request is preempted (not the oldest, which keeps
    its step) and goes to the front of the waiting queue, ahead of requests already waiting."""
    s = make_scheduler(num_blocks=4, budget=64)  # 3 usable blocks
    s.add_request(req("a", n=4, max_tokens=8))
    s.add_request(req("b", n=4, max_tokens=8, base=100))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 4, "b": 4}
    s.add_request(req("c", n=4, max_tokens=8, base=200))
    out = s.schedule()  # a and b both need a second block; one is free
    assert out.preempted_req_ids == {"b"}
    assert out.num_scheduled_tokens == {"a": 1}
    assert [r.request_id for r in s.waiting] == ["b", "c"]
    assert s.requests["b"].status == RequestStatus.PREEMPTED


def test_max_num_seqs_caps_the_running_requests():
    """No more than max_num_seqs requests run at once, however much room is left."""
    s = make_scheduler(max_num_seqs=2, budget=64)
    for i in range(3):
        s.add_request(req(f"r{i}", n=4, base=100 * i))
    out = s.schedule()
    assert [r.req_id for r in out.scheduled_new_reqs] == ["r0", "r1"]
    assert len(s.running) == 2 and [r.request_id for r in s.waiting] == ["r2"]


def test_a_request_that_cannot_fit_is_not_overtaken_by_a_later_smaller_one():
    """Admission is first come, first served: once a fresh request cannot get its blocks,
    fresh requests behind it wait too, even one that would fit."""
    s = make_scheduler(num_blocks=7, budget=64)  # 6 usable blocks
    s.add_request(req("r0", n=16, max_tokens=4))
    step(s)  # r0 holds 4 blocks and grows to a fifth next step
    s.add_request(req("big", n=12, max_tokens=2, base=100))
    s.add_request(req("small", n=4, max_tokens=2, base=200))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"r0": 1}
    assert out.scheduled_new_reqs == []
    assert [r.request_id for r in s.waiting] == ["big", "small"]


def test_a_request_without_new_tokens_is_not_scheduled():
    """A running request the worker returned no sample for has nothing to compute: it is
    skipped, not given an empty allocation."""
    s = make_scheduler()
    s.add_request(req("a", n=8))
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(req_ids=["a"], sampled_token_ids={}))
    out = s.schedule()
    assert out.num_scheduled_tokens == {}
    assert s.requests["a"].status == RequestStatus.RUNNING


# -- what the connector's answer allocates ------------------------------------------------------


def test_async_load_allocates_blocks_for_the_loaded_tokens_only():
    """A request parked for an async load of 8 of its 20 tokens holds the 2 blocks the load
    writes, not blocks for the tokens it computes later."""
    c = make_connector()
    s = make_scheduler(connector=c)
    c.external["a"] = (8, True)
    s.add_request(req("a", n=20))
    out = s.schedule()
    assert out.num_scheduled_tokens == {}
    assert len(s.kv_cache_manager.get_block_ids("a")[0]) == 2


def test_async_full_prompt_claim_gets_a_block_for_every_claimed_token():
    """A connector claiming the whole 17-token prompt loads 5 blocks (the last holds only the
    last token, which the engine recomputes): all 5 are allocated before the load."""
    c = make_connector()
    s = make_scheduler(connector=c)
    c.external["a"] = (17, True)
    s.add_request(req("a", n=17))
    s.schedule()
    assert s.requests["a"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert len(s.kv_cache_manager.get_block_ids("a")[0]) == 5


def test_async_claim_of_only_the_last_token_is_no_load():
    """A claim that would leave only the last prompt token to load is no load at all, even
    when the connector asked for an async load: the request runs at once."""
    c = make_connector()
    s = make_scheduler(connector=c)
    s.add_request(req("a", n=8, max_tokens=1))
    step(s)
    step(s)  # a finished; its 2 full blocks stay cached
    c.external["b"] = (1, True)
    s.add_request(Request("b", list(range(9)), 2, hash_block_size=BS))  # local hit: 8 tokens
    out = s.schedule()
    assert out.num_scheduled_tokens == {"b": 1}
    assert s.requests["b"].status == RequestStatus.RUNNING


def test_update_state_raise_without_a_load_still_runs_the_request():
    """update_state_after_alloc raising for a request that loads nothing costs nothing: the
    request runs in the same step."""
    c = make_connector()
    c.raise_in.add("update_state_after_alloc")
    s = make_scheduler(connector=c)
    s.add_request(req("a"))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 16}
    assert s.stats.connector_errors == {"update_state_after_alloc": 1}


class EventfulConnector(ScriptedConnector):
    def take_events(self):
        return [AllBlocksCleared(medium="CPU")]


def test_take_events_includes_the_connectors_events():
    """The scheduler's event stream carries the connector's events after the pool's."""
    base = make_connector()
    c = EventfulConnector(base.config, base.role, base.kv_cache_config)
    s = make_scheduler(connector=c)
    assert s.take_events() == [AllBlocksCleared(medium="CPU")]


# -- finishing ------------------------------------------------------------------------------------


def test_stop_token_finishes_only_when_sampled():
    """A request stops on its eos token, and only on it (or on its length)."""
    s = make_scheduler()
    s.add_request(Request("a", list(range(8)), 10, hash_block_size=BS, eos_token_id=5))
    out = s.schedule()
    assert s.update_from_output(out, ModelRunnerOutput(req_ids=["a"], sampled_token_ids={"a": [7]})) == []
    out = s.schedule()
    (done,) = s.update_from_output(out, ModelRunnerOutput(req_ids=["a"], sampled_token_ids={"a": [5]}))
    assert done.status == RequestStatus.FINISHED_STOPPED and done.output_token_ids == [7, 5]


def test_aborting_a_finished_request_held_for_sending_changes_nothing():
    """An abort that arrives after the request finished (its blocks held until sent) is a no-op."""
    c = make_connector()
    c.delay_free.add("a")
    s = make_scheduler(connector=c)
    s.add_request(req("a", n=8, max_tokens=1))
    _, done = step(s)
    assert [r.request_id for r in done] == ["a"]
    free = s.kv_cache_manager.block_pool.get_num_free_blocks()
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert done[0].status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == free
    step(s, finished_sending={"a"})
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 39


def test_engine_keeps_stepping_until_an_aborted_load_is_reported():
    """A request aborted mid-load keeps the engine stepping (its blocks are freed only when
    the load is reported), also after the empty step that told the worker of the abort."""
    c = make_connector()
    s = make_scheduler(connector=c)
    c.external["a"] = (12, True)
    s.add_request(req("a", n=20))
    s.schedule()
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    step(s)  # the worker learns of the finish
    assert s.has_unfinished_requests()
    step(s, finished_recving={"a"})
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 39
    step(s)
    assert not s.has_unfinished_requests()


def test_a_reused_id_waits_for_its_own_load_on_later_steps_too():
    """A load reported for an aborted request is not taken for a later request of that id."""
    c = make_connector()
    s = make_scheduler(connector=c)
    c.external["r"] = (8, True)
    s.add_request(req("r"))
    out, _ = step(s, finished_recving={"r"})
    s.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    s.add_request(req("r"))
    step(s)
    out, _ = step(s)  # nothing reported for the new request's load
    assert out.num_scheduled_tokens == {}
    assert s.requests["r"].status == RequestStatus.WAITING_FOR_REMOTE_KVS


def test_a_reused_id_after_a_failed_load_asks_the_connector_again():
    """A request that recomputed after a failed load never asks the connector again, but a
    later request reusing its id does."""
    c = make_connector()
    s = make_scheduler(connector=c)
    c.external["a"] = (12, True)
    s.add_request(req("a", n=20, max_tokens=1))
    step(s, finished_recving={"a"}, failed_recving={"a"})
    while s.has_unfinished_requests():
        step(s)
    asked = c.calls.count(("get_num_new_matched_tokens", "a"))
    s.add_request(req("a", n=20, max_tokens=1, base=500))
    s.schedule()
    assert c.calls.count(("get_num_new_matched_tokens", "a")) == asked + 1
