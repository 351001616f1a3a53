"""The scheduler's counters and where each prompt token came from.

Primitives:

- :class:`SchedulerStats` -- counters of what the scheduler did, and the rule that
  attributes each prompt token once to the GPU prefix cache, the connector or compute.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

__all__ = ["SchedulerStats", "TokenSource"]

TokenSource = Literal["computed", "gpu", "connector"]
"""Where prompt tokens came from: computed by the model, the GPU prefix cache, a connector load."""


@dataclass
class SchedulerStats:
    """Counters of what the scheduler did, since creation.

    Attributes:
        num_steps: ``schedule()`` calls.
        num_prompt_tokens: prompt tokens of all admitted requests (first admission).
        num_prefill_tokens_computed: prompt tokens the model computed for the first time.
        num_gpu_cache_hit_tokens: prompt tokens first served from the GPU prefix cache.
        num_connector_hit_tokens: prompt tokens first served by the connector (successful loads).
        num_recomputed_tokens: prompt tokens computed or loaded again after a preemption or
            a failed load. Each prompt token is counted once in exactly one of the three
            counters above, so they add up to ``num_prompt_tokens`` once all requests finish.
        num_preemptions: requests preempted by recompute.
        num_failed_loads_recovered: requests rolled back and recomputed after a failed load.
        num_requests_failed: requests finished with FINISHED_ERROR.
        num_rejected: requests that can never fit the KV cache.
        connector_errors: per hook name, how many times the connector raised.
    """

    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_prefill_tokens_computed: int = 0
    num_gpu_cache_hit_tokens: int = 0
    num_connector_hit_tokens: int = 0
    num_recomputed_tokens: int = 0
    num_preemptions: int = 0
    num_failed_loads_recovered: int = 0
    num_requests_failed: int = 0
    num_rejected: int = 0
    connector_errors: dict[str, int] = field(default_factory=dict)

    def count_prompt_tokens(self, source: TokenSource, start: int, end: int, progress: int) -> int:
        """Attribute one request's prompt tokens ``[start, end)`` to ``source``.

        Tokens at or beyond the request's ``progress`` (how far its prompt was attributed
        before) count once toward ``source``; tokens below it were counted before and now
        count as recomputed.

        Args:
            source: where the tokens came from.
            start: first prompt token of the range.
            end: end of the range, at most the prompt's length.
            progress: the request's progress before this call.

        Returns:
            The request's progress after this call.
        """
        if end <= start:
            return progress
        first = max(0, end - max(start, progress))
        self.num_recomputed_tokens += (end - start) - first
        if not first:
            return progress
        if source == "computed":
            self.num_prefill_tokens_computed += first
        elif source == "gpu":
            self.num_gpu_cache_hit_tokens += first
        else:
            self.num_connector_hit_tokens += first
        return end
