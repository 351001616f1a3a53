"""What the scheduler knows about one request beyond the request itself.

Primitives:

- :class:`RequestState` -- one record per request the scheduler tracks: where its KV loads
  stand, what the worker has seen, how far its prompt was attributed in the stats.
- :class:`RequestsView` -- the tracked requests as a read-only mapping of id to request.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from kvconnector_core.request import Request
from kvconnector_core.scheduler.stats import SchedulerStats, TokenSource

__all__ = ["RequestState", "RequestsView"]


@dataclass(slots=True)
class RequestState:
    """The scheduler's record of one request, from ``add_request`` until its blocks are freed.

    The flags are independent: a request may, say, have its async load reported, failed and
    be recompute-only at once.

    Attributes:
        request: the request.
        prompt_progress: prompt tokens already attributed in the stats; None until the
            request is first admitted.
        sent_to_worker: the worker was sent it as new (and it has not finished since), so
            a later schedule resumes it instead.
        recompute_only: its KV load failed once: it recomputes instead of asking the
            connector again, so a persistently failing connector cannot livelock it.
        sync_load: it loads KV synchronously this step; its loaded blocks are cached only
            once the worker reports no error for it.
        async_load_start: with an async load in flight, where the load starts (its local hit).
        load_plan: the number of the connector plan that carries its async load; a load put
            in flight gets the number of the next plan built.
        load_reported: the connector reported its async load finished (or failed).
        load_failed: its async load failed; it recomputes from where it was rolled back.
        free_after_load: aborted while loading, its connector asked to delay the free: the
            blocks wait for the send once the load reports.
    """

    request: Request
    prompt_progress: int | None = None
    sent_to_worker: bool = False
    recompute_only: bool = False
    sync_load: bool = False
    async_load_start: int | None = None
    load_plan: int | None = None
    load_reported: bool = False
    load_failed: bool = False
    free_after_load: bool = False

    def count_prompt(self, stats: SchedulerStats, source: TokenSource, start: int,
                     end: int) -> None:
        """Attribute the request's prompt tokens ``[start, end)`` to ``source`` in ``stats``.

        See :meth:`SchedulerStats.count_prompt_tokens`; tokens past the prompt are ignored.
        """
        end = min(end, self.request.num_prompt_tokens)
        if end > start:
            self.prompt_progress = stats.count_prompt_tokens(source, start, end,
                                                             self.prompt_progress or 0)

    def drop_live_state(self) -> None:
        """Drop what only a live request needs (it finished; its blocks may stay a while)."""
        self.recompute_only = False
        self.sync_load = False
        self.async_load_start = None
        self.prompt_progress = None
        self.sent_to_worker = False


class RequestsView(Mapping[str, Request]):
    """The tracked requests by id, read-only, backed by the scheduler's records.

    Args:
        states: the scheduler's records by request id (read live, never copied).
    """

    __slots__ = ("_states",)

    def __init__(self, states: Mapping[str, RequestState]) -> None:
        self._states = states

    def __getitem__(self, request_id: str) -> Request:
        return self._states[request_id].request

    def __iter__(self) -> Iterator[str]:
        return iter(self._states)

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._states
