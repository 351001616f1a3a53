"""Settings of the CPU offloading connector: :class:`OffloadSettings` (the typed
``extra_config``) and :class:`OffloadConfig` (the settings checked against the KV cache layout).

Importing this module does not import torch: a config is checked where it is loaded.

Primitives: :class:`OffloadSettings`, :class:`OffloadConfig`, :data:`TRANSFER_METHODS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec

from kvconnector_core.connector.settings import ConnectorSettings, convert_settings
from kvconnector_core.errors import ConfigError

if TYPE_CHECKING:
    from kvconnector_core.kv_cache.kv_cache_spec import KVCacheConfig

__all__ = ["TRANSFER_METHODS", "OffloadConfig", "OffloadSettings"]

# transfer.METHODS, repeated so that validating a config does not import torch
# (a test checks the two agree).
TRANSFER_METHODS = ("auto", "pitched", "batched", "coalesced", "per_block", "gather")


_Positive = Annotated[int, msgspec.Meta(ge=1)]


class OffloadSettings(ConnectorSettings):
    """The connector's ``extra_config`` (see ``docs/offload.md``).

    Attributes:
        num_cpu_blocks: offloaded blocks the CPU tier holds (or give ``cpu_bytes``).
        cpu_bytes: the CPU tier's size in bytes (or give ``num_cpu_blocks``).
        block_size: tokens per offloaded block, a multiple of the GPU block size (or give
            ``blocks_per_chunk``; default: one GPU block).
        blocks_per_chunk: GPU blocks per offloaded block.
        cache_policy: eviction policy, ``"lru"`` or ``"arc"``.
        enable_events: emit CPU-medium KV events.
        transfer_method: how blocks are copied (``"auto"`` picks).
        tiers: secondary tiers behind the CPU tier, in order, each a dict such as
            ``{"type": "disk", "path": ..., "capacity_bytes": ...}`` (``docs/tiers.md``).
    """

    num_cpu_blocks: _Positive | None = None
    cpu_bytes: _Positive | None = None
    block_size: _Positive | None = None
    blocks_per_chunk: _Positive | None = None
    cache_policy: str = "lru"
    enable_events: bool = True
    transfer_method: Literal["auto", "pitched", "batched", "coalesced", "per_block", "gather"] = "auto"
    # Each tier's own settings Struct (connectors.tiers) checks its keys when it is made.
    tiers: list[dict[str, Any]] = msgspec.field(default_factory=list)


@dataclass(frozen=True, slots=True)
class OffloadConfig:
    """The settings checked against the KV cache layout.

    Attributes:
        gpu_block_size: tokens per GPU block (from the KV cache spec).
        blocks_per_chunk: GPU blocks per offloaded chunk (the factor ``f``).
        num_cpu_blocks: offloaded chunks the CPU tier holds.
        cache_policy: eviction policy name.
        enable_events: emit CPU-medium KV events.
        transfer_method: :class:`KVBlockMover` method.
        tiers: settings of the secondary tiers behind the CPU tier, in order
            (``docs/tiers.md``); empty for none.
        layout: the chunk geometry (block size, chunk factor, bytes per block); shared
            tiers put it in their key namespace so engines of other layouts never mix.
    """

    gpu_block_size: int
    blocks_per_chunk: int
    num_cpu_blocks: int
    cache_policy: str
    enable_events: bool
    transfer_method: str
    tiers: tuple[dict[str, Any], ...] = ()
    layout: str = ""

    @property
    def chunk_tokens(self) -> int:
        """Tokens per offloaded chunk."""
        return self.gpu_block_size * self.blocks_per_chunk

    @classmethod
    def from_extra(cls, extra: dict[str, object], kv_cache_config: KVCacheConfig | None) -> OffloadConfig:
        """Convert ``extra_config`` to :class:`OffloadSettings`, then check it (see :meth:`from_settings`)."""
        return cls.from_settings(convert_settings("OffloadingConnector", OffloadSettings, extra),
                                 kv_cache_config)

    @classmethod
    def from_settings(cls, settings: OffloadSettings, kv_cache_config: KVCacheConfig | None) -> OffloadConfig:
        """Check the settings against the KV cache layout.

        Raises:
            ConfigError: missing KV cache config, several KV cache groups, a block size
                that is not a multiple of the GPU block size, both ``block_size`` and
                ``blocks_per_chunk`` or both ``num_cpu_blocks`` and ``cpu_bytes``, or no
                CPU capacity.
        """
        if kv_cache_config is None:
            msg = "OffloadingConnector needs the engine's KV cache config (got None)"
            raise ConfigError(msg)
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            msg = (f"OffloadingConnector supports a single KV cache group; this model has "
                   f"{len(groups)} (hybrid models are a known limitation)")
            raise ConfigError(msg)
        gpu_bs = groups[0].kv_cache_spec.block_size
        factor = _blocks_per_chunk(settings, gpu_bs)
        chunk_bytes = factor * kv_cache_config.bytes_per_block
        if settings.num_cpu_blocks is not None and settings.cpu_bytes is not None:
            msg = "OffloadingConnector: give either 'num_cpu_blocks' or 'cpu_bytes' in extra_config, not both"
            raise ConfigError(msg)
        if settings.num_cpu_blocks is not None:
            num = settings.num_cpu_blocks
        elif settings.cpu_bytes is not None:
            num = settings.cpu_bytes // chunk_bytes
        else:
            msg = ("OffloadingConnector needs 'num_cpu_blocks' (offloaded blocks) or "
                   f"'cpu_bytes' in extra_config (one offloaded block is {chunk_bytes} bytes)")
            raise ConfigError(msg)
        if num < 1:
            msg = (f"OffloadingConnector: the CPU tier must hold at least one offloaded block of "
                   f"{chunk_bytes} bytes; extra_config cpu_bytes={settings.cpu_bytes} is less")
            raise ConfigError(msg)
        return cls(gpu_bs, factor, num, settings.cache_policy, settings.enable_events,
                   settings.transfer_method, tuple(dict(t) for t in settings.tiers),
                   f"bs{gpu_bs}x{factor}-{kv_cache_config.bytes_per_block}B")


def _blocks_per_chunk(settings: OffloadSettings, gpu_bs: int) -> int:
    if settings.block_size is not None and settings.blocks_per_chunk is not None:
        msg = "OffloadingConnector: give either 'block_size' or 'blocks_per_chunk' in extra_config, not both"
        raise ConfigError(msg)
    if settings.block_size is not None:
        if settings.block_size % gpu_bs:
            msg = (f"OffloadingConnector: extra_config block_size={settings.block_size} must be a "
                   f"positive multiple of the GPU block size {gpu_bs}")
            raise ConfigError(msg)
        return settings.block_size // gpu_bs
    return settings.blocks_per_chunk or 1
