"""vLLM's per-layer KV views -> tensors whose blocks are dense rows, without copies.

vLLM 0.33 views one int8 buffer as a logical ``[B, H, N, C]`` tensor per layer
whose physical order is one of six layouts (``KVCacheLayout``: LBHNC, LBNHC,
LHBNC, BLHNC, BLNHC, BHLNC). kvconnector's movers need, per tensor, every
block ``t[b]`` to be one contiguous run. :func:`block_dense_views` gets there
with views only:

1. Reorder the dimensions into physical order (largest stride first). Where
   the block dimension is then outermost and a block's remaining bytes are
   contiguous (LBHNC, LBNHC, BLHNC, BLNHC) the view is used as is.
2. Otherwise (LHBNC: heads outside blocks; BHLNC: layers between heads) the
   view is split along the dimension that interrupts the block, one view per
   head, each of whose blocks is contiguous.

Every result shares storage with vLLM's tensor (checked by the tests), so a
load written through it lands in vLLM's cache.

Primitives: :func:`block_dense_views`.
"""

from __future__ import annotations

import torch

from kvconnector_core.errors import ConfigError

__all__ = ["block_dense_views"]


def _physical(t: torch.Tensor) -> torch.Tensor:
    """``t`` with dimensions sorted by stride (physical order), the block dim kept first on ties."""
    strides = t.stride()
    order = sorted(range(t.dim()), key=lambda d: (-strides[d], d))
    return t.permute(order)


def _dense_rows(t: torch.Tensor) -> bool:
    return t.dim() >= 2 and t[0].is_contiguous()


def block_dense_views(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views of one layer's KV tensor in which each block ``v[b]`` is one contiguous run.

    Args:
        name: the layer's name (suffixed with ``#h<i>`` for per-head pieces).
        t: vLLM's layer view, block dimension first (``[B, ...]``).

    Returns:
        ``{name: view}`` when one view suffices, else one view per head.

    Raises:
        ConfigError: no split of ``t`` gives block-dense views (an unknown layout).
    """
    if t.dim() < 2:
        msg = f"KV cache tensor {name!r} of shape {tuple(t.shape)} has no block dimension"
        raise ConfigError(msg)
    if _dense_rows(t):
        return {name: t}
    # The block dimension is dim 0 of vLLM's logical view; track it through the permute.
    strides = t.stride()
    order = sorted(range(t.dim()), key=lambda d: (-strides[d], d))
    phys = t.permute(order)
    block_at = order.index(0)
    if block_at == 0 and _dense_rows(phys):
        return {name: phys}
    # Split along the outermost dimension that is not the block one: the heads
    # (LHBNC: [H, B, N, C]; BHLNC per layer: [B, H, N, C] with a layer gap per head).
    split = 1 if block_at == 0 else 0
    pieces = {}
    for i in range(phys.shape[split]):
        piece = phys.select(split, i)
        piece = _physical(piece) if block_at != 0 else piece
        # After removing the split dim, the block dim is the first of the rest.
        if piece.stride(0) < max(piece.stride()[1:], default=0) or not _dense_rows(piece):
            msg = (f"KV cache tensor {name!r} (shape {tuple(t.shape)}, strides {t.stride()}) "
                   "cannot be viewed as dense blocks; supported layouts: LBHNC, LBNHC, LHBNC, "
                   "BLHNC, BLNHC, BHLNC")
            raise ConfigError(msg)
        pieces[f"{name}#h{i}"] = piece
    return pieces
