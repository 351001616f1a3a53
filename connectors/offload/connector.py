"""OffloadingConnector: a CPU tier for KV blocks evicted from (or copied out of) the GPU.

Registered as ``OffloadingConnector``, alias ``cpu_offload``. An offloaded *chunk* holds
one KV cache group's GPU blocks of ``chunk_tokens`` consecutive tokens of a request; its
key is the chained hash of its last block (which identifies the whole prefix) plus the
group index (4 bytes), so hybrid models offload per group. See ``docs/offload.md`` for
the config keys and the sliding-window rules.

The connector is a :class:`~kvconnector_core.connector.base.RoleSplitConnector`: the
scheduler-role instance is an :class:`~connectors.offload.scheduler.OffloadSchedulerSide`
(plans loads and stores over the CPU slots, learns completions), the worker-role instance
an :class:`~connectors.offload.worker.OffloadWorkerSide` (moves the bytes). They
share nothing but the plan (:class:`OffloadingConnectorMetadata`) and the job completions
(:class:`OffloadWorkerMetadata`, carried in ``KVConnectorOutput.kv_connector_worker_meta``,
never in the stats, so they survive wrapping in a MultiConnector).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar

from connectors.offload.config import TRANSFER_METHODS, OffloadConfig, OffloadSettings
from connectors.offload.records import (
    OffloadingConnectorMetadata,
    OffloadWorkerMetadata,
    TransferJobSpec,
)
from connectors.offload.scheduler import OffloadSchedulerSide
from connectors.offload.tiers import Shard
from connectors.offload.worker import OffloadWorkerSide
from kvconnector_core.connector.base import RoleSplitConnector
from kvconnector_core.errors import ConfigError

if TYPE_CHECKING:
    from connectors.offload.manager import CPUOffloadingManager
    from connectors.offload.transfer import KVBlockMover
    from kvconnector_core.connector.base import KVConnectorRole
    from kvconnector_core.connector.config import KVConnectorConfig
    from kvconnector_core.connector.demo import DemoOptions
    from kvconnector_core.connector.metadata import KVConnectorMetadata
    from kvconnector_core.kv_cache.kv_cache_spec import KVCacheConfig
    from kvconnector_core.kv_events import KVCacheEvent

__all__ = [
    "TRANSFER_METHODS",
    "OffloadConfig",
    "OffloadSettings",
    "OffloadWorkerMetadata",
    "OffloadingConnector",
    "OffloadingConnectorMetadata",
    "TransferJobSpec",
]


class OffloadingConnector(RoleSplitConnector):
    """CPU offloading connector (see the module docstring).

    Args:
        config: connector config; ``extra_config`` keys are documented in
            ``docs/offload.md`` (``num_cpu_blocks`` / ``cpu_bytes``, ``block_size`` /
            ``blocks_per_chunk``, ``cache_policy``, ``enable_events``, ``transfer_method``,
            ``tiers``: secondary tiers behind the CPU tier, see ``docs/tiers.md``).
        role: scheduler or worker.
        kv_cache_config: the engine's KV cache layout (one or several groups).

    Raises:
        ConfigError: invalid ``extra_config`` (see :class:`OffloadSettings`,
            :meth:`OffloadConfig.from_settings`).
    """

    name: ClassVar[str] = "OffloadingConnector"
    settings_type: ClassVar[type[Any] | None] = OffloadSettings
    metadata_type: ClassVar[type[KVConnectorMetadata]] = OffloadingConnectorMetadata
    supports_async_load: ClassVar[bool] = True
    has_sync_kv_loads: ClassVar[bool] = False
    # Whole blocks of all layers move once per step: the per-layer hooks do nothing.
    uses_layer_hooks: ClassVar[bool] = False
    # Hybrid models: keys carry the group, lookups and loads are window-aware. Read by
    # the vLLM adapter (KVConnectorAdapterHMA runs it under vLLM's hybrid KV cache manager).
    supports_multiple_kv_cache_groups: ClassVar[bool] = True

    def __init__(self, config: KVConnectorConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        # Before the base class, which builds the role object from it; the base converts
        # extra_config to settings_type again (cheap) and keeps it as self.settings.
        offload_config = OffloadConfig.from_extra(dict(config.extra_config), kv_cache_config)
        if offload_config.enable_events and not config.enable_kv_cache_events:
            # Nobody consumes KV events: build none (the CPU tier's cost 30-40 us a step).
            offload_config = dataclasses.replace(offload_config, enable_events=False)
        self.offload_config = offload_config
        """The validated ``extra_config`` (``enable_events`` off when the engine
        consumes no KV events)."""
        super().__init__(config, role, kv_cache_config)

    @classmethod
    def demo_extra_config(cls, options: DemoOptions) -> dict[str, Any]:
        """A CPU tier four times the GPU pool (what ``kvconnector run`` uses).

        Honours every option: ``cpu_blocks`` (``--cpu-blocks``) sizes the CPU tier instead,
        ``tiers`` (``--tier``: ``disk:PATH`` or ``redis:URL``, in order) become secondary
        tiers behind it.

        Raises:
            ConfigError: a tier that is neither ``disk:PATH`` nor ``redis:URL``.
        """
        extra: dict[str, Any] = {
            "num_cpu_blocks": options.cpu_blocks or 4 * options.num_gpu_blocks}
        if options.tiers:
            extra["tiers"] = [_run_tier_settings(t) for t in options.tiers]
        return extra

    def make_scheduler_side(self) -> OffloadSchedulerSide:
        """The scheduler-side object."""
        return OffloadSchedulerSide(self.config, self.offload_config)

    def make_worker_side(self) -> OffloadWorkerSide:
        """The worker-side object."""
        config = self.config
        # Under TP / PP this worker's tier keys name its shard (docs/tiers.md).
        shard = Shard(config.rank, config.world_size, config.pipeline_parallel_size
                      ) if config.world_size > 1 else None
        return OffloadWorkerSide(self.offload_config, shard)

    @property
    def manager(self) -> CPUOffloadingManager:
        """The CPU slots' manager (scheduler-role instance only)."""
        side = self.scheduler_side
        assert isinstance(side, OffloadSchedulerSide)  # noqa: S101 - built by make_scheduler_side
        return side.manager

    def get_kv_connector_kv_cache_events(self) -> list[KVCacheEvent]:
        """Worker role: the secondary tiers' stored / removed chunks (vLLM's optional hook)."""
        side = self.worker_side
        assert isinstance(side, OffloadWorkerSide)  # noqa: S101 - built by make_worker_side
        return side.get_kv_connector_kv_cache_events()

    @property
    def mover(self) -> KVBlockMover | None:
        """The block mover, once ``register_kv_caches`` ran (worker-role instance only)."""
        side = self.worker_side
        assert isinstance(side, OffloadWorkerSide)  # noqa: S101 - built by make_worker_side
        return side.mover


# The tiny model of `kvconnector run`: the Redis key namespace names it.
_RUN_MODEL = "kvconnector-run"
_RUN_DISK_BYTES = 1 << 30


def _run_tier_settings(text: str) -> dict[str, Any]:
    """``disk:PATH``, ``redis:URL`` or a bare ``redis://`` URL (``kvconnector run --tier``)
    as tier settings."""
    if text.startswith(("redis://", "rediss://")):  # the URL alone names its kind
        return {"type": "redis", "url": text, "model": _RUN_MODEL}
    kind, _, where = text.partition(":")
    if kind == "disk" and where:
        return {"type": "disk", "path": where, "capacity_bytes": _RUN_DISK_BYTES}
    if kind == "redis" and where:
        return {"type": "redis", "url": where, "model": _RUN_MODEL}
    msg = f"--tier {text!r} is not valid; expected disk:PATH or redis:redis://HOST:PORT"
    raise ConfigError(msg)
