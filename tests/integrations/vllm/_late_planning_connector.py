"""A synchronous connector that plans a load only once its request is scheduled (for the
adapter suite).

vLLM's ExampleConnector does this: ``update_state_after_alloc`` notes that a request needs
a load, and ``build_connector_meta`` emits it when the request appears in
``scheduled_new_reqs``. In kvconnector's engine (and for a synchronous load in vLLM) that
is the step of the admission; behind the vLLM adapter, which presents every load as a
receive, it is a later step.
"""

from __future__ import annotations

from typing import Any

from _plain_sync_connector import PlainSyncConnector, PlainSyncPlan


class LatePlanningConnector(PlainSyncConnector):
    """PlainSyncConnector whose loads wait for their request in ``scheduled_new_reqs``."""

    name = "LatePlanningConnector"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.need_load: dict[str, list[tuple[bytes, int]]] = {}

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        if self.loads:
            self.need_load[request.request_id] = self.loads
            self.loads = []

    def build_connector_meta(self, scheduler_output):
        for new in scheduler_output.scheduled_new_reqs:
            self.loads += self.need_load.pop(new.req_id, [])
        plan = super().build_connector_meta(scheduler_output)
        assert isinstance(plan, PlainSyncPlan)
        return plan
