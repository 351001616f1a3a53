"""Benchmark: how much a model step slows while KV blocks move in the same step.

Measured the way an engine runs a step, on one thread: submit a store of B scattered
device blocks and a load of B blocks into scattered device ids (Llama-3-8B-shaped
blocks, 2 MiB across 32 layers), run the compute (bf16 MLP matmuls at 2048 tokens, about
5 ms on an H100/H200) on the default stream, then wait for the compute and both jobs.
The same step without transfers is the baseline; the two alternate step by step so that
clock and thermal drift hit both sides alike. Reported per (layout, method):

* ``compute GPU ms``: CUDA events around the compute kernels (does DMA or a copy kernel
  slow the kernels themselves?);
* ``step wall ms`` and its slowdown against the baseline measured in the same loop: the
  median over pairs of neighbouring steps (which side runs first alternates), with the
  quartiles of those pairs as the spread;
* ``store / load issue ms``: caller's host time to submit each job (the engine pays it
  before the forward), and the host time the issue thread spent on a job, if one is used.

Both sides do the same compute; the transfer side must also finish both jobs
successfully and move exactly ``2 * B`` blocks per step, or the row is marked failed.

    PYTHONPATH=. python3 benchmarks/bench_interference.py            # CUDA
    PYTHONPATH=. python3 benchmarks/bench_interference.py --device cpu --tokens 64 \\
        --num-gpu-blocks 64 --blocks 8 --steps 3                     # smoke run on CPU

Writes ``bench_interference.json`` to ``$OUT`` (or ``--json``) when given.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
from _transfer_variants import add_kv_args, apply_variant, make_kv_caches, restore

from connectors.offload.transfer import KVBlockMover

__all__ = ["main", "run_rows"]


def _compute_fn(args: argparse.Namespace, device: torch.device) -> Callable[[], None]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(args.tokens, args.hidden, dtype=dtype, device=device, generator=gen)
    w1 = torch.randn(args.hidden, args.ffn, dtype=dtype, device=device, generator=gen) * 0.01
    w2 = torch.randn(args.ffn, args.hidden, dtype=dtype, device=device, generator=gen) * 0.01

    def compute() -> None:
        for _ in range(args.matmul_pairs):
            (x @ w1) @ w2

    return compute


class _Timer:
    """Compute GPU time (CUDA events) or, on CPU, its wall time."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def run(self, compute: Callable[[], None]) -> Callable[[], float]:
        if not self.cuda:
            t0 = time.perf_counter()
            compute()
            elapsed = (time.perf_counter() - t0) * 1e3
            return lambda: elapsed
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        compute()
        b.record()
        return lambda: a.elapsed_time(b)


def _step(compute: Callable[[], None], timer: _Timer, device: torch.device,
          submit: Callable[[], tuple[float, float]] | None) -> tuple[float, float, float, float]:
    """One step: (compute ms, wall ms, store issue ms, load issue ms)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    store_ms, load_ms = submit() if submit is not None else (0.0, 0.0)
    gpu_ms = timer.run(compute)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall_ms = (time.perf_counter() - t0) * 1e3
    return gpu_ms(), wall_ms, store_ms, load_ms


def _measure(args: argparse.Namespace, mover: KVBlockMover, compute: Callable[[], None],
             timer: _Timer, device: torch.device, ids: tuple[list[int], ...], steps: int
             ) -> tuple[list, list, list]:
    """``steps`` pairs of (step alone, step with a store and a load): samples and results."""
    store_gpu, store_cpu, load_cpu, load_gpu = ids
    jobs = iter(range(1 << 30))

    def submit() -> tuple[float, float]:
        t0 = time.perf_counter()
        mover.submit_store(next(jobs), store_gpu, store_cpu)
        t1 = time.perf_counter()
        mover.submit_load(next(jobs), load_cpu, load_gpu)
        t2 = time.perf_counter()
        return (t1 - t0) * 1e3, (t2 - t1) * 1e3

    base_s, xfer_s, finished = [], [], []
    for i in range(steps):
        # Swap which side goes first every step: neither always follows the other.
        if i % 2:
            xfer = _step(compute, timer, device, submit)
            base = _step(compute, timer, device, None)
        else:
            base = _step(compute, timer, device, None)
            xfer = _step(compute, timer, device, submit)
        mover.wait()  # already done: the step synchronised the whole device
        finished += mover.get_finished()
        base_s.append(base)
        xfer_s.append(xfer)
    return base_s, xfer_s, finished


def run_rows(args: argparse.Namespace, device: torch.device) -> list[dict]:
    """Every (layout, method) row, each against the baseline steps measured beside it.

    With ``--trials T`` every method of a layout is measured T times in turn (round
    robin), so that slow drift over the run (seen: the same method 1.5 points apart in two
    rows of one run) spreads over all methods instead of landing on one.
    """
    compute, timer = _compute_fn(args, device), _Timer(device)
    rows: list[dict] = []
    B = args.blocks
    perm = torch.randperm(args.num_gpu_blocks, generator=torch.Generator().manual_seed(2)).tolist()
    ids = (perm[:B], list(range(B)), list(range(B, 2 * B)), perm[B:2 * B])
    per_trial = max(1, args.steps // args.trials)
    for layout in args.layouts:
        caches = make_kv_caches(args, device, layout)
        mover = KVBlockMover(caches, num_cpu_blocks=2 * B)
        samples: dict[str, tuple[list, list, list]] = {m: ([], [], []) for m in args.methods}
        for label in args.methods:  # warm-up: every variant once before any timed step
            apply_variant(mover, label)
            _measure(args, mover, compute, timer, device, ids, args.warmup)
        for _ in range(args.trials):
            for label in args.methods:
                apply_variant(mover, label)
                for acc, new in zip(samples[label], _measure(args, mover, compute, timer, device,
                                                             ids, per_trial), strict=True):
                    acc += new
        for label in args.methods:
            base_s, xfer_s, finished = samples[label]
            rows.append(_row(layout + (" [2D]" if mover.copier.plan.pitch is not None else ""), label,
                             B, mover.layout.block_bytes, base_s, xfer_s, finished))
            print(json.dumps(rows[-1]), flush=True)
        restore(mover)
        mover.shutdown()
        del caches, mover
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _row(layout: str, label: str, B: int, block_bytes: int, base_s: list, xfer_s: list,
         finished: list) -> dict:
    med = statistics.median
    g0, w0 = med(s[0] for s in base_s), med(s[1] for s in base_s)
    g1, w1 = med(s[0] for s in xfer_s), med(s[1] for s in xfer_s)
    ok = (len(finished) == 2 * len(xfer_s) and all(r.success for r in finished)
          and all(r.num_bytes == B * block_bytes for r in finished))
    # Slowdown per pair of neighbouring steps, then its median and quartiles: drift over
    # the run (clocks, host noise) cancels within a pair.
    pairs = sorted(x[1] / b[1] for b, x in zip(base_s, xfer_s, strict=True))
    return {
        "layout": layout, "method": label, "blocks_each_way": B, "pairs": len(pairs),
        "base_gpu_ms": g0, "gpu_ms": g1, "gpu_slowdown_pct": (g1 / g0 - 1) * 100,
        "base_wall_ms": w0, "wall_ms": w1,
        "wall_slowdown_pct": (med(pairs) - 1) * 100,
        "wall_slowdown_p25_pct": (pairs[len(pairs) // 4] - 1) * 100,
        "wall_slowdown_p75_pct": (pairs[(3 * len(pairs)) // 4] - 1) * 100,
        "store_issue_ms": med(s[2] for s in xfer_s),
        "load_issue_ms": med(s[3] for s in xfer_s), "ok": ok,
        "issue_thread_ms_per_job": med(r.issue_seconds or 0.0 for r in finished) * 1e3,
        "MiB_each_way": B * block_bytes / 2**20,
    }


def _table(rows: list[dict]) -> str:
    lines = ["| layout | method | blocks each way | compute GPU ms (base) | compute GPU ms | "
             "step wall ms (base) | step wall ms | step slowdown [p25, p75] | store issue ms | "
             "load issue ms | issue-thread ms per job | ok |", "|" + "---|" * 12]
    for r in rows:
        lines.append(
            f"| {r['layout']} | {r['method']} | {r['blocks_each_way']} | {r['base_gpu_ms']:.2f} | "
            f"{r['gpu_ms']:.2f} ({r['gpu_slowdown_pct']:+.1f}%) | {r['base_wall_ms']:.2f} | "
            f"{r['wall_ms']:.2f} | {r['wall_slowdown_pct']:+.1f}% [{r['wall_slowdown_p25_pct']:+.1f}, "
            f"{r['wall_slowdown_p75_pct']:+.1f}] | {r['store_issue_ms']:.3f} | "
            f"{r['load_issue_ms']:.3f} | {r['issue_thread_ms_per_job']:.3f} | "
            f"{'yes' if r['ok'] else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print JSON rows, then a markdown table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_kv_args(p)
    p.add_argument("--num-gpu-blocks", type=int, default=2048)
    p.add_argument("--blocks", type=int, default=64, help="blocks stored and loaded per step")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--matmul-pairs", type=int, default=8)
    p.add_argument("--steps", type=int, default=90, help="timed pairs per row, over all trials")
    p.add_argument("--trials", type=int, default=3,
                   help="measure every method this many times in turn (round robin)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--methods", nargs="+",
                   default=["auto", "pitched", "batched", "gather", "coalesced",
                            "auto, inline issue", "auto, Tensor.copy_"],
                   help="transfer variants (see _transfer_variants.py)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    rows = run_rows(args, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    table = _table(rows)
    out_path = args.json or (os.path.join(os.environ["OUT"], "bench_interference.json")
                             if os.environ.get("OUT") else None)
    if out_path:
        with open(out_path, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "args": vars(args),
                       "rows": rows, "table": table}, f, indent=1)
    print(f"\n{name}, torch {torch.__version__}: {args.blocks} blocks each way per step, "
          f"median of {args.steps} step pairs in {args.trials} round-robin trial(s) after "
          f"{args.warmup} warm-up pairs, baseline alternating")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
