"""What each kind of attention layer needs from the KV cache, and pool sizing.

``max_admission_blocks_per_request`` is the single source of truth for how
many blocks one request can hold at once: startup sizing
(``max_memory_usage_bytes``) and runtime admission (the full-sequence check in
:class:`~kvconnector_core.kv_cache.kv_cache_manager.KVCacheManager`) both use
it. Sliding-window and chunked-local layers recycle blocks that leave their
window, so a request far longer than the pool can still run; a full-attention
request that could never fit is still rejected.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvconnector_core.errors import ConfigError

__all__ = [
    "DTYPE_SIZES",
    "AttentionSpec",
    "ChunkedLocalAttentionSpec",
    "FullAttentionSpec",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheSpec",
    "SlidingWindowSpec",
    "cdiv",
    "get_kv_cache_config",
    "kv_cache_bytes_per_block",
]

DTYPE_SIZES: dict[str, int] = {
    "float32": 4, "float16": 2, "bfloat16": 2, "int32": 4, "int64": 8, "int16": 2, "int8": 1,
    "uint8": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
}
"""Bytes per element of every dtype name a spec accepts."""


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheSpec:
    """Base of all KV cache specs: the block size in tokens."""

    block_size: int

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ConfigError(f"block_size={self.block_size!r}; must be an int >= 1")

    @property
    def kind(self) -> str:
        """Short name of the spec kind, as put in KV events."""
        raise NotImplementedError

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block of one layer occupies."""
        raise NotImplementedError

    def max_admission_blocks_per_request(self, max_num_batched_tokens: int,
                                         max_model_len: int) -> int:
        """Most blocks one request can hold at once under this spec."""
        raise NotImplementedError

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """Bytes one layer needs for one request of ``max_model_len`` tokens."""
        return (self.max_admission_blocks_per_request(max_num_batched_tokens, max_model_len)
                * self.page_size_bytes)


@dataclass(frozen=True)
class AttentionSpec(KVCacheSpec):
    """An attention layer: K and V of ``num_kv_heads x head_size`` per token."""

    num_kv_heads: int = 1
    head_size: int = 1
    dtype: str = "bfloat16"
    """Element type: a name from :data:`DTYPE_SIZES` or a ``torch.dtype`` (stored as its name)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.dtype, str):
            # A torch.dtype, as vLLM's specs hold (str(torch.float16) == "torch.float16");
            # kept as its name so the spec stays hashable, comparable and torch-free.
            object.__setattr__(self, "dtype", str(self.dtype).removeprefix("torch."))
        if self.dtype not in DTYPE_SIZES:
            raise ConfigError(f"dtype={self.dtype!r}; "
                              f"known dtypes: {', '.join(sorted(DTYPE_SIZES))}")
        if self.num_kv_heads < 1 or self.head_size < 1:
            raise ConfigError(
                f"num_kv_heads={self.num_kv_heads}, head_size={self.head_size}; both must be >= 1"
            )

    @property
    def page_size_bytes(self) -> int:
        """``2 (K and V) * block_size * num_kv_heads * head_size * dtype bytes``."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * DTYPE_SIZES[self.dtype]


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    """Full (causal) attention: a request keeps every block it ever wrote."""

    @property
    def kind(self) -> str:
        return "full_attention"

    def max_admission_blocks_per_request(self, max_num_batched_tokens: int,
                                         max_model_len: int) -> int:
        """``cdiv(max_model_len, block_size)``."""
        return cdiv(max_model_len, self.block_size)


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    """Sliding-window attention: each token sees the last ``sliding_window`` tokens."""

    sliding_window: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sliding_window < 1:
            raise ConfigError(f"sliding_window={self.sliding_window}; must be >= 1")

    @property
    def kind(self) -> str:
        return "sliding_window"

    def max_admission_blocks_per_request(self, max_num_batched_tokens: int,
                                         max_model_len: int) -> int:
        """``cdiv(min(sliding_window - 1 + max_num_batched_tokens, max_model_len),
        block_size) + 1``.

        The window plus one step's worth of new tokens, plus one block because
        the window can start in the middle of a block.
        """
        tokens = min(self.sliding_window - 1 + max_num_batched_tokens, max_model_len)
        return cdiv(tokens, self.block_size) + 1


@dataclass(frozen=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Chunked local attention: tokens see only their own ``attention_chunk_size`` chunk."""

    attention_chunk_size: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.attention_chunk_size < 1:
            raise ConfigError(f"attention_chunk_size={self.attention_chunk_size}; must be >= 1")

    @property
    def kind(self) -> str:
        return "chunked_local_attention"

    def max_admission_blocks_per_request(self, max_num_batched_tokens: int,
                                         max_model_len: int) -> int:
        """``cdiv(min(attention_chunk_size + max_num_batched_tokens, max_model_len),
        block_size)``."""
        tokens = min(self.attention_chunk_size + max_num_batched_tokens, max_model_len)
        return cdiv(tokens, self.block_size)


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers that share one spec and therefore one block table per request."""

    layer_names: list[str]
    kv_cache_spec: KVCacheSpec


@dataclass(frozen=True)
class KVCacheConfig:
    """The KV cache layout: pool size and the groups that draw blocks from it.

    Every group allocates from one shared pool of ``num_blocks`` block ids, so a
    block id belongs to one group at a time. Groups whose pages have the same size
    therefore share physical memory, as in vLLM: layer ``i`` of each such group uses
    the same tensor (see :attr:`physical_pools`). Memory then grows with the number
    of layers per group, not with the number of groups.
    """

    num_blocks: int
    kv_cache_groups: list[KVCacheGroupSpec] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_blocks < 2:
            raise ConfigError(
                f"num_blocks={self.num_blocks}; need >= 2 (block 0 is the null block)")
        if not self.kv_cache_groups:
            raise ConfigError("kv_cache_groups is empty; give at least one KVCacheGroupSpec")

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id costs: per physical pool, its page times its layer slots."""
        return _bytes_per_block(self.kv_cache_groups)

    @property
    def physical_pools(self) -> list[list[int]]:
        """Indices of the groups that share one physical pool (equal page size), in
        first-group order; a pool has as many layer slots as its largest group."""
        return _physical_pools(self.kv_cache_groups)


def _physical_pools(groups: list[KVCacheGroupSpec]) -> list[list[int]]:
    by_page: dict[int, list[int]] = {}
    for g, group in enumerate(groups):
        by_page.setdefault(group.kv_cache_spec.page_size_bytes, []).append(g)
    return list(by_page.values())


def _bytes_per_block(groups: list[KVCacheGroupSpec]) -> int:
    # A block id belongs to one group at a time, so groups of equal page size share
    # memory: a pool costs its page times the layers of its largest group.
    return sum(groups[pool[0]].kv_cache_spec.page_size_bytes
               * max(len(groups[g].layer_names) for g in pool)
               for pool in _physical_pools(groups))


def kv_cache_bytes_per_block(layer_specs: Mapping[str, KVCacheSpec]) -> int:
    """Bytes one block id costs for these layers once grouped (see :class:`KVCacheConfig`).

    Args:
        layer_specs: spec of every attention layer, by layer name.
    """
    return _bytes_per_block(_group_layers(layer_specs))


def _group_layers(layer_specs: Mapping[str, KVCacheSpec]) -> list[KVCacheGroupSpec]:
    groups: dict[KVCacheSpec, list[str]] = {}
    for name, spec in layer_specs.items():
        groups.setdefault(spec, []).append(name)
    # Full attention first: the hybrid coordinator looks those up first.
    ordered = sorted(groups.items(), key=lambda kv: not isinstance(kv[0], FullAttentionSpec))
    return [KVCacheGroupSpec(names, spec) for spec, names in ordered]


def get_kv_cache_config(
    layer_specs: Mapping[str, KVCacheSpec],
    available_memory: int,
    max_model_len: int,
    max_num_batched_tokens: int,
) -> KVCacheConfig:
    """Group layers by spec and size the block pool from a memory budget.

    Args:
        layer_specs: spec of every attention layer, by layer name (insertion
            order is kept within each group).
        available_memory: bytes the KV cache may use.
        max_model_len: longest sequence a request may reach.
        max_num_batched_tokens: token budget of one scheduler step.

    Returns:
        A config whose pool holds as many blocks as fit in ``available_memory``.

    Raises:
        ConfigError: no layers, or the budget cannot hold even one request of
            ``max_model_len`` tokens (the message gives the bytes needed, computed
            from each spec's admission cap).
    """
    if not layer_specs:
        raise ConfigError("layer_specs is empty; give the spec of at least one layer")
    group_specs = _group_layers(layer_specs)
    bytes_per_block = _bytes_per_block(group_specs)
    num_blocks = available_memory // bytes_per_block
    needed_blocks = 1 + sum(
        g.kv_cache_spec.max_admission_blocks_per_request(max_num_batched_tokens, max_model_len)
        for g in group_specs
    )
    if num_blocks < needed_blocks:
        raise ConfigError(
            f"available_memory={available_memory} bytes holds {num_blocks} blocks of "
            f"{bytes_per_block} bytes; one request of max_model_len={max_model_len} needs "
            f"{needed_blocks} blocks ({needed_blocks * bytes_per_block} bytes). Raise the budget "
            f"or lower max_model_len."
        )
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=group_specs)
