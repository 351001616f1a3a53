"""Allocation of the paged KV tensors: one physical pool per page size, shared by groups.

A block id belongs to one KV cache group at a time (all groups draw from one block
pool), so KV cache groups whose pages have the same size share memory, as in vLLM:
the pool is one byte tensor ``(num_blocks, num_slots, page_bytes)`` with as many layer
slots as its largest group has layers, and layer ``i`` of every group of the pool lives
in slot ``i``. Memory grows with the layers per group, not with the number of groups
(a full + sliding-window model with 2 x 16 layers costs 16 layers' pages per block, not
32). Group ``g``'s tensor is the view::

    (num_blocks, num_layers_in_group, 2, block_size, num_kv_heads, head_size)

Block-major and *cross-layer*: one block id of all layers of a group is one contiguous
chunk of memory, so a connector moves a whole block (every layer, K and V) with one copy.
Layer ``i`` of the group sees the strided view ``t[:, i]`` of shape
``(num_blocks, 2, block_size, num_kv_heads, head_size)``; those views are what
``register_kv_caches(dict[layer_name, Tensor])`` receives. Layers of different groups of
one pool share storage (slot ``i`` of block ``b`` is used by whichever group owns ``b``).

Primitives:

- :class:`KVCacheTensors` -- the group tensors, per-layer views and the layer -> group map.
- :func:`allocate_kv_caches` -- builds them from a ``KVCacheConfig``.
- :func:`cross_layer_block_view` -- recovers a ``(num_blocks, bytes_per_block)`` uint8 view
  from per-layer views that share one block-major storage (``None`` otherwise).
- :func:`group_layers_by_storage` -- splits a ``register_kv_caches`` dict per storage, so a
  connector can call :func:`cross_layer_block_view` per KV cache group.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

from kvconnector_core.errors import ConfigError

if TYPE_CHECKING:
    from kvconnector_core.kv_cache.kv_cache_spec import AttentionSpec, KVCacheConfig

__all__ = [
    "KVCacheTensors",
    "allocate_kv_caches",
    "cross_layer_block_view",
    "group_layers_by_storage",
    "torch_dtype",
]

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int32": torch.int32, "int64": torch.int64, "int16": torch.int16, "int8": torch.int8,
    "uint8": torch.uint8,
}


def torch_dtype(name: str) -> torch.dtype:
    """Map a spec dtype name to a torch dtype.

    Raises:
        ConfigError: the name is not a dtype the worker can allocate.
    """
    try:
        return _DTYPES[name]
    except KeyError:
        msg = f"KV cache dtype {name!r} is not supported; valid: {', '.join(sorted(_DTYPES))}"
        raise ConfigError(msg) from None


@dataclass
class KVCacheTensors:
    """The paged KV cache of one worker.

    Attributes:
        group_tensors: per KV cache group, the block-major cross-layer tensor (a view
            of its pool).
        layer_tensors: layer name -> that layer's view ``group_tensors[g][:, i]``, in group
            order then layer order (the dict handed to ``register_kv_caches``).
        layer_to_group: layer name -> ``(group index, index within the group)``.
        block_sizes: block size (tokens) of every group.
        pool_tensors: the physical pools, ``(num_blocks, bytes per block)`` uint8 each.
        pool_of_group: per group, the index of its pool in ``pool_tensors``.
    """

    group_tensors: list[torch.Tensor]
    layer_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    layer_to_group: dict[str, tuple[int, int]] = field(default_factory=dict)
    block_sizes: list[int] = field(default_factory=list)
    pool_tensors: list[torch.Tensor] = field(default_factory=list)
    pool_of_group: list[int] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Bytes of KV cache memory allocated (all pools)."""
        return sum(t.numel() for t in self.pool_tensors)

    @property
    def num_blocks(self) -> int:
        """Blocks per group tensor (all groups index the same block-id space)."""
        return self.group_tensors[0].shape[0]

    def bytes_per_block(self, group: int = 0) -> int:
        """Bytes one block id occupies in group ``group`` (all its layers, K and V)."""
        t = self.group_tensors[group]
        return t[0].numel() * t.element_size()


def allocate_kv_caches(kv_cache_config: KVCacheConfig, device: str | torch.device = "cpu",
                       *, pin_memory: bool = False) -> KVCacheTensors:
    """Allocate one zeroed pool per page size and view each KV cache group in it.

    Args:
        kv_cache_config: pool size and groups (every group's spec must be an attention
            spec with ``num_kv_heads``, ``head_size`` and ``dtype``).
        device: ``"cpu"``, ``"cuda"`` or a torch device.
        pin_memory: pin CPU tensors (ignored on CUDA).

    Returns:
        The tensors and per-layer views.

    Raises:
        ConfigError: a group's spec is not an attention spec or has an unsupported dtype,
            or the allocator refused a pool (the message gives its size).
    """
    device = torch.device(device)
    groups = kv_cache_config.kv_cache_groups
    num_blocks = kv_cache_config.num_blocks
    for g, group in enumerate(groups):
        if not hasattr(group.kv_cache_spec, "num_kv_heads"):
            msg = (f"KV cache group {g} has spec {group.kv_cache_spec!r}; the worker allocates "
                   "attention specs only")
            raise ConfigError(msg)
        # An unsupported dtype fails before allocating (an attention spec: checked just above).
        torch_dtype(cast("AttentionSpec", group.kv_cache_spec).dtype)
    result = KVCacheTensors(group_tensors=[None] * len(groups),  # type: ignore[list-item]  # each set below
                            pool_of_group=[0] * len(groups))
    for p, pool in enumerate(kv_cache_config.physical_pools):
        page = groups[pool[0]].kv_cache_spec.page_size_bytes
        slots = max(len(groups[g].layer_names) for g in pool)
        raw = _zeros_or_config_error((num_blocks, slots, page), device, pin_memory, pool)
        result.pool_tensors.append(raw.view(num_blocks, slots * page))
        for g in pool:
            result.pool_of_group[g] = p
            result.group_tensors[g] = _group_view(raw, groups[g].kv_cache_spec,
                                                  len(groups[g].layer_names))
    for g, group in enumerate(groups):
        result.block_sizes.append(group.kv_cache_spec.block_size)
        for i, name in enumerate(group.layer_names):
            result.layer_tensors[name] = result.group_tensors[g][:, i]
            result.layer_to_group[name] = (g, i)
    return result


def _zeros_or_config_error(shape: tuple[int, int, int], device: torch.device, pin_memory: bool,
                           pool: Sequence[int]) -> torch.Tensor:
    """A zeroed uint8 pool; an allocation the allocator refuses is a ConfigError giving the size."""
    try:
        return torch.zeros(shape, dtype=torch.uint8, device=device,
                           pin_memory=pin_memory and device.type == "cpu")
    except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        size = torch.Size(shape).numel()
        which = f"group {pool[0]}" if len(pool) == 1 else f"groups {', '.join(map(str, pool))}"
        msg = (f"cannot allocate the KV cache of {which} on {device}: {shape[0]} blocks of "
               f"{size // shape[0]} bytes = {size / 2**30:.1f} GiB ({type(exc).__name__}); "
               "use fewer blocks")
        raise ConfigError(msg) from None


def _group_view(raw: torch.Tensor, spec: Any, num_layers: int) -> torch.Tensor:
    """``raw[:, :num_layers]`` seen as ``(num_blocks, num_layers, 2, bs, heads, head_size)``."""
    # The last dim is contiguous, so the dtype view and the split of the page are views.
    part = raw[:, :num_layers].view(torch_dtype(spec.dtype))
    return part.view(raw.shape[0], num_layers, 2, spec.block_size, spec.num_kv_heads,
                     spec.head_size)


def group_layers_by_storage(kv_caches: Mapping[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Split per-layer KV views into KV cache groups (one dict per group tensor).

    Layers of one group live in one storage at increasing offsets. Groups of a shared
    physical pool live in the same storage and start again at the pool's first slot,
    so a layer whose offset does not increase starts the next group.

    Args:
        kv_caches: layer name -> KV tensor, as given to ``register_kv_caches`` (group
            order, then layer order).

    Returns:
        Dicts in first-seen order; within each, the layers keep their order.
    """
    out: list[dict[str, torch.Tensor]] = []
    current: dict[tuple[str, int], tuple[dict[str, torch.Tensor], int]] = {}
    for name, t in kv_caches.items():
        key = (str(t.device), t.untyped_storage().data_ptr())
        group, last = current.get(key, (None, -1))
        if group is None or t.storage_offset() <= last:
            group = {}
            out.append(group)
        group[name] = t
        current[key] = (group, int(t.storage_offset()))
    return out


def cross_layer_block_view(kv_caches: Mapping[str, torch.Tensor] | Sequence[torch.Tensor]
                           ) -> torch.Tensor | None:
    """View per-layer KV tensors as whole cross-layer blocks of bytes.

    The views qualify when they share one storage, have the same shape, dtype and
    strides, each layer's per-block part is contiguous, layer ``i`` starts ``i`` parts
    after layer 0 (in the given order) and one block of all layers is contiguous
    (``stride(0) == num_layers * part``). This is the layout :func:`allocate_kv_caches`
    produces for one group.

    Args:
        kv_caches: the layers of one group (dict as given to ``register_kv_caches``, or a
            sequence), in layer order.

    Returns:
        A ``(num_blocks, bytes_per_block)`` uint8 tensor sharing memory with the KV cache,
        or ``None`` when the views do not have that layout (e.g. layers of two groups).
    """
    tensors = list(kv_caches.values()) if isinstance(kv_caches, Mapping) else list(kv_caches)
    if not tensors:
        return None
    first = tensors[0]
    storage_ptr = first.untyped_storage().data_ptr()
    part = first[0].numel()  # elements of one block of one layer
    for i, t in enumerate(tensors):
        if (t.untyped_storage().data_ptr() != storage_ptr or t.shape != first.shape
                or t.dtype != first.dtype or t.stride() != first.stride()
                or t.storage_offset() != first.storage_offset() + i * part
                or not t[0].is_contiguous()):
            return None
    if first.stride(0) != len(tensors) * part:
        return None
    num_blocks = first.shape[0]
    elems = first.new_empty(0)
    elems.set_(first.untyped_storage(), first.storage_offset(),
               (num_blocks, len(tensors) * part), (first.stride(0), 1))
    return elems.view(torch.uint8)
