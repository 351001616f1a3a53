"""Allocation of the paged KV tensors, one tensor per KV cache group.

Layout of group ``g``'s tensor::

    (num_blocks, num_layers_in_group, 2, block_size, num_kv_heads, head_size)

Block-major and *cross-layer*: one block id of all layers of a group is one contiguous
chunk of memory, so a connector moves a whole block (every layer, K and V) with one copy.
Layer ``i`` of the group sees the strided view ``t[:, i]`` of shape
``(num_blocks, 2, block_size, num_kv_heads, head_size)``; those views are what
``register_kv_caches(dict[layer_name, Tensor])`` receives.

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
from typing import TYPE_CHECKING

import torch

from kvconnector_core.errors import ConfigError

if TYPE_CHECKING:
    from kvconnector_core.kv_cache.kv_cache_spec import KVCacheConfig

__all__ = [
    "KVCacheTensors",
    "allocate_kv_caches",
    "cross_layer_block_view",
    "group_layers_by_storage",
    "torch_dtype",
]

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int32": torch.int32, "int64": torch.int64, "int8": torch.int8, "uint8": torch.uint8,
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
        group_tensors: per KV cache group, the block-major cross-layer tensor.
        layer_tensors: layer name -> that layer's view ``group_tensors[g][:, i]``, in group
            order then layer order (the dict handed to ``register_kv_caches``).
        layer_to_group: layer name -> ``(group index, index within the group)``.
        block_sizes: block size (tokens) of every group.
    """

    group_tensors: list[torch.Tensor]
    layer_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    layer_to_group: dict[str, tuple[int, int]] = field(default_factory=dict)
    block_sizes: list[int] = field(default_factory=list)

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
    """Allocate one zeroed block-major tensor per KV cache group.

    Args:
        kv_cache_config: pool size and groups (every group's spec must be an attention
            spec with ``num_kv_heads``, ``head_size`` and ``dtype``).
        device: ``"cpu"``, ``"cuda"`` or a torch device.
        pin_memory: pin CPU tensors (ignored on CUDA).

    Returns:
        The tensors and per-layer views.

    Raises:
        ConfigError: a group's spec is not an attention spec or has an unsupported dtype.
    """
    device = torch.device(device)
    result = KVCacheTensors(group_tensors=[])
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if not hasattr(spec, "num_kv_heads"):
            msg = f"KV cache group {g} has spec {spec!r}; the worker allocates attention specs only"
            raise ConfigError(msg)
        shape = (kv_cache_config.num_blocks, len(group.layer_names), 2, spec.block_size,
                 spec.num_kv_heads, spec.head_size)
        dtype = torch_dtype(spec.dtype)
        try:
            tensor = torch.zeros(shape, dtype=dtype, device=device,
                                 pin_memory=pin_memory and device.type == "cpu")
        except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            size = torch.Size(shape).numel() * dtype.itemsize
            msg = (f"cannot allocate the KV cache of group {g} on {device}: "
                   f"{kv_cache_config.num_blocks} blocks of {size // kv_cache_config.num_blocks} "
                   f"bytes = {size / 2**30:.1f} GiB ({type(exc).__name__}); use fewer blocks")
            raise ConfigError(msg) from None
        result.group_tensors.append(tensor)
        result.block_sizes.append(spec.block_size)
        for i, name in enumerate(group.layer_names):
            result.layer_tensors[name] = tensor[:, i]
            result.layer_to_group[name] = (g, i)
    return result


def group_layers_by_storage(kv_caches: Mapping[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Split per-layer KV views by the storage they live in (one dict per group tensor).

    Args:
        kv_caches: layer name -> KV tensor, as given to ``register_kv_caches``.

    Returns:
        Dicts in first-seen order; within each, the layers keep their order.
    """
    by_storage: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    for name, t in kv_caches.items():
        key = (str(t.device), t.untyped_storage().data_ptr())
        by_storage.setdefault(key, {})[name] = t
    return list(by_storage.values())


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
