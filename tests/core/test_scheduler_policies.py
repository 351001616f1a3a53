"""Scheduler policies that a one-line slip would break silently: who is preempted and where
it waits, max_num_seqs, first-come-first-served admission, what an async load allocates,
stop tokens, and what an aborted or finished request leaves behind."""

from __future__ import annotations

from kvconnector_core import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    Request,
    RequestStatus,
)
from kvconnector_core import SlidingWindowSpec
from kvconnector_core.kv_events import AllBlocksCleared
from kvconnector_core.scheduler.output import ModelRunnerOutput
from kvconnector_core.scheduler.scheduler import Scheduler

from test_scheduler import (
    BS,
    ScriptedConnector,
    fake_model_output,
    make_connector,
    make_scheduler,
    req,
)


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


def _parked_for_async_load(claim: int, n: int):
    """A scheduler whose request "a" (n tokens) waits for an async load of ``claim`` tokens;
    returns it, the step's output and the request's block ids."""
    c = make_connector()
    s = make_scheduler(connector=c)
    c.external["a"] = (claim, True)
    s.add_request(req("a", n=n))
    out = s.schedule()
    return s, out, s.kv_cache_manager.get_block_ids("a")[0]


def test_async_load_allocates_blocks_for_the_loaded_tokens_only():
    """A request parked for an async load of 8 of its 20 tokens holds the 2 blocks the load
    writes, not blocks for the tokens it computes later."""
    s, out, blocks = _parked_for_async_load(claim=8, n=20)
    assert out.num_scheduled_tokens == {}
    assert len(blocks) == 2


def test_async_full_prompt_claim_gets_a_block_for_every_claimed_token():
    """A connector claiming the whole 17-token prompt loads 5 blocks (the last holds only the
    last token, which the engine recomputes): all 5 are allocated before the load."""
    s, _, blocks = _parked_for_async_load(claim=17, n=17)
    assert s.requests["a"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert len(blocks) == 5


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
    assert (
        s.update_from_output(out, ModelRunnerOutput(req_ids=["a"], sampled_token_ids={"a": [7]}))
        == []
    )
    out = s.schedule()
    (done,) = s.update_from_output(
        out, ModelRunnerOutput(req_ids=["a"], sampled_token_ids={"a": [5]})
    )
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


def test_a_reused_id_is_new_to_the_worker():
    """After a request finished, a new request with its id is sent to the worker as new."""
    s = make_scheduler()
    s.add_request(req("a", n=8, max_tokens=1))
    step(s)
    step(s)
    s.add_request(req("a", n=8, max_tokens=1, base=300))
    out = s.schedule()
    assert [r.req_id for r in out.scheduled_new_reqs] == ["a"]
    assert out.scheduled_cached_reqs.req_ids == []


def test_decode_step_without_a_new_block_sends_none():
    """A running request that got no new block this step has ``None`` as its new block ids
    (the worker keeps its table); one that did gets just the new blocks."""
    s = make_scheduler()
    s.add_request(req("a", n=6, max_tokens=5))
    step(s)
    for _ in range(2):  # positions 6 and 7 fit the second block
        out, _ = step(s)
        assert out.scheduled_cached_reqs.new_block_ids == [None]
    out, _ = step(s)  # position 8 needs a third block
    (new_ids,) = out.scheduled_cached_reqs.new_block_ids
    assert new_ids == (s.kv_cache_manager.get_block_ids("a")[0][2:],)


# -- invalid blocks and failed loads ---------------------------------------------------------------


def _report_invalid(s, out, ids, **kv):
    return s.update_from_output(out, fake_model_output(s, out, invalid_block_ids=set(ids), **kv))


def test_invalid_cached_block_nobody_holds_leaves_the_prefix_cache():
    """An invalid block no request holds is evicted, so no later request hits it."""
    s = make_scheduler()
    s.add_request(req("a", n=12, max_tokens=1))
    out = s.schedule()
    blocks = s.kv_cache_manager.get_block_ids("a")[0]
    s.update_from_output(out, fake_model_output(s, out))  # a finished: its 3 blocks stay cached
    out = s.schedule()
    _report_invalid(s, out, [blocks[1]])
    s.add_request(req("b", n=16, max_tokens=1))
    out = s.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == BS  # only block 0 is still a hit


def test_rollback_point_is_block_aligned():
    """A chunked prefill whose step began mid-block (token 10) and hit a bad block beyond it
    resumes from the block boundary before the step's start (token 8)."""
    s = make_scheduler(budget=10)
    s.add_request(req("a", n=30))
    step(s)  # tokens 0..9
    out = s.schedule()  # tokens 10..19
    blocks = s.kv_cache_manager.get_block_ids("a")[0]
    _report_invalid(s, out, [blocks[3]])  # tokens 12..15
    assert s.requests["a"].num_computed_tokens == 8


def test_hybrid_rollback_goes_to_the_earliest_bad_block_of_any_group():
    """With bad blocks in two groups at different positions, the request resumes before
    the earliest of them."""
    full, swa = (
        FullAttentionSpec(BS, 1, 4, "int32"),
        SlidingWindowSpec(BS, 1, 4, "int32", sliding_window=64),
    )
    cfg = KVCacheConfig(64, [KVCacheGroupSpec(["l0"], full), KVCacheGroupSpec(["l1"], swa)])
    s = Scheduler(
        cfg,
        max_num_batched_tokens=64,
        max_num_seqs=4,
        max_model_len=128,
        scheduler_block_size=BS,
        hash_block_size=BS,
    )
    s.add_request(req("r", n=20, max_tokens=4))
    step(s)
    out = s.schedule()  # decode: token 20
    full_ids, swa_ids = s.kv_cache_manager.get_block_ids("r")
    _report_invalid(s, out, [full_ids[3], swa_ids[1]])
    assert s.requests["r"].num_computed_tokens == BS


def test_invalid_block_holding_only_the_recomputed_last_token_fails_no_load():
    """A whole-prompt async claim loads a block whose only token the engine recomputes
    anyway: that block reported invalid does not fail the load."""
    s, out, blocks = _parked_for_async_load(claim=17, n=17)
    _report_invalid(s, out, [blocks[4]], finished_recving={"a"})
    out = s.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 16
    assert s.stats.num_failed_loads_recovered == 0


def test_async_load_failed_twice_rolls_back_once():
    """A load whose block was reported invalid while it ran, and that is then reported
    finished and failed, resumes from the first bad block (not rolled back a second time)."""
    s, out, blocks = _parked_for_async_load(claim=12, n=20)
    _report_invalid(s, out, [blocks[2]])
    out, _ = step(s, finished_recving={"a"}, failed_recving={"a"})
    out = s.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 8
    assert out.num_scheduled_tokens == {"a": 12}


def test_sync_load_counts_its_tokens_once():
    """A sync load's tokens count as connector hits once; later steps recount nothing."""
    c = make_connector()
    s = make_scheduler(connector=c, budget=64)
    c.external["a"] = (12, False)
    s.add_request(req("a", n=20, max_tokens=3))
    while s.has_unfinished_requests():
        step(s)
    st = s.stats
    assert (
        st.num_connector_hit_tokens,
        st.num_prefill_tokens_computed,
        st.num_recomputed_tokens,
    ) == (12, 8, 0)


def test_worker_loads_failed_fails_the_steps_async_loads():
    """When the worker reports that the step's loads failed (they may never have started),
    the async loads that step's plan carried fail at once and recompute; nothing waits for a
    report the connector may never send."""
    c = make_connector()
    s = make_scheduler(connector=c)
    c.external["a"] = (12, True)
    s.add_request(req("a", n=20))
    step(s, loads_failed=True)
    out = s.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0
    assert out.num_scheduled_tokens == {"a": 16}


def test_worker_kv_events_reach_the_scheduler_stream():
    """KV events the worker side reports come out of the scheduler's take_events."""
    s = make_scheduler()
    s.add_request(req("a", n=8))
    step(s, kv_cache_events=[AllBlocksCleared(medium="CPU")])
    assert AllBlocksCleared(medium="CPU") in s.take_events()


class RecordingConnector(ScriptedConnector):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.told: dict[str, int] = {}

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self.told[request.request_id] = num_external_tokens


def _recording_scheduler():
    base = make_connector()
    c = RecordingConnector(base.config, base.role, base.kv_cache_config)
    return c, make_scheduler(connector=c)


def test_whole_prompt_sync_claim_still_computes_the_last_token():
    """A connector may claim the whole prompt; it is told so, and the engine still computes
    the last prompt token (it needs its logits)."""
    c, s = _recording_scheduler()
    c.external["a"] = (12, False)
    s.add_request(req("a", n=12))
    out = s.schedule()
    assert c.told["a"] == 12
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.scheduled_new_reqs[0].num_computed_tokens == 11


def test_claim_of_only_the_last_token_tells_the_connector_zero():
    """A claim that leaves only the last prompt token to load is no load: the connector is
    told 0 external tokens."""
    c, s = _recording_scheduler()
    s.add_request(req("a", n=8, max_tokens=1))
    step(s)
    step(s)  # a's 2 full blocks stay cached
    c.external["b"] = (1, False)
    s.add_request(Request("b", list(range(9)), 2, hash_block_size=BS))
    out = s.schedule()
    assert c.told["b"] == 0
    assert out.num_scheduled_tokens == {"b": 1}
