"""The copy mechanisms the probe measures (``probe_transfer_limits.py``): cross-layer and
per-layer candidates, the staged gather, the zero-copy kernels."""

from __future__ import annotations

from collections.abc import Callable

import torch

# The probe's own modules (importing _probe_setup allocates the GPU buffers).
from _probe_setup import (
    BLK,
    L_C,
    L_G,
    ROW,
    S_C,
    S_G,
    L,
    N,
    batch,
    check,
    cl,
    dev,
    host_bm,
    host_pm,
    kstreams,
    memcpy,
    pl,
    start,
    streams,
)


# ------------------------------------------------------------------ cross-layer candidates
def cl_rows(is_store: bool, n: int = N) -> tuple[list[int], list[int]]:
    g, c = (S_G, S_C) if is_store else (L_G, L_C)
    gp = [cl.data_ptr() + i * BLK for i in g[:n]]
    cp = [host_bm.data_ptr() + i * BLK for i in c[:n]]
    return (cp, gp) if is_store else (gp, cp)  # dst, src


def per_copy(dsts: list[int], srcs: list[int], sizes: list[int] | int,
             ss: list[torch.cuda.Stream]) -> Callable[[], None]:
    handles = [s.cuda_stream for s in ss]
    sz = sizes if isinstance(sizes, list) else [sizes] * len(dsts)

    def fn() -> None:
        start(ss)
        k = len(handles)
        for i, (d, s, b) in enumerate(zip(dsts, srcs, sz, strict=True)):
            check(memcpy(d, s, b, handles[i % k]))
    return fn


def batched(dsts: list[int], srcs: list[int], sizes: list[int] | int,
            ss: list[torch.cuda.Stream]) -> Callable[[], None]:
    sz = sizes if isinstance(sizes, list) else [sizes] * len(dsts)
    k = len(ss)
    parts = []
    for j in range(k):
        d = torch.tensor(dsts[j::k], dtype=torch.int64)
        s = torch.tensor(srcs[j::k], dtype=torch.int64)
        b = torch.tensor(sz[j::k], dtype=torch.int64)
        parts.append((d, s, b, ss[j].cuda_stream))

    def fn() -> None:
        start(ss)
        for d, s, b, h in parts:
            check(batch(d.data_ptr(), s.data_ptr(), b.data_ptr(), d.numel(), h))
    return fn


def join(*fns: Callable[[], None]) -> Callable[[], None]:
    def fn() -> None:
        for f in fns:
            f()
    return fn


# ------------------------------------------------------------------ per-layer candidates
def pl_rows(is_store: bool, n: int = N) -> tuple[list[int], list[int]]:
    g, c = (S_G, S_C) if is_store else (L_G, L_C)
    gp = [p.data_ptr() + i * ROW for p in pl for i in g[:n]]
    cp = [host_pm[j].data_ptr() + i * ROW for j in range(L) for i in c[:n]]
    return (cp, gp) if is_store else (gp, cp)


pl64 = [p.view(torch.int64) for p in pl]
host_pm64 = host_pm.view(torch.int64)


def staged64(is_store: bool, groups: int, n: int = N, kernel_stream: int = 0,
             dma_stream: int = 0) -> Callable[[], None]:
    """Gather int64 words on a kernel stream into staging, DMA per plane, pipelined by groups."""
    g, c = (S_G, S_C) if is_store else (L_G, L_C)
    idx = torch.tensor(g[:n], dtype=torch.int64, device=dev)
    stage = torch.empty((L, n, ROW // 8), dtype=torch.int64, device=dev)
    c0 = c[0]
    per = -(-L // groups)
    grp = [range(i, min(i + per, L)) for i in range(0, L, per)]
    ks, ds = kstreams[kernel_stream], streams[dma_stream]
    h = ds.cuda_stream

    def fn() -> None:
        start([ks, ds])
        for planes in grp:
            if is_store:
                with torch.cuda.stream(ks):
                    for p in planes:
                        torch.index_select(pl64[p], 0, idx, out=stage[p])
                ev = torch.cuda.Event()
                ev.record(ks)
                ds.wait_event(ev)
                for p in planes:
                    check(memcpy(host_pm[p, c0].data_ptr(), stage[p].data_ptr(), n * ROW, h))
            else:
                for p in planes:
                    check(memcpy(stage[p].data_ptr(), host_pm[p, c0].data_ptr(), n * ROW, h))
                ev = torch.cuda.Event()
                ev.record(ds)
                ks.wait_event(ev)
                with torch.cuda.stream(ks):
                    for p in planes:
                        pl64[p].index_copy_(0, idx, stage[p])
    return fn


def host_alias(t: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor viewing pinned host memory (UVA): kernels read and write it directly."""
    class _I:
        __cuda_array_interface__ = {"shape": tuple(t.shape), "typestr": "<i8",
                                    "data": (t.data_ptr(), False), "version": 2,
                                    "strides": tuple(s * 8 for s in t.stride())}
    return torch.as_tensor(_I(), device=dev)


def zero_copy_torch(is_store: bool, n: int = N) -> Callable[[], None]:
    g, c = (S_G, S_C) if is_store else (L_G, L_C)
    idx = torch.tensor(g[:n], dtype=torch.int64, device=dev)
    alias = host_alias(host_pm64)
    c0 = c[0]
    ks = kstreams[0]

    def fn() -> None:
        start([ks])
        with torch.cuda.stream(ks):
            for p in range(L):
                if is_store:
                    torch.index_select(pl64[p], 0, idx, out=alias[p, c0:c0 + n])
                else:
                    pl64[p].index_copy_(0, idx, alias[p, c0:c0 + n])
    return fn


try:
    import triton
    import triton.language as tl

    @triton.jit
    def _row_copy(dst_tab, src_tab, n_rows, ROW64: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        for i in range(pid, n_rows, nprog):
            d = tl.load(dst_tab + i).to(tl.pointer_type(tl.int64))
            s = tl.load(src_tab + i).to(tl.pointer_type(tl.int64))
            for off in range(0, ROW64, BLOCK):
                o = off + tl.arange(0, BLOCK)
                tl.store(d + o, tl.load(s + o))
    TRITON = None
except Exception as exc:  # noqa: BLE001
    TRITON = repr(exc)


def zero_copy_triton(is_store: bool, grid: int, n: int = N, warps: int = 8) -> Callable[[], None]:
    dsts, srcs = pl_rows(is_store, n)
    dt = torch.tensor(dsts, dtype=torch.int64, device=dev)
    st = torch.tensor(srcs, dtype=torch.int64, device=dev)
    ks = kstreams[0]

    def fn() -> None:
        start([ks])
        with torch.cuda.stream(ks):
            _row_copy[(grid,)](dt, st, dt.numel(), ROW64=ROW // 8, BLOCK=2048, num_warps=warps)
    return fn
