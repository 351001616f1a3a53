"""Validated settings of the CPU offloading connector (:class:`OffloadConfig`).

Importing this module does not import torch: a config is checked where it is loaded.

Primitives: :class:`OffloadConfig`, :class:`OffloadGroup`, :data:`TRANSFER_METHODS`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvconnector_core.errors import ConfigError

if TYPE_CHECKING:
    from kvconnector_core.kv_cache.kv_cache_spec import KVCacheConfig

__all__ = ["TRANSFER_METHODS", "OffloadConfig", "OffloadGroup"]

# transfer.METHODS, repeated so that validating a config does not import torch
# (a test checks the two agree).
TRANSFER_METHODS = ("auto", "coalesced", "per_block", "gather")


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
    """Validated ``extra_config`` of the connector.

    Attributes:
        gpu_block_size: the alignment of loads: the least common multiple of the KV
            cache groups' block sizes (with one group, its block size).
        blocks_per_chunk: ``gpu_block_size`` blocks per offloaded chunk.
        num_cpu_blocks: offloaded chunks the CPU tier holds.
        cache_policy: eviction policy name.
        enable_events: emit CPU-medium KV events.
        transfer_method: :class:`KVBlockMover` method.
        groups: per KV cache group, its geometry (one entry for a plain model).
    """

    gpu_block_size: int
    blocks_per_chunk: int
    num_cpu_blocks: int
    cache_policy: str
    enable_events: bool
    transfer_method: str
    groups: tuple[OffloadGroup, ...] = ()

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
    def from_extra(cls, extra: dict[str, Any], kv_cache_config: KVCacheConfig | None) -> OffloadConfig:
        """Validate ``extra_config`` against the KV cache layout.

        Raises:
            ConfigError: missing KV cache config, a block size that is not a multiple of
                every group's GPU block size, both ``block_size`` and
                ``blocks_per_chunk``, or no / a non-positive CPU capacity.
        """
        if kv_cache_config is None:
            msg = "OffloadingConnector needs the engine's KV cache config (got None)"
            raise ConfigError(msg)
        specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
        gpu_bs = math.lcm(*(spec.block_size for spec in specs))
        factor = _blocks_per_chunk(extra, gpu_bs)
        chunk_tokens = factor * gpu_bs
        groups = tuple(
            OffloadGroup(i, spec.block_size, chunk_tokens // spec.block_size,
                         getattr(spec, "sliding_window", 0) or 0,
                         getattr(spec, "attention_chunk_size", 0) or 0)
            for i, spec in enumerate(specs))
        chunk_bytes = max(g.factor for g in groups) * kv_cache_config.bytes_per_block
        if "num_cpu_blocks" in extra and "cpu_bytes" in extra:
            msg = "give either 'num_cpu_blocks' or 'cpu_bytes' in extra_config, not both"
            raise ConfigError(msg)
        if "num_cpu_blocks" in extra:
            num = _int_key(extra, "num_cpu_blocks", "a positive number of offloaded blocks")
        elif "cpu_bytes" in extra:
            num = _int_key(extra, "cpu_bytes", "a positive number of bytes") // chunk_bytes
        else:
            msg = ("OffloadingConnector needs 'num_cpu_blocks' (offloaded blocks) or "
                   f"'cpu_bytes' in extra_config (one offloaded block is {chunk_bytes} bytes)")
            raise ConfigError(msg)
        if num < 1:
            msg = (f"the CPU tier must hold at least one offloaded block of {chunk_bytes} "
                   f"bytes; extra_config gives {num}")
            raise ConfigError(msg)
        method = _str_key(extra, "transfer_method", "auto", "'auto', 'coalesced', 'per_block' or 'gather'")
        if method not in TRANSFER_METHODS:
            # Checked here, with the rest of the config, not when the worker registers.
            msg = (f"OffloadingConnector transfer_method={method!r} is not valid; expected one of "
                   f"{', '.join(TRANSFER_METHODS)}")
            raise ConfigError(msg)
        return cls(gpu_bs, factor, num,
                   _str_key(extra, "cache_policy", "lru", "a cache policy name such as 'lru' or 'arc'"),
                   _bool_key(extra, "enable_events", True),
                   method, groups)


def _int_key(extra: dict[str, Any], key: str, valid: str, default: int | None = None) -> int:
    """Return ``extra[key]`` as an int; a bool, a fraction or a non-numeric string is a ConfigError."""
    value = extra.get(key, default)
    if isinstance(value, bool):
        ok = False
    elif isinstance(value, int):
        return value
    elif isinstance(value, float):
        ok = value.is_integer()
    elif isinstance(value, str):
        ok = value.strip().lstrip("+-").isdigit()
    else:
        ok = False
    if not ok:
        msg = f"OffloadingConnector extra_config {key}={value!r} is not valid; expected an integer, {valid}"
        raise ConfigError(msg)
    return int(value)  # type: ignore[arg-type]


def _bool_key(extra: dict[str, Any], key: str, default: bool) -> bool:
    value = extra.get(key, default)
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    msg = f"OffloadingConnector extra_config {key}={value!r} is not valid; expected true or false"
    raise ConfigError(msg)


def _str_key(extra: dict[str, Any], key: str, default: str, valid: str) -> str:
    value = extra.get(key, default)
    if not isinstance(value, str):
        msg = f"OffloadingConnector extra_config {key}={value!r} is not valid; expected a string, {valid}"
        raise ConfigError(msg)
    return value


def _blocks_per_chunk(extra: dict[str, Any], gpu_bs: int) -> int:
    if "block_size" in extra and "blocks_per_chunk" in extra:
        msg = "give either 'block_size' or 'blocks_per_chunk' in extra_config, not both"
        raise ConfigError(msg)
    if "block_size" in extra:
        tokens = _int_key(extra, "block_size", f"a positive multiple of the GPU block size {gpu_bs}")
        if tokens <= 0 or tokens % gpu_bs:
            msg = (f"extra_config block_size={tokens} must be a positive multiple of the GPU "
                   f"block size {gpu_bs}")
            raise ConfigError(msg)
        return tokens // gpu_bs
    factor = _int_key(extra, "blocks_per_chunk", "the GPU blocks per offloaded block (>= 1)", 1)
    if factor < 1:
        msg = f"extra_config blocks_per_chunk={factor} must be >= 1"
        raise ConfigError(msg)
    return factor
