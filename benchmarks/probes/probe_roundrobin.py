"""Probe: one-way transfers of several movers, round robin, each paired with the contiguous copy.

``bench_transfer.py`` measures one variant after another, so drift over the run lands on
whichever row runs at the time (rows of one configuration differ by up to 0.04 there).
Here every variant is a mover of its own over the same KV cache, and each round times
every variant once per direction, each right beside a contiguous pinned copy of the same
bytes (which of the two goes first alternates), in a rotated order. The ratio of the
pair is one sample; the table gives its median and quartiles over the rounds, so that
0.95x against 0.94x can be told apart from noise. A control row pairs the contiguous copy
with itself (the method's own spread).

Variants are ``_transfer_variants`` labels for this checkout's mover, plus ``main`` (the
mover of ``--baseline-root``, default method).

    PYTHONPATH=.:benchmarks python3 benchmarks/probes/probe_roundrobin.py --baseline-root ../base

CUDA only. Writes ``probe_roundrobin.json`` to ``$OUT`` when set.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
from _transfer_variants import add_kv_args, apply_variant, baseline_mover_class, make_kv_caches, restore
from bench_transfer import _check, _contiguous_fns, _time_once

from connectors.offload.transfer import KVBlockMover

_JOBS = iter(range(1 << 30))


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4)
    return q[1], q[0], q[2]


def kernel_times(rows_per_plane: int = 256, planes: int = 4, row: int = 64 << 10) -> None:
    """GPU time of one stage's gather / scatter (``index_select`` / ``index_copy_`` of
    ``planes * rows_per_plane`` rows of ``row`` bytes out of a large span) per element width."""
    span = torch.randint(0, 1 << 62, (4 * planes * rows_per_plane, row // 8), dtype=torch.int64,
                         device="cuda")
    idx = torch.randperm(span.shape[0], device="cuda")[:planes * rows_per_plane]
    for dtype in (torch.int64, torch.complex128):
        src = span.view(dtype)
        out = torch.empty((idx.numel(), src.shape[1]), dtype=dtype, device="cuda")
        for name, fn in (("gather", lambda s=src, o=out: torch.index_select(s, 0, idx, out=o)),
                         ("scatter", lambda s=src, o=out: s.index_copy_(0, idx, o))):
            times = []
            for _ in range(25):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b))
            ms = statistics.median(times[5:])
            mib = idx.numel() * row / 2**20
            print(json.dumps({"kernel": name, "dtype": str(dtype), "MiB": mib, "ms": ms,
                              "GBs_read_plus_write": 2 * mib * 2**20 / ms / 1e6}), flush=True)
    del span


def _dmas_alone(mover: KVBlockMover, n: int) -> dict[str, Callable[[], None]]:
    """The DMAs of a default staged job (its stages' 2D copies between a dense device buffer
    and the mover's CPU buffer) with no kernels and no mover: what the copy engines alone do."""
    from connectors.offload.transfer import cudart as _cudart
    from connectors.offload.transfer.staging import group_planes, staging_copies
    plan = mover.copier.gather_plan
    memcpy_2d = _cudart.memcpy_2d_async()
    staging = torch.empty(len(plan.planes) * n * plan.row, dtype=torch.uint8, device="cuda")
    groups = group_planes(len(plan.planes), n * plan.row * len(plan.planes), taper=plan.taper)
    stream = torch.cuda.Stream()
    out = {}
    for d, to_cpu, cpu0 in (("store", True, 0), ("load", False, n)):
        copies = [c for g in groups for c in staging_copies(plan, g, n, [(0, cpu0, n)],
                                                             staging.data_ptr(), to_cpu=to_cpu)]

        def run(copies=copies) -> None:
            stream.wait_stream(torch.cuda.current_stream())
            for dst, dp, src, sp, w, h in copies:
                assert memcpy_2d(dst, dp, src, sp, w, h, stream.cuda_stream) == 0
            torch.cuda.current_stream().wait_stream(stream)
        out[d] = run
    return out


def timeline(caches: dict[str, torch.Tensor], n: int, label: str, jobs: int = 12, *,
             thread: bool = False) -> None:
    """GPU and host timeline of a mover variant's staged jobs, median over ``jobs`` jobs per
    direction (issued inline, or with ``thread`` through the issue thread as in the rounds).

    GPU marks, ms from the job's start event: the end of each DMA call's copies (``dma k``),
    of each span kernel (``kernel k``), of each by-id gather (``gather k``) and of the id
    upload (``upload k``), and the job's ``end``. Host marks (``h ...``), ms from the
    ``submit_*`` call: when issuing began (``h issue``, the range check), when ``submit_*``
    returned (``h submit``), and when each of the calls above returned. Every mark records a
    CUDA event, which costs some host time itself.
    """
    from connectors.offload.transfer import staging as _staged
    from connectors.offload.transfer.staging import StagingBuffers
    marks: list[tuple[str, torch.cuda.Event | None, float]] = []
    t_submit = [0.0]
    orig_dma, orig_move, orig_select = _staged._dma, _staged._move, torch.index_select
    orig_upload = StagingBuffers.upload_ids

    def mark(kind: str, stream: torch.cuda.Stream | None) -> None:
        e = None
        if stream is not None:
            e = torch.cuda.Event(enable_timing=True)
            e.record(stream)
        marks.append((kind, e, time.perf_counter() - t_submit[0]))

    def dma(*args, **kwargs):  # type: ignore[no-untyped-def]
        orig_dma(*args, **kwargs)
        mark("dma", args[5])

    def move(*args, **kwargs):  # type: ignore[no-untyped-def]
        orig_move(*args, **kwargs)
        mark("kernel", torch.cuda.current_stream())

    def select(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = orig_select(*args, **kwargs)
        mark("gather", torch.cuda.current_stream())
        return out

    def upload(self, plan, gpu_ids, stream, keep_alive):  # type: ignore[no-untyped-def]
        out = orig_upload(self, plan, gpu_ids, stream, keep_alive)
        mark("upload", stream)
        return out

    _staged._dma, _staged._move, torch.index_select = dma, move, select
    StagingBuffers.upload_ids = upload  # type: ignore[method-assign]
    try:
        perm = torch.randperm(4096, generator=torch.Generator().manual_seed(1)).tolist()
        mover = KVBlockMover(caches, num_cpu_blocks=2 * n, issue_thread=thread)
        apply_variant(mover, label)
        check = mover._check_range
        mover._check_range = lambda g, c: (mark("issue", None), check(g, c))[1]  # type: ignore[method-assign]
        for is_store in (True, False):
            rows: dict[str, list[float]] = {}
            for j in range(jobs + 2):
                marks.clear()
                torch.cuda.synchronize()
                t_submit[0] = time.perf_counter()
                if is_store:
                    mover.submit_store(next(_JOBS), perm[:n], list(range(n)))
                else:
                    mover.submit_load(next(_JOBS), list(range(n)), perm[:n])
                mark("submit", None)
                mover.wait()
                job = mover._jobs[-1]
                if j < 2:
                    mover.get_finished()
                    continue
                counts: dict[str, int] = {}
                for kind, e, host in marks:
                    k = counts[kind] = counts.get(kind, -1) + 1
                    if e is not None:
                        rows.setdefault(f"{kind} {k}", []).append(job.start_event.elapsed_time(e))
                    if e is None or k < 2:
                        rows.setdefault(f"h {kind}" + (f" {k}" if e is not None else ""), []).append(1e3 * host)
                rows.setdefault("end", []).append(job.start_event.elapsed_time(job.end_event))
                mover.get_finished()
            print(json.dumps({"timeline": "store" if is_store else "load", "variant": label,
                              "issue_thread": thread,
                              **{k: round(statistics.median(v), 3) for k, v in rows.items()}}), flush=True)
        mover._check_range = check  # type: ignore[method-assign]
        restore(mover)
        mover.shutdown()
    finally:
        _staged._dma, _staged._move, torch.index_select = orig_dma, orig_move, orig_select
        StagingBuffers.upload_ids = orig_upload  # type: ignore[method-assign]


def profile(caches: dict[str, torch.Tensor], n: int, jobs: int = 30) -> None:
    """Host time of inline staged jobs by function (cProfile, tottime), store and load, to
    ``$OUT/profile.txt``; the top lines are printed."""
    import cProfile
    import io
    import pstats
    perm = torch.randperm(4096, generator=torch.Generator().manual_seed(1)).tolist()
    mover = KVBlockMover(caches, num_cpu_blocks=2 * n, issue_thread=False)
    text = io.StringIO()
    for is_store in (True, False):
        def job() -> None:
            if is_store:
                mover.submit_store(next(_JOBS), perm[:n], list(range(n)))
            else:
                mover.submit_load(next(_JOBS), list(range(n)), perm[:n])
            mover.wait()
            mover.get_finished()
        for _ in range(3):
            job()
        prof = cProfile.Profile()
        for _ in range(jobs):
            torch.cuda.synchronize()
            prof.enable()
            job()
            prof.disable()
        text.write(f"--- {'store' if is_store else 'load'}: {jobs} inline jobs, tottime\n")
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(22)
    mover.shutdown()
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "profile.txt"), "w") as f:
            f.write(text.getvalue())
    for line in text.getvalue().splitlines():
        if line.startswith("---") or ("{" in line and "synchronize" not in line) or "_staged" in line:
            print(line[:150])


def main() -> int:
    p = argparse.ArgumentParser()
    add_kv_args(p)
    p.add_argument("--num-gpu-blocks", type=int, default=4096)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--ids", choices=("scattered", "runs"), default="scattered",
                   help="GPU block ids: a random permutation, or consecutive (one run per job)")
    p.add_argument("--baseline-root", default=None)
    p.add_argument("--variants", nargs="+", default=["auto"])
    p.add_argument("--kernels", action="store_true", help="also time one stage's kernels per word")
    p.add_argument("--timeline", action="store_true", help="also the GPU timeline of staged jobs")
    p.add_argument("--timeline-variants", nargs="+", default=["auto", "auto, third-stage staging"],
                   help="variants of --timeline")
    p.add_argument("--timeline-thread", action="store_true",
                   help="--timeline also with the issue thread (each variant inline and threaded)")
    p.add_argument("--profile", action="store_true", help="also a host profile of staged jobs")
    args = p.parse_args()
    device = torch.device("cuda")
    if args.kernels:
        kernel_times()
    n = args.batch
    perm = torch.randperm(args.num_gpu_blocks, generator=torch.Generator().manual_seed(1)).tolist()
    if args.ids == "runs":
        perm = list(range(args.num_gpu_blocks))
    store_gpu, load_gpu = perm[:n], perm[n:2 * n]
    store_cpu, load_cpu = list(range(n)), list(range(n, 2 * n))
    rows = []
    for layout in args.layouts:
        caches = make_kv_caches(args, device, layout)
        if args.timeline and layout != "cross-layer":
            for label in args.timeline_variants:
                for thread in (False, True) if args.timeline_thread else (False,):
                    timeline(caches, n, label, thread=thread)
        if args.profile and layout == "per-layer":
            profile(caches, n)
        movers: dict[str, KVBlockMover] = {}
        if args.baseline_root:
            movers["main"] = baseline_mover_class(args.baseline_root)(caches, num_cpu_blocks=2 * n)
        for label in args.variants:
            movers[label] = KVBlockMover(caches, num_cpu_blocks=2 * n)
            apply_variant(movers[label], label)
        contig = _contiguous_fns(n * next(iter(movers.values())).layout.block_bytes, device)
        fns: dict[tuple[str, str], Callable[[], None]] = {}
        submit_s: dict[tuple[str, str], list[float]] = {}  # the caller's host time in submit_*

        def job(m: KVBlockMover, key: tuple[str, str]) -> None:
            t0 = time.perf_counter()
            if key[1] == "store":
                m.submit_store(next(_JOBS), store_gpu, store_cpu)
            else:
                m.submit_load(next(_JOBS), load_cpu, load_gpu)
            submit_s.setdefault(key, []).append(time.perf_counter() - t0)
            m.wait()

        for name, m in movers.items():
            for d in ("store", "load"):
                fns[name, d] = functools.partial(job, m, (name, d))
        for d in ("store", "load"):
            fns["contiguous (control)", d] = (lambda f=contig[d]: f())
        extra = []
        plan = getattr(getattr(movers.get("auto"), "copier", None), "gather_plan", None)
        if plan is not None and layout != "cross-layer":
            extra.append("staged DMAs alone")
            for d, fn in _dmas_alone(movers["auto"], n).items():
                fns["staged DMAs alone", d] = fn
        names = ["contiguous (control)", *extra, *movers]
        ratios: dict[tuple[str, str], list[float]] = {k: [] for k in fns}
        secs: dict[tuple[str, str], list[float]] = {k: [] for k in fns}
        for fn in fns.values():  # warm-up
            fn()
            fn()
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for d in ("store", "load"):
                for name in order:
                    fn, base = fns[name, d], contig[d]
                    if r % 2:
                        tb, tf = _time_once(base, device), _time_once(fn, device)
                    else:
                        tf, tb = _time_once(fn, device), _time_once(base, device)
                    ratios[name, d].append(tb / tf)
                    secs[name, d].append(tf)
            for m in movers.values():
                m.get_finished()
        nbytes = n * next(iter(movers.values())).layout.block_bytes
        for name in names:
            ok = True
            if name in movers:
                finished = movers[name].get_finished()
                ok = all(x.success for x in finished) and _check(movers[name], caches, store_gpu, store_cpu)
            for d in ("store", "load"):
                med, p25, p75 = _quartiles(ratios[name, d])
                row = {"layout": layout, "variant": name, "dir": d, "x": med, "p25": p25, "p75": p75,
                       "GBs": nbytes / statistics.median(secs[name, d]) / 1e9, "ok": ok,
                       "rounds": args.rounds,
                       "submit_ms": 1e3 * statistics.median(submit_s.get((name, d), [0.0]))}
                rows.append(row)
                print(json.dumps(row), flush=True)
        for m in movers.values():
            m.shutdown()
        del caches, movers, fns, contig
        torch.cuda.empty_cache()
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "probe_roundrobin.json"), "w") as f:
            json.dump(rows, f, indent=1)
    print(f"\n{torch.cuda.get_device_name()}: {n} {args.ids} blocks per job, {args.rounds} rounds; "
          "x contig = median [p25, p75] of the per-pair ratio")
    print("| layout | variant | store x contig | load x contig | store GB/s | load GB/s | submit ms store / load | ok |")
    print("|---|---|---|---|---|---|---|---|")
    by = {(r["layout"], r["variant"], r["dir"]): r for r in rows}
    for layout in args.layouts:
        for name in dict.fromkeys(r["variant"] for r in rows if r["layout"] == layout):
            s, lo = by[layout, name, "store"], by[layout, name, "load"]
            print(f"| {layout} | {name} | {s['x']:.3f} [{s['p25']:.3f}, {s['p75']:.3f}] | "
                  f"{lo['x']:.3f} [{lo['p25']:.3f}, {lo['p75']:.3f}] | {s['GBs']:.1f} | {lo['GBs']:.1f} | "
                  f"{s['submit_ms']:.3f} / {lo['submit_ms']:.3f} | {'yes' if s['ok'] else 'NO'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
