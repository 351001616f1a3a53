"""The few CUDA runtime calls the block mover makes directly, through ctypes.

Why ctypes: ``Tensor.copy_`` costs about 26 us of host time per call (two slice views
plus the dispatcher), ``cudaMemcpyAsync`` about 3 us, and one ``cudaMemcpyBatchAsync``
(CUDA 12.8+) issues thousands of copies in one call. The engine pays this host time in
its step, before the forward, so it shows up directly as step time.

The runtime is looked up where torch keeps it (``torch/lib``, then the ``nvidia/*/lib``
wheels), then the system's. It shares torch's primary context and streams. Every loader
returns None when the library or the symbol is missing, and the mover then falls back
to the next slower primitive; nothing here is imported unless the cache is on CUDA.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import os
from collections.abc import Callable

import torch

__all__ = [
    "BatchMemcpy",
    "Memcpy",
    "Memcpy2D",
    "batch_memcpy_async",
    "clear_error",
    "max_pitch",
    "memcpy_2d_async",
    "memcpy_async",
    "runtime_version",
]

_CUDA_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction inferred from the (UVA) pointers
_SRC_ACCESS_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream: read the source in stream order
_BATCH_MIN_VERSION = 12080  # cudaMemcpyBatchAsync appeared in CUDA 12.8
_BATCH_NO_FAILIDX_VERSION = 13000  # CUDA 13 dropped the failIdx out-parameter
_DEV_ATTR_MAX_PITCH = 11  # cudaDevAttrMaxPitch

Memcpy = Callable[[int, int, int, int], int]
"""``(dst, src, nbytes, stream) -> cudaError`` for one copy."""

Memcpy2D = Callable[[int, int, int, int, int, int, int], int]
"""``(dst, dpitch, src, spitch, width, height, stream) -> cudaError``: ``height`` rows of
``width`` bytes, rows ``spitch`` / ``dpitch`` bytes apart; one copy-engine operation."""

BatchMemcpy = Callable[[int, int, int, int, int], int]
"""``(dsts_ptr, srcs_ptr, sizes_ptr, count, stream) -> cudaError``; the three pointers
address arrays of ``count`` 64-bit values (device/host addresses and byte counts)."""


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    # cudaMemcpyAttributes: srcAccessOrder, srcLocHint, dstLocHint, flags (24 bytes).
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _MemLocation),
                ("dstLocHint", _MemLocation), ("flags", ctypes.c_uint)]


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The CUDA runtime library that torch uses, or None."""
    if not torch.cuda.is_available():
        return None
    torch_dir = os.path.dirname(torch.__file__)
    candidates = sorted(glob.glob(os.path.join(torch_dir, "lib", "libcudart.so*")))
    candidates += sorted(glob.glob(os.path.join(os.path.dirname(torch_dir), "nvidia", "*", "lib",
                                                "libcudart.so*")), reverse=True)
    found = ctypes.util.find_library("cudart")
    if found:
        candidates.append(found)
    for path in candidates:
        try:
            lib = ctypes.CDLL(path)
            lib.cudaMemcpyAsync  # noqa: B018 - probe: a library without it is no runtime
        except (OSError, AttributeError):
            continue
        return lib
    return None


@functools.cache
def runtime_version() -> int | None:
    """``cudaRuntimeGetVersion`` of the loaded runtime (e.g. 13000), or None."""
    lib = _library()
    if lib is None:
        return None
    out = ctypes.c_int(0)
    if lib.cudaRuntimeGetVersion(ctypes.byref(out)) != 0:
        return None
    return out.value


@functools.cache
def memcpy_async() -> Memcpy | None:
    """``cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, stream)``, or None."""
    lib = _library()
    if lib is None:
        return None
    fn = lib.cudaMemcpyAsync
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    return lambda dst, src, nbytes, stream: fn(dst, src, nbytes, _CUDA_MEMCPY_DEFAULT, stream)


@functools.cache
def batch_memcpy_async() -> BatchMemcpy | None:
    """``cudaMemcpyBatchAsync`` with one stream-ordered attribute for every copy, or None.

    The signature changed between runtimes: 12.8/12.9 take a ``size_t* failIdx`` before the
    stream, 13.x do not. The version decides which one is bound; older runtimes get None.
    Copies inside a batch are unordered among themselves (ours never overlap) and the batch
    as a whole is ordered in the stream, like a ``cudaMemcpyAsync`` per copy.
    """
    lib, version = _library(), runtime_version()
    if lib is None or version is None or version < _BATCH_MIN_VERSION:
        return None
    try:
        fn = lib.cudaMemcpyBatchAsync
    except AttributeError:
        return None
    # One attribute entry applying to copies 0..count-1; kept alive by the closure.
    attrs = _MemcpyAttributes(srcAccessOrder=_SRC_ACCESS_ORDER_STREAM)
    attr_idx = (ctypes.c_size_t * 1)(0)
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    fn.restype = ctypes.c_int
    if version >= _BATCH_NO_FAILIDX_VERSION:
        fn.argtypes = [vp, vp, vp, sz, vp, vp, sz, vp]

        def call(dsts: int, srcs: int, sizes: int, count: int, stream: int) -> int:
            status: int = fn(dsts, srcs, sizes, count, ctypes.byref(attrs), attr_idx, 1, stream)
            return status
    else:
        fn.argtypes = [vp, vp, vp, sz, vp, vp, sz, vp, vp]
        fail_idx = ctypes.c_size_t(0)

        def call(dsts: int, srcs: int, sizes: int, count: int, stream: int) -> int:
            status: int = fn(dsts, srcs, sizes, count, ctypes.byref(attrs), attr_idx, 1,
                             ctypes.byref(fail_idx), stream)
            return status
    return call


@functools.cache
def memcpy_2d_async() -> Memcpy2D | None:
    """``cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, cudaMemcpyDefault, stream)``."""
    lib = _library()
    if lib is None:
        return None
    fn = lib.cudaMemcpy2DAsync
    fn.restype = ctypes.c_int
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    fn.argtypes = [vp, sz, vp, sz, sz, sz, ctypes.c_int, vp]
    return lambda dst, dpitch, src, spitch, width, height, stream: fn(
        dst, dpitch, src, spitch, width, height, _CUDA_MEMCPY_DEFAULT, stream)


@functools.cache
def max_pitch(device_index: int) -> int:
    """The largest row pitch a 2D copy accepts on the device (``cudaDevAttrMaxPitch``); 0 if
    unknown."""
    lib = _library()
    if lib is None:
        return 0
    out = ctypes.c_int(0)
    if lib.cudaDeviceGetAttribute(ctypes.byref(out), _DEV_ATTR_MAX_PITCH, device_index) != 0:
        return 0
    return out.value


def clear_error() -> None:
    """Reset the runtime's per-thread "last error" after a failed call made here.

    Why: a failed ``cudaMemcpy*`` leaves its error as the thread's last error, and torch
    checks that after its own next launch, raising there instead (seen on an H100: a
    failed 2D copy surfaced as "invalid argument" in an unrelated ``index_select``).
    The job that failed reports the error; nothing else should see it.
    """
    lib = _library()
    if lib is not None:
        lib.cudaGetLastError()
