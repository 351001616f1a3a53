"""The scheduler's token accounting: the stats record and where each prompt token came from."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvconnector_core.request import Request

__all__ = ["SchedulerStats"]


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


class _Accounting:
    """Scheduler mixin: attributes each prompt token to the GPU cache, the connector or compute."""

    stats: SchedulerStats
    _prompt_progress: dict[str, int]

    def _account(self, req: Request, source: str, start: int, end: int) -> None:
        """Attribute prompt tokens ``[start, end)`` to ``source`` ("computed", "gpu", "connector").

        Tokens beyond the request's progress count once toward ``source``; tokens
        below it were counted before and now count as recomputed.
        """
        end = min(end, req.num_prompt_tokens)
        if end <= start:
            return
        progress = self._prompt_progress.get(req.request_id, 0)
        first = max(0, end - max(start, progress))
        stats = self.stats
        stats.num_recomputed_tokens += (end - start) - first
        if first:
            self._prompt_progress[req.request_id] = end
            if source == "computed":
                stats.num_prefill_tokens_computed += first
            elif source == "gpu":
                stats.num_gpu_cache_hit_tokens += first
            else:
                stats.num_connector_hit_tokens += first
