"""The probe's mover runs (``probe_transfer_limits.py --mover`` / ``--bisect``): the mover's
internals against the bare mechanisms."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import torch

# The probe's own modules last (importing _probe_setup allocates the GPU buffers).
from _probe_candidates import batched, cl_rows, staged64
from _probe_setup import (
    BLK,
    L_C,
    L_G,
    NB,
    NBYTES,
    ROW,
    S_C,
    S_G,
    L,
    N,
    _print_table,
    batch,
    cl_base,
    contig,
    memcpy,
    paired,
    pl,
    streams,
)

from connectors.offload.transfer import KVBlockMover


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
        plan = m.copier.gather_plan
        print(json.dumps({"span": plan.source is not None, "cpu_pitch": plan.cpu_pitch, "word": str(plan.word)}))
        bw(f"PL mover gather span+2D, issue thread {thread}", m)
        m.copier.gather_plan = dataclasses.replace(plan, cpu_pitch=None)
        bw(f"PL mover gather span+1D, issue thread {thread}", m)
        m.copier.gather_plan = dataclasses.replace(plan, cpu_pitch=None, source=None)
        bw(f"PL mover gather per-plane+1D, issue thread {thread}", m)
        m.copier.gather_plan = plan
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

    from connectors.offload.transfer import staging as _staged
    from connectors.offload.transfer.copy_plan import run_starts
    from connectors.offload.transfer.jobs import Job as _Job
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
    d, s_, z = m.copier.plan.descriptors(g_t, c_t, True)
    bw("B2 bare batch of the mover's descriptors, 4 streams",
       batched(d.tolist(), s_.tolist(), z.tolist(), streams[:4]))

    def b3() -> None:
        stream.wait_stream(torch.cuda.current_stream())
        begin = torch.cuda.Event()
        begin.record(stream)
        m.copier._copy_batched(batch, True, array.array("q", S_G), array.array("q", S_C), stream, begin)
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
    ds, ks = pm._streams[True], pm.copier.kernel_streams[True]
    plan = pm.copier.gather_plan
    keep: list = []
    for name, pl_plan in (("per-plane, 1D", dataclasses.replace(plan, source=None, cpu_pitch=None)),
                          ("span, 1D", dataclasses.replace(plan, cpu_pitch=None)), ("span, 2D", plan)):
        def g2(pl_plan=pl_plan) -> None:
            keep.clear()
            ds.wait_stream(torch.cuda.current_stream())
            _staged.staged_copy(pl_plan, True, g_t, runs, ds, ks, memcpy, pm.copier.stage_2d, keep)
        bw(f"G2 staged_copy {name}", g2)
    bw("G4 mover submit_store + wait, inline",
       lambda: (pm.submit_store(next(jobs), S_G, S_C), pm.wait(), pm.get_finished()))
    pm.shutdown()
    _print_table("| step | store GB/s | contiguous GB/s | x contig (median) | p25-p75 |", rows,
                 lambda r: f"{r['GBs']:.1f} | {r['contig_GBs']:.1f} | {r['x']:.3f} | "
                           f"{r['x_p25']:.3f}-{r['x_p75']:.3f}")
    return 0
