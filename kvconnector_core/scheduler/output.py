"""Records that cross the scheduler -> worker -> scheduler boundary.

The scheduler and the worker behave as if they ran in different processes: everything
the worker learns about a step comes from one :class:`SchedulerOutput`, and everything
the scheduler learns back comes from one :class:`ModelRunnerOutput`. Both are msgspec
Structs so they round-trip msgpack (``kv_connector_metadata`` is typed ``Any`` because
each connector brings its own metadata type).

Primitives:

- :class:`NewRequestData` -- a request the worker has not seen before (first schedule).
- :class:`CachedRequestData` -- columnar data for requests the worker already knows
  (running ones, and preempted ones being resumed).
- :class:`SchedulerOutput` -- the whole plan of one step.
- :class:`ModelRunnerOutput` -- sampled tokens plus the worker-side connector output.
- :func:`yield_req_data` -- walks new and cached requests uniformly; connectors use it to
  keep each request's block ids up to date.

Contract for the worker's view of a request (mirrors vLLM's GPU model runner without
pipeline parallelism):

- ``num_computed_tokens`` is authoritative: the worker processes token positions
  ``[num_computed_tokens, num_computed_tokens + num_scheduled_tokens[req_id])``. The
  scheduler may roll it back (failed KV loads); the worker follows.
- Block ids arrive per KV cache group. For a running request ``new_block_ids[i]`` holds
  only the blocks allocated this step (appended per group) or ``None`` if there are none.
  For a *resumed* request (in ``resumed_req_ids``) it holds **all** of the request's block
  ids, which replace what the worker had.
- Token ids: the worker appends the tokens it samples itself, so ``new_token_ids[i]`` is
  normally empty. For a resumed request it may hold every token of the request (prompt +
  output so far); the worker then replaces its copy. ``num_output_tokens[i]``, when given,
  is the scheduler's count of output tokens; the worker drops any sampled tokens beyond it
  (the scheduler discards a step's sample when that step's sync KV load failed).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec

from kvconnector_core.connector.metadata import KVConnectorOutput

__all__ = [
    "CachedRequestData",
    "ModelRunnerOutput",
    "NewRequestData",
    "SchedulerOutput",
    "yield_req_data",
]


class NewRequestData(msgspec.Struct):
    """A request scheduled for the first time (or re-sent in full).

    Attributes:
        req_id: the request id.
        prompt_token_ids: every prompt token of the request.
        block_ids: the request's block ids per KV cache group (``block_ids[g]`` belongs to
            group ``g``), covering the prefix-cache hit, connector loads and this step.
        num_computed_tokens: tokens already in the KV cache before this step (local prefix
            hit plus tokens loaded by a connector).
    """

    req_id: str
    prompt_token_ids: list[int]
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


class CachedRequestData(msgspec.Struct):
    """Requests the worker already knows, stored column-wise (index ``i`` = one request).

    Attributes:
        req_ids: ids of the scheduled requests.
        resumed_req_ids: the subset of ``req_ids`` resumed from preemption this step; their
            ``new_block_ids`` entry lists *all* their blocks and replaces the worker's copy.
        new_token_ids: per request, tokens the worker must take from the scheduler
            (empty normally; every token of the request for a resumed request, or empty
            if the worker should keep its own copy).
        new_block_ids: per request, block ids per group allocated this step (appended),
            all block ids for a resumed request (replaced), or ``None`` when unchanged.
        num_computed_tokens: per request, tokens already computed before this step.
        num_output_tokens: per request, the scheduler's number of output tokens; empty
            means "not given". The worker truncates its sampled tokens to this count.
    """

    req_ids: list[str]
    resumed_req_ids: set[str]
    new_token_ids: list[list[int]]
    new_block_ids: list[tuple[list[int], ...] | None]
    num_computed_tokens: list[int]
    num_output_tokens: list[int] = msgspec.field(default_factory=list)

    @classmethod
    def make_empty(cls) -> CachedRequestData:
        """Return a record holding no requests."""
        return cls(
            req_ids=[],
            resumed_req_ids=set(),
            new_token_ids=[],
            new_block_ids=[],
            num_computed_tokens=[],
        )

    @property
    def num_reqs(self) -> int:
        """Number of requests in this record."""
        return len(self.req_ids)


class SchedulerOutput(msgspec.Struct):
    """Everything the worker needs to run one engine step.

    Attributes:
        scheduled_new_reqs: requests the worker sees for the first time.
        scheduled_cached_reqs: requests the worker already knows.
        num_scheduled_tokens: tokens to compute this step, per request id.
        total_num_scheduled_tokens: sum of ``num_scheduled_tokens`` values.
        finished_req_ids: requests that finished (or were aborted) since the previous
            step; the worker drops their state and passes them to
            ``connector.get_finished``.
        preempted_req_ids: requests preempted in this step; their blocks are freed.
        kv_connector_metadata: the plan built by the scheduler-side connector's
            ``build_connector_meta`` (``None`` without a connector).
        has_sync_kv_loads: some request admitted this step loads KV synchronously;
            the worker must run ``start_load_kv`` (and let it finish) before the
            forward reads those blocks.
    """

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]
    preempted_req_ids: set[str]
    kv_connector_metadata: Any = None
    has_sync_kv_loads: bool = False

    @classmethod
    def make_empty(cls) -> SchedulerOutput:
        """Return a step with no scheduled work (connector hooks still run on it)."""
        return cls(
            scheduled_new_reqs=[],
            scheduled_cached_reqs=CachedRequestData.make_empty(),
            num_scheduled_tokens={},
            total_num_scheduled_tokens=0,
            finished_req_ids=set(),
            preempted_req_ids=set(),
        )

    @property
    def is_empty(self) -> bool:
        """True when no tokens are scheduled (the worker runs no forward)."""
        return self.total_num_scheduled_tokens == 0


class ModelRunnerOutput(msgspec.Struct):
    """What the worker reports back after one step.

    Attributes:
        req_ids: the requests that ran this step, in batch order.
        sampled_token_ids: per request id, the tokens sampled this step: one token when
            the step reached the end of the request's known tokens, empty when it was a
            partial prefill chunk.
        kv_connector_output: the worker-side connector's report (finished transfers,
            invalid blocks, stats, events), or ``None`` without a connector.
    """

    req_ids: list[str]
    sampled_token_ids: dict[str, list[int]]
    kv_connector_output: KVConnectorOutput | None = None

    @classmethod
    def make_empty(cls) -> ModelRunnerOutput:
        """Return an output with no requests and no connector report."""
        return cls(req_ids=[], sampled_token_ids={})


def yield_req_data(
    scheduler_output: SchedulerOutput,
) -> Iterator[tuple[str, tuple[list[int], ...], bool]]:
    """Walk every scheduled request with the block ids it gained this step.

    New requests come first, then cached ones, in the scheduler's order.

    Args:
        scheduler_output: the step to walk.

    Returns:
        An iterator of ``(req_id, new_block_id_groups, preempted)``. ``new_block_id_groups``
        holds, per KV cache group, the block ids to append to what the caller already has
        (``()`` when the request gained no block). ``preempted`` is True for a request
        resumed from preemption: its groups then hold *all* its blocks, so the caller must
        replace (not extend) its copy, and anything it planned on the old blocks is void.
    """
    for new_req in scheduler_output.scheduled_new_reqs:
        yield new_req.req_id, new_req.block_ids, False
    cached = scheduler_output.scheduled_cached_reqs
    for req_id, block_ids in zip(cached.req_ids, cached.new_block_ids):
        yield req_id, (block_ids if block_ids is not None else ()), req_id in cached.resumed_req_ids
