"""The scheduler's admission helpers: clamping the connector's claim, reserving blocks."""

from __future__ import annotations

from collections import deque

from kvconnector_core.connector.guard import GuardedScheduler
from kvconnector_core.kv_cache.kv_cache_manager import KVCacheManager
from kvconnector_core.request import Request


def _clamp_external(claimed: int, num_tokens: int, num_local: int) -> tuple[int, int]:
    """``(tokens the connector loads, tokens counted as computed by that load)``.

    The full-prompt-hit rule (vLLM 0.33 does the same after an async load): a hit may
    cover the whole prompt; the connector is told its own answer (clamped to the prompt)
    and loads every block it claimed, while the engine still computes the last prompt
    token, whose logits it needs, rewriting that token's slot with the same values. A hit
    that would leave nothing but that last token to load is no load at all.
    """
    claimed = max(0, min(claimed, num_tokens - num_local))
    counted = min(claimed, num_tokens - 1 - num_local)
    return (claimed, counted) if counted > 0 else (0, 0)


class _Admission:
    """Scheduler mixin: the blocks waiting requests still need, and the connector's alloc hook."""

    kv_cache_manager: KVCacheManager
    connector: GuardedScheduler | None
    waiting: deque[Request]

    def _remaining_need(self, req: Request) -> int:
        """Blocks a waiting request that already holds blocks still needs (admission-capped).

        Counts what admission counts (:meth:`KVCacheManager.admission_tokens`).
        """
        full = self.kv_cache_manager.admission_tokens(req)
        coord = self.kv_cache_manager.coordinator
        return coord.get_num_blocks_to_allocate(
            req.request_id, full, self.kv_cache_manager.empty_kv_cache_blocks.blocks,
            req.num_computed_tokens, apply_admission_cap=True,
        )

    def _reserved_blocks(self) -> int:
        """Sum of :meth:`_remaining_need` over waiting requests that hold blocks."""
        return sum(self._remaining_need(r) for r in self.waiting if r.num_computed_tokens > 0)

    def _call_update_state(self, req: Request, num_external: int) -> bool:
        """Tell the connector about an admitted request; False if the hook raised."""
        assert self.connector is not None  # noqa: S101 - checked by the caller
        blocks = self.kv_cache_manager.get_blocks(req.request_id)
        return self.connector.update_state_after_alloc(req, blocks, num_external)
