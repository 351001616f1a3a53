"""Transfer variants shared by bench_transfer.py and bench_interference.py.

A variant is a label: a :class:`KVBlockMover` method name, optionally followed by
``, inline issue`` (copies issued on the caller's thread instead of the issue thread) or
``, Tensor.copy_`` (every CUDA runtime shortcut off and inline issue: the fallback path,
which is how ``auto`` issued copies before the runtime calls existed).
"""

from __future__ import annotations

from connectors.offload.transfer import METHODS, KVBlockMover

__all__ = ["DEFAULT_VARIANTS", "apply_variant", "restore"]

DEFAULT_VARIANTS = ["per_block", "coalesced", "gather", "batched", "pitched", "auto",
                    "auto, inline issue", "auto, Tensor.copy_"]


def apply_variant(mover: KVBlockMover, label: str) -> None:
    """Configure ``mover`` for the variant ``label`` (reversible: originals are kept)."""
    method, _, option = (part.strip() for part in label.partition(","))
    if method not in METHODS or option not in ("", "inline issue", "Tensor.copy_"):
        msg = f"unknown transfer variant {label!r}; methods: {', '.join(METHODS)}"
        raise ValueError(msg)
    saved = mover.__dict__.setdefault("_bench_saved", (
        mover._memcpy, mover._batch_memcpy, mover._memcpy_2d, mover._issuer))
    memcpy, batch, memcpy_2d, issuer = saved
    mover.method = method
    fallback = option == "Tensor.copy_"
    mover._memcpy, mover._batch_memcpy, mover._memcpy_2d = (
        (None, None, None) if fallback else (memcpy, batch, memcpy_2d))
    mover._issuer = None if option else issuer


def restore(mover: KVBlockMover) -> None:
    """Undo :func:`apply_variant` so that ``shutdown`` stops the issue thread."""
    apply_variant(mover, "auto")
