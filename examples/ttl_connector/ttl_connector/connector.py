"""TTLPinConnector: keep hot prefix blocks pinned in the GPU block pool for a time-to-live.

Scheduler-side only; the worker-side hooks are no-ops and it never loads
(``get_num_new_matched_tokens`` answers ``(0, False)``). Everything goes
through the ``GPUBlockPoolView`` handed to ``bind_gpu_block_pool``:

1. ``get_num_new_matched_tokens`` remembers the request's local prefix hit
   (no side effects; a repeated call overwrites the same entry).
2. ``update_state_after_alloc`` counts a hit for every block hash of that
   prefix. A pinned block gets its TTL refreshed; an unpinned one that reached
   ``min_hits`` is pinned with ``touch([block])`` (ref count + 1, so eviction
   cannot take it) if the budget ``max_pinned_blocks`` allows.
3. ``build_connector_meta`` (every step) and ``update_state_after_alloc``
   release expired pins with ``free_blocks([block])``.
4. ``reset_cache`` and ``shutdown`` release every pin.

Empty steps are not starvation: engines step with nothing scheduled after a
request finishes, while stores drain or loads arrive. Pins are released early
only when a step schedules nothing *and* a request asked about in that step's
``get_num_new_matched_tokens`` was not admitted (its ``update_state_after_alloc``
never came), which is what a pool held by pins looks like.

Stats (scheduler side) are per-call deltas of the counters, with the gauge
``pinned_blocks`` under ``"gauges"``, as the base class's stats contract says.

extra_config: ``ttl_seconds`` (float > 0, default 60), ``max_pinned_blocks``
(int >= 0, default a quarter of the pool), ``min_hits`` (int >= 1, default 1).
The clock is injectable: ``TTLPinConnector(..., clock=fake)`` or set
``connector.clock`` (a zero-argument callable returning seconds).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

import msgspec

from kvconnector_core.connector import (
    KVConnectorBase_V1,
    KVConnectorConfig,
    KVConnectorMetadata,
    KVConnectorRole,
)
from kvconnector_core.connector.settings import ConnectorSettings
from kvconnector_core.errors import ConfigError

if TYPE_CHECKING:
    from kvconnector_core.kv_cache.block_pool import GPUBlockPoolView, KVCacheBlock
    from kvconnector_core.kv_cache.hashing import BlockHash
    from kvconnector_core.kv_cache.kv_cache_manager import KVCacheBlocks
    from kvconnector_core.kv_cache.kv_cache_spec import KVCacheConfig
    from kvconnector_core.request import Request
    from kvconnector_core.scheduler.output import SchedulerOutput

__all__ = ["TTLMetadata", "TTLPinConnector", "TTLSettings"]


class TTLMetadata(KVConnectorMetadata, kw_only=True):
    """Empty plan: the worker side has nothing to do."""


class TTLSettings(ConnectorSettings):
    """The connector's ``extra_config``.

    Attributes:
        ttl_seconds: how long a pin lives after its last hit (> 0).
        max_pinned_blocks: most blocks pinned at once (>= 0); None: a quarter of the pool.
        min_hits: hits a block needs before it is pinned (>= 1).
    """

    ttl_seconds: Annotated[float, msgspec.Meta(gt=0)] = 60.0
    max_pinned_blocks: Annotated[int, msgspec.Meta(ge=0)] | None = None
    min_hits: Annotated[int, msgspec.Meta(ge=1)] = 1


def _check_budget(max_pinned_blocks: int, usable: int) -> None:
    if max_pinned_blocks >= usable:
        msg = (f"TTLPinConnector max_pinned_blocks={max_pinned_blocks} would pin the whole pool "
               f"({usable} usable blocks); use at most {max(usable - 1, 0)}")
        raise ConfigError(msg)


_COUNTERS = ("pins", "refreshes", "expiries", "pins_refused", "starvation_releases",
             "reset_releases")


@dataclass(slots=True)
class _Pin:
    block: KVCacheBlock
    expires_at: float


class TTLPinConnector(KVConnectorBase_V1):
    """Pins the GPU blocks of hot prefixes for a TTL refreshed on every hit."""

    name: ClassVar[str] = "TTLPinConnector"
    aliases: ClassVar[tuple[str, ...]] = ("ttl",)
    metadata_type: ClassVar[type[KVConnectorMetadata]] = TTLMetadata
    requires_block_pool: ClassVar[bool] = True
    settings_type: ClassVar[type[Any] | None] = TTLSettings

    def __init__(
        self,
        config: KVConnectorConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
        *,
        clock: Callable[[], float] | None = None,
    ) -> None:
        """Create the connector.

        Args:
            config: ``extra_config`` holds ``ttl_seconds``, ``max_pinned_blocks``, ``min_hits``.
            role: scheduler or worker (the worker side does nothing).
            kv_cache_config: the engine's KV cache layout (its block size locates prefix blocks).
            clock: seconds source; default ``time.monotonic``.

        Raises:
            ConfigError: an unknown key, a setting of the wrong type or out of range, or
                ``max_pinned_blocks`` would pin the whole pool of ``kv_cache_config``.
        """
        super().__init__(config, role, kv_cache_config)  # converts extra_config to TTLSettings
        settings: TTLSettings = self.settings
        self.ttl_seconds = settings.ttl_seconds
        self.min_hits = settings.min_hits
        self.max_pinned_blocks: int | None = settings.max_pinned_blocks
        num_blocks = getattr(kv_cache_config, "num_blocks", None)
        if self.max_pinned_blocks is not None and isinstance(num_blocks, int):
            # Checked again against the pool in bind_gpu_block_pool; failing here
            # reports a bad config when the engine is built, not mid-setup.
            _check_budget(self.max_pinned_blocks, num_blocks - 1)
        self.clock: Callable[[], float] = clock or time.monotonic
        self._pool: GPUBlockPoolView | None = None
        # Ordered by expiry: every pin gets the same TTL, so the order of the
        # last pin/refresh is the order of expiry and expiring is O(expired).
        self._pins: OrderedDict[bytes, _Pin] = OrderedDict()
        self._hits: OrderedDict[bytes, int] = OrderedDict()
        # Requests asked about (get_num_new_matched_tokens) in the current step and not
        # yet admitted; cleared by build_connector_meta, which ends every step.
        self._lookups: dict[str, int] = {}
        self._stats = dict.fromkeys(_COUNTERS, 0)

    # -------------------------------------------------------- scheduler side

    def bind_gpu_block_pool(self, gpu_block_pool: GPUBlockPoolView) -> None:
        """Keep the pool view; size the default budget from it.

        Raises:
            ConfigError: ``max_pinned_blocks`` leaves no block to allocate.
        """
        usable = gpu_block_pool.num_gpu_blocks - 1  # block 0 is the null block
        if self.max_pinned_blocks is None:
            self.max_pinned_blocks = usable // 4
        _check_budget(self.max_pinned_blocks, usable)
        self._pool = gpu_block_pool

    @property
    def _block_size(self) -> int:
        try:
            # A missing config (None) is one of the cases the except below handles.
            return int(self._kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size)  # type: ignore[union-attr]
        except (AttributeError, IndexError):
            return 1

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """Never loads: ``(0, False)``; remembers the local hit for ``update_state_after_alloc``."""
        self._lookups[request.request_id] = num_computed_tokens
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """Count hits on the request's prefix blocks; pin hot ones and refresh pinned ones."""
        num_hit = self._lookups.pop(request.request_id, 0)
        if self._pool is None or num_hit <= 0:
            return
        now = self.clock()
        self._expire(now)
        for block_hash in request.block_hashes[: num_hit // self._block_size]:
            self._on_hit(self._pool, block_hash, now)

    def _on_hit(self, pool: GPUBlockPoolView, block_hash: BlockHash, now: float) -> None:
        count = self._hits.pop(block_hash, 0) + 1
        self._hits[block_hash] = count
        if len(self._hits) > 4 * pool.num_gpu_blocks:  # bound the hit memory (LRU)
            self._hits.popitem(last=False)
        cached = pool.get_cached_block(block_hash, [0])
        pin = self._pins.get(block_hash)
        if pin is not None and cached is not None and cached[0] is pin.block:
            pin.expires_at = now + self.ttl_seconds
            self._pins.move_to_end(block_hash)
            self._stats["refreshes"] += 1
            return
        if pin is not None:  # the hash moved to another block: drop the stale pin
            self._unpin(block_hash)
        if cached is None or count < self.min_hits:
            return
        if len(self._pins) >= (self.max_pinned_blocks or 0):
            self._stats["pins_refused"] += 1
            return
        pool.touch([cached[0]])
        self._pins[block_hash] = _Pin(cached[0], now + self.ttl_seconds)
        self._stats["pins"] += 1

    def _unpin(self, block_hash: bytes) -> None:
        pin = self._pins.pop(block_hash)
        if self._pool is not None:
            self._pool.free_blocks([pin.block])

    def _expire(self, now: float) -> None:
        while self._pins:
            block_hash, pin = next(iter(self._pins.items()))
            if pin.expires_at > now:
                break
            self._unpin(block_hash)
            self._stats["expiries"] += 1

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> TTLMetadata:
        """Release expired pins, and pins that starve admission; the worker gets an empty plan.

        Starvation guard: a step that schedules nothing while a request it asked
        about stays unadmitted may mean that request needs blocks the pins hold
        (the budget only bounds pins, it cannot know the longest request). Each
        such step releases the older half of the pins, so admission is never
        blocked for more than a few steps. An empty step with no refused request
        (after a finish, while stores drain) keeps every pin. Pins are an
        optimisation; dropping some early never affects correctness.
        """
        self._expire(self.clock())
        refused = bool(self._lookups)
        self._lookups.clear()  # a request still waiting is asked again next step
        if (self._pins and refused and scheduler_output is not None
                and scheduler_output.total_num_scheduled_tokens == 0):
            for block_hash in list(self._pins)[: max(1, len(self._pins) // 2)]:
                self._unpin(block_hash)
                self._stats["starvation_releases"] += 1
        return TTLMetadata()

    def reset_cache(self) -> bool:
        """Release every pin and forget the hit counts, so the engine's prefix-cache reset can
        succeed."""
        self._stats["reset_releases"] += len(self._pins)
        self.shutdown()
        self._hits.clear()
        return True

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; never delays the free."""
        self._lookups.pop(request.request_id, None)
        return False, None

    def forget_requests(self, request_ids: set[str]) -> None:
        """Drop the remembered lookups of these requests (the guard's repair after a hook
        raised; pins belong to blocks, not requests, and stay)."""
        for rid in request_ids:
            self._lookups.pop(rid, None)

    @property
    def num_pinned_blocks(self) -> int:
        """Blocks currently pinned."""
        return len(self._pins)

    def is_pinned(self, block_hash: bytes) -> bool:
        """Whether the block with this hash is pinned."""
        return bytes(block_hash) in self._pins

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        """Counters since the previous call (``pins``, ``refreshes``, ``expiries``,
        ``pins_refused``, ``starvation_releases``, ``reset_releases``) and the gauge
        ``{"gauges": {"pinned_blocks": n}}`` (scheduler side)."""
        if self._role is not KVConnectorRole.SCHEDULER:
            return None
        counters, self._stats = self._stats, dict.fromkeys(_COUNTERS, 0)
        return {**counters, "gauges": {"pinned_blocks": len(self._pins)}}

    def shutdown(self) -> None:
        """Release every pin (idempotent)."""
        for block_hash in list(self._pins):
            self._unpin(block_hash)

    # ----------------------------------------------------------- worker side

    def start_load_kv(self, forward_context: Any = None) -> None:
        """Nothing to load."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any = None) -> None:
        """Nothing to save."""

    def wait_for_save(self) -> None:
        """Nothing to save."""
