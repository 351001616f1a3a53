"""Store planning for the scheduler side: which blocks became full in a step, and where.

A connector that saves blocks must follow each admitted request's GPU block table
through the steps (new blocks are appended; a resumed request gets a new table) and
store each block once it holds ``block_size`` computed tokens. :class:`StorePlanner`
does that bookkeeping::

    planner = StorePlanner(block_size)
    # update_state_after_alloc: blocks below ``first_block`` are not stored again
    planner.admit(request, blocks.get_block_ids()[0], first_block=loaded_blocks)
    # build_connector_meta
    for request, index, block_id in planner.newly_full(scheduler_output):
        plan.stores.append((request.block_hashes[index], block_id))
    # request_finished
    planner.forget(request.request_id)

Primitives: :class:`StorePlanner`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvconnector_core.scheduler.output import yield_req_data

if TYPE_CHECKING:
    from kvconnector_core.request import Request
    from kvconnector_core.scheduler.output import SchedulerOutput

__all__ = ["StorePlanner"]


class _Tracked:
    __slots__ = ("block_ids", "next_block", "request")

    def __init__(self, request: Request, block_ids: list[int], next_block: int) -> None:
        self.request = request
        self.block_ids = block_ids
        self.next_block = next_block


class StorePlanner:
    """Per admitted request, its GPU block ids (first KV cache group) and the next block to store.

    Args:
        block_size: tokens per block.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._tracked: dict[str, _Tracked] = {}

    def admit(self, request: Request, block_ids: list[int], first_block: int = 0) -> None:
        """Track ``request`` (call from ``update_state_after_alloc``).

        Args:
            request: the admitted request.
            block_ids: all its block ids (``blocks.get_block_ids()[0]``).
            first_block: blocks below this index are not reported (already stored, e.g.
                loaded by this connector or a prefix hit it already has).
        """
        self._tracked[request.request_id] = _Tracked(request, list(block_ids), first_block)

    def forget(self, request_id: str) -> None:
        """Stop tracking a request (call from ``request_finished``)."""
        self._tracked.pop(request_id, None)

    def newly_full(self, scheduler_output: SchedulerOutput) -> Iterator[tuple[Request, int, int]]:
        """``(request, block index, GPU block id)`` of every block that is full once this
        step's tokens are computed and was not reported before (call from
        ``build_connector_meta``). Only blocks with a hash are reported."""
        so = scheduler_output
        computed = {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        new_ids = set(computed) - set(cached.req_ids)
        for rid, added, resumed in yield_req_data(so):
            tracked = self._tracked.get(rid)
            if tracked is None:
                continue
            if resumed or rid in new_ids:  # the whole table: replace
                tracked.block_ids = list(added[0])
            elif added:
                tracked.block_ids.extend(added[0])
            done = computed[rid] + so.num_scheduled_tokens.get(rid, 0)
            full = min(done // self.block_size, len(tracked.request.block_hashes))
            for index in range(tracked.next_block, full):
                yield tracked.request, index, tracked.block_ids[index]
            tracked.next_block = max(tracked.next_block, full)
