"""The device KV cache seen as byte planes: one row per block, cross-layer when possible.

Layout. The engine keeps one tensor per KV cache group shaped ``(num_blocks, num_layers,
2, block_size, num_kv_heads, head_size)`` and hands out per-layer views ``t[:, i]``. All
layers of one block are then one contiguous chunk (2 MiB for Llama-3-8B), so a block
moves as one DMA instead of ``num_layers`` small ones; :func:`cross_layer_planes`
recovers that chunk from the views. Other layouts (vLLM's one tensor per layer) give one
plane per layer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch

__all__ = ["BlockLayout", "build_block_layout", "cross_layer_planes"]


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """The device KV cache as byte planes.

    Attributes:
        planes: uint8 tensors ``(num_blocks, row_bytes)``; block ``b`` of plane ``p`` is
            ``planes[p][b]``, one contiguous row. A row may be followed by a gap
            (``stride(0) > row_bytes``), in which case runs are not coalesced.
        cross_layer: True when one plane holds all layers of a block.
    """

    planes: tuple[torch.Tensor, ...]
    cross_layer: bool

    @property
    def num_blocks(self) -> int:
        """Number of device blocks."""
        return self.planes[0].shape[0]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all planes."""
        return sum(p.shape[1] for p in self.planes)

    @property
    def device(self) -> torch.device:
        """Device of the KV cache."""
        return self.planes[0].device


def _byte_rows(storage_tensor: torch.Tensor, offset_bytes: int, num_rows: int,
               row_bytes: int, row_stride_bytes: int) -> torch.Tensor:
    """A uint8 (num_rows, row_bytes) view of ``storage_tensor``'s storage."""
    out = torch.empty(0, dtype=torch.uint8, device=storage_tensor.device)
    return out.set_(storage_tensor.untyped_storage(), offset_bytes, (num_rows, row_bytes),
                    (row_stride_bytes, 1))


def _plane_of(t: torch.Tensor) -> torch.Tensor:
    """One layer tensor ``(num_blocks, ...)`` as a byte plane; each block must be dense."""
    if t.dim() < 2 or not t[0].is_contiguous():
        msg = (f"KV cache tensor of shape {tuple(t.shape)} and strides {t.stride()}: "
               "each block (t[i]) must be one contiguous chunk")
        raise ValueError(msg)
    elt = t.element_size()
    return _byte_rows(t, int(t.storage_offset()) * elt, int(t.shape[0]), t[0].numel() * elt,
                      t.stride(0) * elt)


def cross_layer_planes(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """Recover the cross-layer block view of per-layer views of one tensor.

    Args:
        tensors: per-layer views ``base[:, i]`` of a ``(num_blocks, num_layers, ...)``
            tensor, in any order.

    Returns:
        A uint8 ``(num_blocks, num_layers * layer_block_bytes)`` view in which a row is
        all layers of one block, or None when the views are not laid out that way.
    """
    if not tensors:
        return None
    first = tensors[0]
    if first.dim() < 2 or not first[0].is_contiguous():
        return None
    same = all(
        t.device == first.device and t.dtype == first.dtype and t.shape == first.shape
        and t.stride() == first.stride()
        and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        for t in tensors
    )
    if not same:
        return None
    elt = first.element_size()
    layer_bytes = first[0].numel() * elt
    ordered = sorted(tensors, key=lambda t: t.storage_offset())
    offsets = [int(t.storage_offset()) * elt for t in ordered]
    # Layers must sit back to back inside a block, and blocks back to back after that.
    if any(b - a != layer_bytes for a, b in pairwise(offsets)):
        return None
    row_bytes = layer_bytes * len(ordered)
    if first.stride(0) * elt < row_bytes:
        return None
    return _byte_rows(ordered[0], offsets[0], int(first.shape[0]), row_bytes, first.stride(0) * elt)


def build_block_layout(kv_caches: Mapping[str, torch.Tensor] | Sequence[torch.Tensor]
                       ) -> BlockLayout:
    """Describe the KV cache as byte planes, cross-layer when possible.

    Args:
        kv_caches: layer name -> per-layer tensor ``(num_blocks, ...)`` (as given to
            ``register_kv_caches``), or a sequence of such tensors, or one cross-layer
            tensor ``(num_blocks, num_layers, ...)`` in a one-element sequence.

    Raises:
        ValueError: no tensors, tensors on different devices or with different block
            counts, or a block that is not one contiguous chunk.
    """
    tensors = list(kv_caches.values()) if isinstance(kv_caches, Mapping) else list(kv_caches)
    # Layers of KV cache groups that share a physical pool are views of the same
    # memory (slot i of each group): move each piece of memory once.
    unique: dict[tuple[int, int | torch.SymInt, tuple[int, ...], tuple[int, ...]],
                 torch.Tensor] = {}
    for t in tensors:
        unique.setdefault((t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
                           t.stride()), t)
    tensors = list(unique.values())
    if not tensors:
        msg = "no KV cache tensors to register"
        raise ValueError(msg)
    if len({t.device for t in tensors}) != 1 or len({t.shape[0] for t in tensors}) != 1:
        msg = ("KV cache tensors must share one device and one block count, got "
               f"{sorted({(str(t.device), t.shape[0]) for t in tensors})}")
        raise ValueError(msg)
    base = cross_layer_planes(tensors) if len(tensors) > 1 else None
    if base is not None:
        return BlockLayout((base,), cross_layer=True)
    # Sorting by address keeps the CPU layout independent of dict order.
    ordered = sorted(tensors, key=lambda t: (t.untyped_storage().data_ptr(), t.storage_offset()))
    return BlockLayout(tuple(_plane_of(t) for t in ordered), cross_layer=len(tensors) == 1)


