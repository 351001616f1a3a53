"""StorePlanner reports each block once, when it becomes full, at its current GPU block id."""

from __future__ import annotations

from kvconnector_core.connector.planning import StorePlanner
from kvconnector_core.scheduler.output import CachedRequestData, SchedulerOutput
from kvconnector_core.testing import make_request, scheduler_output_for

BS = 4


def cached_step(rid: str, computed: int, scheduled: int, new_blocks: list[int] | None,
                resumed: bool = False) -> SchedulerOutput:
    cached = CachedRequestData.make_empty()
    cached.req_ids.append(rid)
    cached.new_token_ids.append([])
    cached.new_block_ids.append((new_blocks,) if new_blocks is not None else None)
    cached.num_computed_tokens.append(computed)
    if resumed:
        cached.resumed_req_ids.add(rid)
    return SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={rid: scheduled},
        total_num_scheduled_tokens=scheduled,
        finished_req_ids=set(),
        preempted_req_ids=set(),
    )


def test_blocks_are_reported_once_when_full_and_follow_a_resumed_table():
    request = make_request(prompt_token_ids=list(range(4 * BS + 2)), block_size=BS)
    planner = StorePlanner(BS)
    planner.admit(request, [7, 8], first_block=1)  # block 0 is already stored (a hit)
    # Step 1: 8 of 18 tokens computed -> block 1 (GPU 8) is full; block 0 is skipped.
    step = scheduler_output_for([(request, ([7, 8],), 8)])
    assert [(i, b) for _, i, b in planner.newly_full(step)] == [(1, 8)]
    # Step 2: 8 more tokens with two new blocks -> blocks 2 and 3 (GPU 9, 10).
    assert [
        (i, b) for _, i, b in planner.newly_full(cached_step(request.request_id, 8, 8, [9, 10]))
    ] == [(2, 9), (3, 10)]
    # Nothing new is full: nothing is reported again.
    assert list(planner.newly_full(cached_step(request.request_id, 16, 1, None))) == []
    planner.forget(request.request_id)
    assert list(planner.newly_full(cached_step(request.request_id, 17, 1, None))) == []


def test_resumed_request_gets_its_new_table():
    request = make_request(prompt_token_ids=list(range(3 * BS)), block_size=BS)
    planner = StorePlanner(BS)
    planner.admit(request, [3])
    assert list(planner.newly_full(scheduler_output_for([(request, ([3],), 2)]))) == []
    # Preempted and resumed with a new table; computes up to 8 tokens: blocks 0 and 1.
    step = cached_step(request.request_id, 0, 8, [5, 6, 11], resumed=True)
    assert [(i, b) for _, i, b in planner.newly_full(step)] == [(0, 5), (1, 6)]
