"""Probe: which copy mechanisms reach the contiguous pinned copy, and what they cost a step.

Issue 14 asks for 0.95x of the contiguous pinned copy in both layouts with scattered ids,
1.7x one direction for store + load at once, and <= 3% step slowdown. This probe measures
the candidate mechanisms themselves, outside :class:`KVBlockMover`, on one GPU in one run,
each paired alternately with the contiguous copy of the same bytes (ratio per pair, median
and inter-quartile spread reported), so that a method is adopted on evidence:

* cross-layer rows (2 MiB per block): one ``cudaMemcpyAsync`` per block on 1, 2 or 4
  streams; one ``cudaMemcpyBatchAsync`` on 1 or 4 streams;
* per-layer rows (64 KiB per block and layer, separate allocations, vLLM's layout): the batch
  API; a staged gather whose kernels move 8-byte words (``index_select`` on int64 views) in
  groups of planes pipelined with the DMAs; zero-copy gathers that write straight into mapped
  pinned memory, through ``index_select`` into an aliasing CUDA view and through a Triton
  kernel with a bounded grid;
* store + load at once for the contiguous copy (the ceiling) and the candidates;
* a model step (bf16 MLP matmuls, 2048 tokens) with 64 blocks each way issued inline,
  alternating with the step alone: compute GPU time and wall time.

    PYTHONPATH=. python3 benchmarks/probe_transfer_limits.py      # CUDA only

Writes ``probe_transfer_limits.json`` to ``$OUT`` when set.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

from connectors.offload import _cudart
from connectors.offload.transfer import KVBlockMover

L, H, D, BS = 32, 8, 128, 16
ROW = 2 * BS * H * D * 2  # bytes of one block of one layer (64 KiB)
BLK = ROW * L  # bytes of one block of all layers (2 MiB)
NB, N, NI = 4096, 256, 64  # device blocks, blocks per bandwidth job, per interference job
REPS = 15
dev = torch.device("cuda")
memcpy = _cudart.memcpy_async()
batch = _cudart.batch_memcpy_async()


def q(xs: list[float], f: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(f * len(s)))]


def time_once(fn: Callable[[], None]) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def paired(fn: Callable[[], None], base: Callable[[], None], nbytes: int) -> dict:
    """GB/s of fn and base, alternated; the ratio per pair, median and quartiles."""
    fn(), base(), fn(), base()
    ta, tb = [], []
    for r in range(REPS):
        order = (fn, base) if r % 2 == 0 else (base, fn)
        t = {f: time_once(f) for f in order}
        ta.append(t[fn])
        tb.append(t[base])
    ratios = [b / a for a, b in zip(ta, tb, strict=True)]
    return {"GBs": nbytes / statistics.median(ta) / 1e9, "contig_GBs": nbytes / statistics.median(tb) / 1e9,
            "x": statistics.median(ratios), "x_p25": q(ratios, 0.25), "x_p75": q(ratios, 0.75)}


def rand_fill(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.bfloat16).normal_()


# ------------------------------------------------------------------ buffers
gen = torch.Generator().manual_seed(1)
perm = torch.randperm(NB, generator=gen).tolist()
S_G, L_G = perm[:N], perm[N:2 * N]  # scattered device ids for store / load
S_C, L_C = list(range(N)), list(range(N, 2 * N))  # consecutive CPU ids

cl_base = rand_fill(torch.empty(NB * BLK, dtype=torch.uint8, device=dev)).view(torch.uint8)
cl = cl_base.view(NB, BLK)  # cross-layer plane
pl = [rand_fill(torch.empty(NB * ROW, dtype=torch.uint8, device=dev)).view(torch.uint8).view(NB, ROW)
      for _ in range(L)]  # per-layer planes, separate allocations
host_bm = torch.empty((2 * N, BLK), dtype=torch.uint8, pin_memory=True)  # block-major CPU
host_pm = torch.empty((L, 2 * N, ROW), dtype=torch.uint8, pin_memory=True)  # plane-major CPU
rand_fill(host_bm.view(-1)), rand_fill(host_pm.view(-1))

NBYTES = N * BLK
c_dev = [rand_fill(torch.empty(NBYTES, dtype=torch.uint8, device=dev)).view(torch.uint8) for _ in range(2)]
c_host = [torch.empty(NBYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
streams = [torch.cuda.Stream() for _ in range(8)]
kstreams = [torch.cuda.Stream() for _ in range(2)]


def contig(direction: str) -> Callable[[], None]:
    def store() -> None:
        with torch.cuda.stream(streams[0]):
            c_host[0].copy_(c_dev[0], non_blocking=True)

    def load() -> None:
        with torch.cuda.stream(streams[4]):
            c_dev[1].copy_(c_host[1], non_blocking=True)

    def both() -> None:
        store()
        load()
    return {"store": store, "load": load, "both": both}[direction]


def check(rc: int) -> None:
    if rc != 0:
        raise RuntimeError(f"CUDA error {rc}")


def start(ss: list[torch.cuda.Stream]) -> None:
    ev = torch.cuda.Event()
    ev.record()
    for s in ss:
        s.wait_event(ev)


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


# ------------------------------------------------------------------ runs
def main() -> int:
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "cuda_runtime": _cudart.runtime_version(), "triton_error": TRITON,
            "batch_api": batch is not None}
    print(json.dumps(info), flush=True)
    rows: list[dict] = []

    def bw(name: str, direction: str, fn: Callable[[], None], check_fn=None) -> None:
        nbytes = NBYTES * (2 if direction == "both" else 1)
        try:
            r = paired(fn, contig(direction), nbytes)
            if check_fn is not None:
                r["ok"] = check_fn()
        except Exception as exc:  # noqa: BLE001
            r = {"error": repr(exc)[:300]}
        r.update(name=name, dir=direction)
        rows.append(r)
        print(json.dumps(r), flush=True)

    # the ceiling itself, against itself (spread of the pairing method)
    for d in ("store", "load", "both"):
        bw("contiguous (vs itself)", d, (lambda f: lambda: f())(contig(d)))
    # cross-layer
    for k in (1, 2, 4):
        ss_s, ss_l = streams[:k], streams[4:4 + k]
        s, lo = per_copy(*cl_rows(True), BLK, ss_s), per_copy(*cl_rows(False), BLK, ss_l)
        bw(f"CL per-block memcpy, {k} stream(s)", "store", s)
        bw(f"CL per-block memcpy, {k} stream(s)", "load", lo)
        bw(f"CL per-block memcpy, {k} stream(s)", "both", join(s, lo))
    for k in (1, 4):
        s, lo = batched(*cl_rows(True), BLK, streams[:k]), batched(*cl_rows(False), BLK, streams[4:4 + k])
        bw(f"CL batch API, {k} stream(s)", "store", s)
        bw(f"CL batch API, {k} stream(s)", "load", lo)
        bw(f"CL batch API, {k} stream(s)", "both", join(s, lo))
    # per-layer
    for k in (1, 4):
        s, lo = batched(*pl_rows(True), ROW, streams[:k]), batched(*pl_rows(False), ROW, streams[4:4 + k])
        bw(f"PL batch API, {k} stream(s)", "store", s)
        bw(f"PL batch API, {k} stream(s)", "load", lo)
    for groups in (4, 8, 16):
        s, lo = staged64(True, groups), staged64(False, groups, kernel_stream=1, dma_stream=4)
        bw(f"PL staged int64 gather, {groups} groups", "store", s)
        bw(f"PL staged int64 gather, {groups} groups", "load", lo)
        bw(f"PL staged int64 gather, {groups} groups", "both", join(s, lo))
    bw("PL zero-copy index_select (full grid)", "store", zero_copy_torch(True))
    bw("PL zero-copy index_copy_ (full grid)", "load", zero_copy_torch(False))
    if TRITON is None:
        for grid in (16, 32, 132):
            s, lo = zero_copy_triton(True, grid), zero_copy_triton(False, grid)
            bw(f"PL zero-copy Triton, grid {grid}", "store", s)
            bw(f"PL zero-copy Triton, grid {grid}", "load", lo)
    # the mover as it is (issue thread, default method), for reference in the same run
    for name, caches in (("CL", {f"l{i}": cl_base.view(NB, L, ROW)[:, i] for i in range(L)}),
                         ("PL", {f"l{i}": pl[i] for i in range(L)})):
        mover = KVBlockMover(caches, num_cpu_blocks=2 * N)
        jobs = iter(range(1 << 30))
        bw(f"{name} mover auto (this checkout)", "store",
           lambda m=mover: (m.submit_store(next(jobs), S_G, S_C), m.wait()))
        bw(f"{name} mover auto (this checkout)", "load",
           lambda m=mover: (m.submit_load(next(jobs), L_C, L_G), m.wait()))
        bw(f"{name} mover auto (this checkout)", "both",
           lambda m=mover: (m.submit_store(next(jobs), S_G, S_C), m.submit_load(next(jobs), L_C, L_G),
                            m.wait()))
        mover.shutdown()
        del mover
    # correctness of the new candidates (a few rows)
    ok = {}
    try:
        staged64(True, 8)()
        torch.cuda.synchronize()
        ok["staged64"] = all(torch.equal(pl[p][S_G[i]].cpu(), host_pm[p, S_C[i]]) for p in (0, 31) for i in (0, 255))
        host_pm.zero_()
        zero_copy_torch(True)()
        torch.cuda.synchronize()
        ok["zc_torch"] = all(torch.equal(pl[p][S_G[i]].cpu(), host_pm[p, S_C[i]]) for p in (0, 31) for i in (0, 255))
        if TRITON is None:
            host_pm.zero_()
            zero_copy_triton(True, 32)()
            torch.cuda.synchronize()
            ok["zc_triton"] = all(torch.equal(pl[p][S_G[i]].cpu(), host_pm[p, S_C[i]]) for p in (0, 31) for i in (0, 255))
    except Exception as exc:  # noqa: BLE001
        ok["error"] = repr(exc)[:300]
    print(json.dumps({"correct": ok}), flush=True)
    inter = interference()
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "probe_transfer_limits.json"), "w") as f:
            json.dump({"info": info, "rows": rows, "correct": ok, "interference": inter}, f, indent=1)
    print(f"\n{info['gpu']}, torch {info['torch']}, runtime {info['cuda_runtime']}: {N} blocks of 2 MiB, "
          f"ratio to the contiguous pinned copy per alternating pair, median [p25, p75] of {REPS}")
    _print_table("| candidate | direction | GB/s | contiguous GB/s | x contig (median) | p25-p75 |", rows,
                 lambda r: f"{r['dir']} | {r['GBs']:.1f} | {r['contig_GBs']:.1f} | {r['x']:.3f} | "
                           f"{r['x_p25']:.3f}-{r['x_p75']:.3f}")
    print(f"\nStep (8 x MLP matmul pairs, 2048 tokens) with {NI} blocks each way issued inline, "
          "alternating with the step alone; medians")
    _print_table("| candidate | compute GPU ms (alone) | compute GPU ms | GPU slowdown | wall ms (alone) | "
                 "wall ms | wall slowdown | issue ms |", inter,
                 lambda r: f"{r['g0']:.3f} | {r['g1']:.3f} | {(r['g1'] / r['g0'] - 1) * 100:+.1f}% | "
                           f"{r['w0']:.3f} | {r['w1']:.3f} | {(r['w1'] / r['w0'] - 1) * 100:+.1f}% | "
                           f"{r['issue']:.3f}")
    return 0


def _print_table(head: str, rows: list[dict], cells: Callable[[dict], str]) -> None:
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in rows:
        print(f"| {r['name']} | " + (f"error: {r['error'][:120]}" if "error" in r else cells(r)) + " |")


def interference() -> list[dict]:
    x = torch.randn(2048, 4096, dtype=torch.bfloat16, device=dev)
    w1 = torch.randn(4096, 14336, dtype=torch.bfloat16, device=dev) * 0.01
    w2 = torch.randn(14336, 4096, dtype=torch.bfloat16, device=dev) * 0.01

    def compute() -> None:
        for _ in range(8):
            (x @ w1) @ w2

    def step(submit: Callable[[], None] | None) -> tuple[float, float, float]:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if submit is not None:
            submit()
        t1 = time.perf_counter()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        compute()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b), (time.perf_counter() - t0) * 1e3, (t1 - t0) * 1e3

    cands: list[tuple[str, Callable[[], Callable[[], None]]]] = [
        ("none (alone vs alone)", lambda: (lambda: None)),
        ("CL per-block memcpy, 1 stream", lambda: join(per_copy(*cl_rows(True, NI), BLK, streams[:1]),
                                                       per_copy(*cl_rows(False, NI), BLK, streams[4:5]))),
        ("CL batch API, 1 stream", lambda: join(batched(*cl_rows(True, NI), BLK, streams[:1]),
                                                batched(*cl_rows(False, NI), BLK, streams[4:5]))),
        ("PL batch API, 1 stream", lambda: join(batched(*pl_rows(True, NI), ROW, streams[:1]),
                                                batched(*pl_rows(False, NI), ROW, streams[4:5]))),
        ("PL staged int64 gather, 8 groups", lambda: join(staged64(True, 8, NI),
                                                          staged64(False, 8, NI, kernel_stream=1, dma_stream=4))),
        ("PL zero-copy index_select/index_copy_", lambda: join(zero_copy_torch(True, NI),
                                                               zero_copy_torch(False, NI))),
    ]
    if TRITON is None:
        for grid in (16, 32):
            cands.append((f"PL zero-copy Triton, grid {grid}",
                          lambda grid=grid: join(zero_copy_triton(True, grid, NI), zero_copy_triton(False, grid, NI))))
    out = []
    for name, make in cands:
        try:
            fn = make()
            samples = []
            for i in range(25):
                b = step(None)
                t = step(fn)
                if i >= 5:
                    samples.append((b, t))
            med = statistics.median
            r = {"name": name, "g0": med(s[0][0] for s in samples), "g1": med(s[1][0] for s in samples),
                 "w0": med(s[0][1] for s in samples), "w1": med(s[1][1] for s in samples),
                 "issue": med(s[1][2] for s in samples)}
        except Exception as exc:  # noqa: BLE001
            r = {"name": name, "error": repr(exc)[:300]}
        out.append(r)
        print(json.dumps(r), flush=True)
    return out


def mover_breakdown() -> int:
    """Where the mover loses against the bare mechanisms: variants of its internals, and a profile."""
    import cProfile
    import dataclasses
    import pstats
    cl_caches = {f"l{i}": cl_base.view(NB, L, ROW)[:, i] for i in range(L)}
    pl_caches = {f"l{i}": pl[i] for i in range(L)}
    jobs = iter(range(1 << 30))
    rows = []

    def bw(name: str, mover: KVBlockMover) -> None:
        for d in ("store", "load"):
            fn = ((lambda: (mover.submit_store(next(jobs), S_G, S_C), mover.wait(), mover.get_finished()))
                  if d == "store" else
                  (lambda: (mover.submit_load(next(jobs), L_C, L_G), mover.wait(), mover.get_finished())))
            r = paired(fn, contig(d), NBYTES)
            r.update(name=name, dir=d)
            rows.append(r)
            print(json.dumps(r), flush=True)

    for thread in (False, True):
        m = KVBlockMover(cl_caches, num_cpu_blocks=2 * N, issue_thread=thread)
        bw(f"CL mover auto, issue thread {thread}", m)
        m.shutdown()
    for thread in (False, True):
        m = KVBlockMover(pl_caches, num_cpu_blocks=2 * N, issue_thread=thread)
        plan = m._gather_plan
        print(json.dumps({"span": plan.source is not None, "cpu_pitch": plan.cpu_pitch, "word": str(plan.word)}))
        bw(f"PL mover gather span+2D, issue thread {thread}", m)
        m._gather_plan = dataclasses.replace(plan, cpu_pitch=None)
        bw(f"PL mover gather span+1D, issue thread {thread}", m)
        m._gather_plan = dataclasses.replace(plan, cpu_pitch=None, source=None)
        bw(f"PL mover gather per-plane+1D, issue thread {thread}", m)
        m._gather_plan = plan
        m.shutdown()
    for name, caches in (("CL", cl_caches), ("PL", pl_caches)):
        m = KVBlockMover(caches, num_cpu_blocks=2 * N, issue_thread=False)
        for _ in range(3):
            m.submit_store(next(jobs), S_G, S_C)
            m.wait()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(20):
            m.submit_store(next(jobs), S_G, S_C)
            m.wait()
        prof.disable()
        m.get_finished()
        print(f"--- profile: {name} mover auto, 20 inline store jobs of {N} blocks")
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)
        m.shutdown()
    _print_table("| candidate | direction | GB/s | contiguous GB/s | x contig (median) | p25-p75 |", rows,
                 lambda r: f"{r['dir']} | {r['GBs']:.1f} | {r['contig_GBs']:.1f} | {r['x']:.3f} | "
                           f"{r['x_p25']:.3f}-{r['x_p75']:.3f}")
    return 0


def bisect() -> int:
    """From the bare mechanism to the whole mover, one layer of the mover at a time (inline)."""
    import array
    import dataclasses

    from connectors.offload import _staged
    from connectors.offload._copy_plan import run_starts
    from connectors.offload.transfer import _Job
    rows = []

    def bw(name: str, fn: Callable[[], None]) -> None:
        r = paired(fn, contig("store"), NBYTES)
        r.update(name=name, dir="store")
        rows.append(r)
        print(json.dumps(r), flush=True)

    g_t, c_t = torch.tensor(S_G), torch.tensor(S_C)
    cl_caches = {f"l{i}": cl_base.view(NB, L, ROW)[:, i] for i in range(L)}
    m = KVBlockMover(cl_caches, num_cpu_blocks=2 * N, issue_thread=False)
    stream = m._streams[True]
    bw("B1 bare batch, 4 streams, interleaved", batched(*cl_rows(True), BLK, streams[:4]))
    d, s_, z = m._plan.descriptors(g_t, c_t, True)
    bw("B2 bare batch of the mover's descriptors, 4 streams",
       batched(d.tolist(), s_.tolist(), z.tolist(), streams[:4]))

    def b3() -> None:
        stream.wait_stream(torch.cuda.current_stream())
        begin = torch.cuda.Event()
        begin.record(stream)
        m._copy_batched(batch, True, array.array("q", S_G), array.array("q", S_C), stream, begin)
    bw("B3 mover _copy_batched (descriptors + lanes)", b3)

    def b4() -> None:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream())
        m._issue(_Job(0, True, NBYTES, time.perf_counter()), ready, array.array("q", S_G),
                 array.array("q", S_C))
    bw("B4 mover _issue (events, ids)", b4)
    jobs = iter(range(1 << 30))
    bw("B5 mover submit_store + wait, inline",
       lambda: (m.submit_store(next(jobs), S_G, S_C), m.wait(), m.get_finished()))
    m.shutdown()
    pm = KVBlockMover({f"l{i}": pl[i] for i in range(L)}, num_cpu_blocks=2 * N, issue_thread=False)
    for groups in (16, 8):
        bw(f"G1 bare staged int64, {groups} groups", staged64(True, groups))
    runs = list(zip(*(t.tolist() for t in run_starts(torch.arange(N), c_t)), strict=True))
    ds, ks = pm._streams[True], pm._kernel_streams[True]
    plan = pm._gather_plan
    keep: list = []
    for name, pl_plan in (("per-plane, 1D", dataclasses.replace(plan, source=None, cpu_pitch=None)),
                          ("span, 1D", dataclasses.replace(plan, cpu_pitch=None)), ("span, 2D", plan)):
        def g2(pl_plan=pl_plan) -> None:
            keep.clear()
            ds.wait_stream(torch.cuda.current_stream())
            _staged.staged_copy(pl_plan, True, g_t, runs, ds, ks, memcpy, pm._stage_2d, keep)
        bw(f"G2 staged_copy {name}", g2)
    bw("G4 mover submit_store + wait, inline",
       lambda: (pm.submit_store(next(jobs), S_G, S_C), pm.wait(), pm.get_finished()))
    pm.shutdown()
    _print_table("| step | store GB/s | contiguous GB/s | x contig (median) | p25-p75 |", rows,
                 lambda r: f"{r['GBs']:.1f} | {r['contig_GBs']:.1f} | {r['x']:.3f} | "
                           f"{r['x_p25']:.3f}-{r['x_p75']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(mover_breakdown() if "--mover" in sys.argv else bisect() if "--bisect" in sys.argv
             else main())
