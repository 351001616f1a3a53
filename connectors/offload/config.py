"""Settings of the CPU offloading connector: :class:`OffloadSettings` (the typed
``extra_config``) and :class:`OffloadConfig` (the settings checked against the KV cache layout).

Importing this module does not import torch: a config is checked where it is loaded.

Primitives: :class:`OffloadSettings`, :class:`OffloadConfig`, :class:`OffloadGroup`,
:data:`TRANSFER_METHODS`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal, get_args

import msgspec

from kvconnector_core.connector.settings import ConnectorSettings, convert_settings
from kvconnector_core.errors import ConfigError

if TYPE_CHECKING:
    from kvconnector_core.kv_cache.kv_cache_spec import KVCacheConfig

__all__ = ["TRANSFER_METHODS", "OffloadConfig", "OffloadGroup", "OffloadSettings"]

# The mover's methods (transfer.mover.METHODS), repeated so that validating a config does
# not import torch (a test checks the two agree).
_TransferMethod = Literal["auto", "pitched", "batched", "coalesced", "per_block", "gather"]

TRANSFER_METHODS: tuple[str, ...] = get_args(_TransferMethod)
"""The valid ``transfer_method`` values."""


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
        enable_events: emit CPU-medium KV events (and the tiers' events) when the engine
            consumes KV events (``KVConnectorConfig.enable_kv_cache_events``); False
            never emits any.
        transfer_method: how blocks are copied (``"auto"`` picks).
        copy_thread: make the copies on the mover's background thread; None (default):
            on CUDA only. On a CPU KV cache the thread makes the copies themselves; with
            small blocks handing a job over costs the engine thread about what the copy
            does (``benchmarks/RESULTS.md``, "Connector cost per step").
        tiers: secondary tiers behind the CPU tier, in order, each a dict such as
            ``{"type": "disk", "path": ..., "capacity_bytes": ...}`` (``docs/tiers.md``).
        recency: what a finished request marks as recently used in the CPU tier:
            ``"all_keys"`` (default, vLLM 0.33's rule: every chunk it loaded, stored or
            found held) or ``"hits_only"`` (only the chunks its admission hit, on the GPU
            or in the CPU tier; higher hit rates on ``benchmarks/RESULTS.md``'s traces).
    """

    num_cpu_blocks: _Positive | None = None
    cpu_bytes: _Positive | None = None
    block_size: _Positive | None = None
    blocks_per_chunk: _Positive | None = None
    cache_policy: str = "lru"
    enable_events: bool = True
    transfer_method: _TransferMethod = "auto"
    copy_thread: bool | None = None
    # Each tier's own settings Struct (connectors.offload.tiers) checks its keys when it is
    # made.
    tiers: list[dict[str, Any]] = msgspec.field(default_factory=list)
    recency: Literal["all_keys", "hits_only"] = "all_keys"


@dataclass(frozen=True, slots=True)
class OffloadGroup:
    """How one KV cache group is offloaded.

    Attributes:
        index: the group's index (its offload keys end with it as 4 big-endian bytes).
        block_size: tokens per GPU block of the group.
        factor: GPU blocks of the group per offloaded chunk.
        window: sliding window in tokens (0: not a sliding-window group).
        attention_chunk: chunked-local attention chunk in tokens (0: not chunked).
    """

    index: int
    block_size: int
    factor: int
    window: int = 0
    attention_chunk: int = 0

    @property
    def is_full(self) -> bool:
        """True for full attention: a hit needs every chunk of the prefix."""
        return not (self.window or self.attention_chunk)

    def first_needed_token(self, num_tokens: int) -> int:
        """First token whose KV the group reads to continue after ``num_tokens`` tokens.

        Full attention: 0. Sliding window: the window's start. Chunked local: the start
        of the current attention chunk.
        """
        if self.window:
            return max(0, num_tokens - self.window + 1)
        if self.attention_chunk:
            return num_tokens // self.attention_chunk * self.attention_chunk
        return 0


@dataclass(frozen=True, slots=True)
class OffloadConfig:
    """The settings checked against the KV cache layout.

    Attributes:
        gpu_block_size: the alignment of loads: the least common multiple of the KV
            cache groups' block sizes (with one group, its block size).
        blocks_per_chunk: ``gpu_block_size`` blocks per offloaded chunk.
        num_cpu_blocks: offloaded chunks the CPU tier holds.
        cache_policy: eviction policy name.
        enable_events: emit CPU-medium KV events.
        transfer_method: :class:`KVBlockMover` method.
        copy_thread: :class:`KVBlockMover` ``issue_thread`` (None: on CUDA only).
        groups: per KV cache group, its geometry (one entry for a plain model).
        tiers: settings of the secondary tiers behind the CPU tier, in order
            (``docs/tiers.md``); empty for none.
        layout: the chunk geometry (block size, chunk factor, bytes per block); shared
            tiers put it in their key namespace so engines of other layouts never mix.
        recency: ``"all_keys"`` or ``"hits_only"`` (see :class:`OffloadSettings`).
    """

    gpu_block_size: int
    blocks_per_chunk: int
    num_cpu_blocks: int
    cache_policy: str
    enable_events: bool
    transfer_method: str
    groups: tuple[OffloadGroup, ...] = ()
    tiers: tuple[dict[str, Any], ...] = ()
    layout: str = ""
    copy_thread: bool | None = None
    recency: str = "all_keys"

    @property
    def chunk_tokens(self) -> int:
        """Tokens per offloaded chunk."""
        return self.gpu_block_size * self.blocks_per_chunk

    @property
    def sub_blocks_per_chunk(self) -> int:
        """CPU sub-blocks (one GPU block of all layers each) per offloaded chunk: the
        largest group factor (a group with smaller blocks has more per chunk)."""
        return max((g.factor for g in self.groups), default=self.blocks_per_chunk)

    @classmethod
    def from_extra(cls, extra: dict[str, object], kv_cache_config: KVCacheConfig | None
                   ) -> OffloadConfig:
        """Convert ``extra_config`` to :class:`OffloadSettings`, then check it (see
        :meth:`from_settings`)."""
        return cls.from_settings(convert_settings("OffloadingConnector", OffloadSettings, extra),
                                 kv_cache_config)

    @classmethod
    def from_settings(cls, settings: OffloadSettings, kv_cache_config: KVCacheConfig | None
                      ) -> OffloadConfig:
        """Check the settings against the KV cache layout.

        Raises:
            ConfigError: missing KV cache config, a block size that is not a multiple of
                every group's GPU block size, both ``block_size`` and ``blocks_per_chunk``
                or both ``num_cpu_blocks`` and ``cpu_bytes``, or no CPU capacity.
        """
        if kv_cache_config is None:
            msg = "OffloadingConnector needs the engine's KV cache config (got None)"
            raise ConfigError(msg)
        specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
        gpu_bs = math.lcm(*(spec.block_size for spec in specs))
        factor = _blocks_per_chunk(settings, gpu_bs)
        chunk_tokens = factor * gpu_bs
        groups = tuple(
            OffloadGroup(i, spec.block_size, chunk_tokens // spec.block_size,
                         getattr(spec, "sliding_window", 0) or 0,
                         getattr(spec, "attention_chunk_size", 0) or 0)
            for i, spec in enumerate(specs))
        chunk_bytes = max(g.factor for g in groups) * kv_cache_config.bytes_per_block
        num = _num_cpu_blocks(settings, chunk_bytes)
        return cls(gpu_bs, factor, num, settings.cache_policy, settings.enable_events,
                   settings.transfer_method, groups, tuple(dict(t) for t in settings.tiers),
                   f"bs{gpu_bs}x{factor}-{kv_cache_config.bytes_per_block}B",
                   settings.copy_thread, settings.recency)


def _num_cpu_blocks(settings: OffloadSettings, chunk_bytes: int) -> int:
    """Offloaded chunks the CPU tier holds: ``num_cpu_blocks``, or what ``cpu_bytes``
    holds; at least one, and no more than the host's memory holds.

    Raises:
        ConfigError: both or neither given, or a capacity out of range.
    """
    if settings.num_cpu_blocks is not None and settings.cpu_bytes is not None:
        msg = ("OffloadingConnector: give either 'num_cpu_blocks' or 'cpu_bytes' in "
               "extra_config, not both")
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
    host = _host_memory_bytes()
    if host is not None and num * chunk_bytes > host:
        # Checked here, before anything is allocated: otherwise the allocator fails
        # (or the OOM killer ends the process) with a message that names no setting.
        what = (f"num_cpu_blocks={settings.num_cpu_blocks}"
                if settings.num_cpu_blocks is not None else f"cpu_bytes={settings.cpu_bytes}")
        msg = (f"OffloadingConnector: extra_config {what} needs {num * chunk_bytes} bytes "
               f"({num} offloaded blocks of {chunk_bytes} bytes), more than this host's "
               f"{host} bytes of memory; valid: at most {host // chunk_bytes} blocks")
        raise ConfigError(msg)
    return num


def _host_memory_bytes() -> int | None:
    """The host's physical memory, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def _blocks_per_chunk(settings: OffloadSettings, gpu_bs: int) -> int:
    if settings.block_size is not None and settings.blocks_per_chunk is not None:
        msg = ("OffloadingConnector: give either 'block_size' or 'blocks_per_chunk' in "
               "extra_config, not both")
        raise ConfigError(msg)
    if settings.block_size is not None:
        if settings.block_size % gpu_bs:
            msg = (f"OffloadingConnector: extra_config block_size={settings.block_size} must "
                   f"be a positive multiple of the GPU block size {gpu_bs}")
            raise ConfigError(msg)
        return settings.block_size // gpu_bs
    return settings.blocks_per_chunk or 1
