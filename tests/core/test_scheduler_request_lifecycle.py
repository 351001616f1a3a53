"""A request's life in the scheduler at its edges: unplanned and failed loads, aborts while
loading, preemption, rejection, reused request ids and parked sliding-window requests.

Each asserts what a caller or the connector can see: the step's output, block accounting,
request status and the load-failure stats."""

from __future__ import annotations

import pytest

from kvconnector_core import RequestStatus, SlidingWindowSpec
from kvconnector_core.errors import InvariantError

from test_scheduler import BS, make_connector, make_scheduler, req, run_to_completion
from test_scheduler_policies import step


def _free(s) -> int:
    return s.kv_cache_manager.block_pool.get_num_free_blocks()


def test_a_load_the_connector_never_planned_gives_its_blocks_back_at_once():
    """update_state_after_alloc raising for a request with a hit: the load never happens,
    the request waits to start over, and the blocks allocated for the load are free again
    in the same step (a request that does not run holds none)."""
    c = make_connector()
    c.raise_in.add("update_state_after_alloc")
    s = make_scheduler(connector=c)
    c.external["a"] = (16, False)
    s.add_request(req("a", n=20))
    before = _free(s)
    out = s.schedule()
    assert out.num_scheduled_tokens == {}
    assert s.requests["a"].status == RequestStatus.WAITING
    assert not any(s.kv_cache_manager.get_block_ids("a"))
    assert _free(s) == before


def test_only_a_step_that_admits_a_synchronous_load_says_it_has_sync_loads():
    """``SchedulerOutput.has_sync_kv_loads`` tells the worker to load before the forward:
    set in a step that admits a synchronous load, not in a step whose admissions load nothing."""
    c = make_connector()
    s = make_scheduler(connector=c, budget=64)
    s.add_request(req("miss", n=20))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"miss": 20}
    assert out.has_sync_kv_loads is False
    c.external["hit"] = (16, False)
    s.add_request(req("hit", n=20, base=500))
    out, _ = step(s)
    assert out.num_scheduled_tokens["hit"] == 4
    assert out.has_sync_kv_loads is True


def test_an_aborted_requests_failed_load_does_not_fail_a_later_request_with_its_id():
    """A request aborted after its async load was reported failed, before it consumed the
    report; a later request reusing its id loads successfully and must keep its hit (not
    be treated as failed and recomputed)."""
    c = make_connector()
    s = make_scheduler(connector=c, budget=64)
    c.external["a"] = (16, True)
    s.add_request(req("a", n=20))
    step(s)  # "a" waits for its load
    assert s.requests["a"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    out = s.schedule()
    s.update_from_output(out, _kv(s, out, finished_recving={"a"}, failed_recving={"a"}))
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    step(s)
    assert "a" not in s.requests and _free(s) == 39
    s.add_request(req("a", n=20))  # the id again, same hit
    step(s)
    out = s.schedule()
    s.update_from_output(out, _kv(s, out, finished_recving={"a"}))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 4}  # served by the load
    assert s.stats.num_failed_loads_recovered == 0


def _kv(s, out, **kv):
    from test_scheduler import fake_model_output

    return fake_model_output(s, out, **kv)


def test_a_failed_async_load_with_nothing_valid_starts_over_as_a_fresh_request():
    """An async load that failed from its first block leaves nothing valid: the request
    gives back the blocks the load held and starts over as a fresh request, so it takes
    the prefix another request cached meanwhile and computes only the rest."""
    c = make_connector()
    s = make_scheduler(connector=c, budget=64)
    c.external["a"] = (32, True)
    s.add_request(req("a", n=40))
    step(s)  # "a" waits for its load
    held = s.kv_cache_manager.get_block_ids("a")[0]
    s.add_request(req("b", n=40))  # the same prompt, computed (and cached) meanwhile
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"b": 40}
    cached = s.kv_cache_manager.get_block_ids("b")[0][:9]
    out = s.schedule()
    s.update_from_output(out, _kv(s, out, finished_recving={"a"}, failed_recving={"a"},
                                  invalid_block_ids={held[0]}))
    out, _ = step(s)
    assert out.num_scheduled_tokens["a"] == 40 - 36  # a local hit of 9 blocks (36 tokens)
    assert s.kv_cache_manager.get_block_ids("a")[0][:9] == cached  # not the failed load's
    assert s.stats.num_failed_loads_recovered == 1
    run_to_completion(s)
    assert _free(s) == 39


def test_a_request_that_finishes_in_the_step_of_its_sync_load_finishes_cleanly():
    """A request whose synchronous load runs in the step it finishes in (one output token):
    the step completes, the request finishes and every block returns (its blocks were
    freed with it, so there is nothing left to cache)."""
    c = make_connector()
    s = make_scheduler(connector=c, budget=64)
    c.external["a"] = (16, False)
    s.add_request(req("a", n=20, max_tokens=1))
    out, done = step(s)
    assert out.num_scheduled_tokens == {"a": 4}
    assert [r.request_id for r in done] == ["a"]
    assert done[0].status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert _free(s) == 39


def test_a_running_request_whose_sync_load_failed_is_not_offered_to_the_connector_again():
    """After a failed synchronous load the request recomputes; if it is preempted later,
    its re-admission must not ask the connector again (a connector that keeps failing
    would otherwise cost it a rollback every time)."""
    c = make_connector()
    s = make_scheduler(num_blocks=12, connector=c, budget=64)  # 11 usable blocks
    s.add_request(req("b", n=20, max_tokens=20, base=500))
    step(s)
    c.external["a"] = (16, False)
    s.add_request(req("a", n=20, max_tokens=20))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"b": 1, "a": 4}  # 16 of a's tokens are loaded
    bad = s.kv_cache_manager.get_block_ids("a")[0][0]
    s.update_from_output(out, _kv(s, out, invalid_block_ids={bad}))
    preempted = False
    for _ in range(60):  # both grow; "a", the newer, is preempted and comes back
        out, _ = step(s)
        preempted |= "a" in out.preempted_req_ids
        if (
            preempted
            and s.requests.get("a") is not None
            and s.requests["a"].status == RequestStatus.RUNNING
        ):
            break
    assert preempted
    asked = [rid for hook, rid in c.calls if hook == "get_num_new_matched_tokens"]
    assert asked.count("a") == 1
    assert s.stats.num_failed_loads_recovered == 1


def test_a_request_aborted_while_loading_is_dropped_once_its_load_reports_and_its_id_is_free():
    """Aborted while its async load runs, a request keeps its blocks until the load
    reports finished; then it is dropped entirely: blocks back, and its id free for a new
    request (the scheduler refuses an id that is still in use)."""
    c = make_connector()
    s = make_scheduler(connector=c, budget=64)
    c.external["a"] = (16, True)
    s.add_request(req("a", n=20))
    step(s)
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert _free(s) < 39  # the worker may still be writing the blocks
    out = s.schedule()
    s.update_from_output(out, _kv(s, out, finished_recving={"a"}))
    assert "a" not in s.requests and _free(s) == 39
    c.external.pop("a")
    s.add_request(req("a", n=20, max_tokens=1))  # the id is free again
    assert [r.request_id for r in run_to_completion(s)] == ["a"]


def test_a_preempted_request_gives_back_its_blocks_in_the_step_it_is_preempted():
    """Preemption frees the victim's blocks at once: the pool count rises by them and the
    victim holds none while it waits."""
    s = make_scheduler(num_blocks=4, budget=64)  # 3 usable blocks
    s.add_request(req("a", n=4, max_tokens=8))
    s.add_request(req("b", n=4, max_tokens=8, base=100))
    step(s)  # a and b: 1 block each
    assert _free(s) == 1
    out = s.schedule()  # both need a second block: a takes the free one, b is preempted
    assert out.preempted_req_ids == {"b"}
    assert not any(s.kv_cache_manager.get_block_ids("b"))
    assert _free(s) == 1


def test_a_rejected_request_is_finished_with_the_connector_and_its_id_freed():
    """A request that can never fit is rejected: the connector hears it finished, the
    worker is told (finished_req_ids) and the id can be used again."""
    c = make_connector()
    s = make_scheduler(num_blocks=8, connector=c, budget=64)
    s.add_request(req("big", n=60, max_tokens=1))  # 15 blocks, the pool has 7
    out, done = step(s)
    assert [r.request_id for r in done] == ["big"] and done[
        0
    ].status == RequestStatus.FINISHED_ERROR
    assert ("request_finished", "big") in c.calls
    assert "big" in out.finished_req_ids
    assert "big" not in s.requests
    s.add_request(req("big", n=8, max_tokens=1))
    assert [r.request_id for r in run_to_completion(s)] == ["big"]


def test_an_aborted_running_request_is_never_scheduled_again():
    s = make_scheduler(budget=64)
    s.add_request(req("a", n=8, max_tokens=10))
    s.add_request(req("b", n=8, max_tokens=10, base=100))
    step(s)
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"b": 1}
    assert s.get_num_unfinished_requests() == 1
    run_to_completion(s)
    assert _free(s) == 39


@pytest.mark.timeout(30)  # a failed request left in the waiting queue would spin forever
def test_under_the_fail_policy_a_failed_async_load_fails_its_request_only():
    """load_failure_policy="fail": the request whose async load failed finishes with an
    error (reported to the caller), gives back its blocks, and the others run on."""
    c = make_connector()
    s = make_scheduler(connector=c, budget=64, policy="fail")
    c.external["a"] = (16, True)
    s.add_request(req("a", n=20))
    s.add_request(req("b", n=8, base=100))
    step(s)
    out = s.schedule()
    done = s.update_from_output(out, _kv(s, out, finished_recving={"a"}, failed_recving={"a"}))
    done += run_to_completion(s)
    status = {r.request_id: r.status for r in done}
    assert status == {"a": RequestStatus.FINISHED_ERROR, "b": RequestStatus.FINISHED_LENGTH_CAPPED}
    assert s.stats.num_requests_failed == 1
    assert _free(s) == 39


def test_a_reused_request_id_counts_its_prompt_again():
    """The prompt-token stats count each request's prompt once, a later request that
    reuses a finished request's id included."""
    s = make_scheduler(budget=64)
    s.add_request(req("a", n=8, max_tokens=1))
    run_to_completion(s)
    s.add_request(req("a", n=12, max_tokens=1, base=100))
    run_to_completion(s)
    assert s.stats.num_prompt_tokens == 8 + 12


def test_a_waiting_request_with_nothing_to_compute_is_an_invariant_error():
    """Unreachable through the public API (hits and loads always leave a token to
    compute); a state that breaks it raises, naming the request, instead of parking the
    request as if the pool were full."""
    s = make_scheduler(budget=64)
    s.add_request(req("a", n=8))
    s.requests["a"].num_computed_tokens = 8  # as if everything were computed already
    with pytest.raises(InvariantError, match="'a' has nothing to compute or load"):
        s.schedule()


def test_a_reused_id_aborted_while_loading_is_freed_without_waiting_for_a_send():
    """A request aborted while loading, whose connector delayed its free, is dropped once
    its send reports; a later request with the same id, aborted while loading with no
    delayed free, is dropped as soon as its load reports (nothing will ever be sent)."""
    c = make_connector()
    s = make_scheduler(connector=c, budget=64)
    for delayed in (True, False):
        if delayed:
            c.delay_free.add("a")
        else:
            c.delay_free.discard("a")
        c.external["a"] = (16, True)
        s.add_request(req("a", n=20))
        step(s)
        s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
        out = s.schedule()
        s.update_from_output(out, _kv(s, out, finished_recving={"a"}))
        if delayed:
            out = s.schedule()
            s.update_from_output(out, _kv(s, out, finished_sending={"a"}))
        assert "a" not in s.requests and _free(s) == 39
    assert not s.has_unfinished_requests() or run_to_completion(s) == []


def test_blocks_reserved_for_a_parked_sliding_window_request_are_window_capped():
    """Fresh admissions leave free the blocks a request parked for an async load still
    needs; with sliding-window attention that need is capped by the window (as admission
    counts it), so a fresh request that fits beside the capped need is admitted now."""
    c = make_connector()
    s = make_scheduler(
        num_blocks=80,
        connector=c,
        budget=128,
        max_model_len=512,
        spec=SlidingWindowSpec(BS, 1, 1, sliding_window=8),
    )
    c.external["a"] = (8, True)
    s.add_request(req("a", n=200))
    step(s)  # "a" holds 2 blocks and waits for its load; it still needs 33 (48 uncapped)
    assert s.requests["a"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    s.add_request(req("b", n=160, base=1000))  # needs 35 blocks (capped); 77 are free
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"b": 128}
