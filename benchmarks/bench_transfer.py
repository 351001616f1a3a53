"""Benchmark: KV block transfers between device and pinned CPU memory (CPU offload tier).

Llama-3-8B-shaped blocks by default (32 layers, 8 KV heads, head size 128, bf16,
16-token blocks: 2 MiB per block across layers), moved in batches of 256 blocks through
:class:`connectors.offload.transfer.KVBlockMover`, next to a contiguous pinned copy of
the same number of bytes measured in the same run. Reports store (device -> CPU),
load (CPU -> device) and store + load at once, in GB/s (1e9 bytes/s), for:

* layouts: ``cross-layer`` (the engine's: one tensor, a block of all layers is one
  chunk), ``per-layer`` (vLLM's: one allocation per layer, 32 rows of 64 KiB per block)
  and ``per-layer, one allocation`` (per-layer tensors carved from one allocation, so
  equally spaced: what 2D copies need); ``[2D]`` marks a layout where they apply;
* variants (``_transfer_variants.py``): ``per_block``, ``coalesced``, ``gather``,
  ``batched``, ``pitched`` and ``auto`` (the default), each issued on the mover's issue
  thread, plus ``auto, inline issue`` and ``auto, Tensor.copy_`` (every runtime shortcut
  off and inline: the fallback path);
* id patterns: ``scattered`` (random device blocks -> consecutive CPU blocks, the usual
  store) and ``runs`` (consecutive on both sides, the best case for coalescing).

Every time is a median of ``--reps`` runs after a warm-up, from submission to completion
(submission cost included), timed alternately with a contiguous pinned copy of the same
bytes; "x contig" is the ratio of the two medians of that pairing. Needs only torch::

    PYTHONPATH=. python3 benchmarks/bench_transfer.py            # CUDA if present
    PYTHONPATH=. python3 benchmarks/bench_transfer.py --device cpu --num-gpu-blocks 256 --batch 64

With ``--baseline-root <checkout>`` the mover of that checkout (main) is measured too, in
the same process and with the same harness (rows ``main: <variant>``). On CUDA each row
also reports the host time from a store's submission to its first copy call (the latency
that a transfer of a few milliseconds pays in full).

Writes ``bench_transfer.json`` to ``$OUT`` (or ``--json``) when given.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
from _transfer_variants import (
    DEFAULT_VARIANTS,
    FirstCopyClock,
    add_kv_args,
    apply_variant,
    baseline_mover_class,
    make_kv_caches,
    restore,
)

from connectors.offload.transfer import KVBlockMover

__all__ = ["main"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_once(fn: Callable[[], None], device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _paired_medians(fn: Callable[[], None], baseline: Callable[[], None], device: torch.device,
                    reps: int) -> tuple[float, float]:
    """Median seconds of ``fn`` and of ``baseline``, timed alternately after a warm-up each.

    Alternating (and swapping which goes first) makes both sides see the same clocks,
    PCIe state and host noise, so their ratio is steadier than two separate medians.
    """
    fn()
    baseline()
    a, b = [], []
    for r in range(reps):
        if r % 2:
            b.append(_time_once(baseline, device))
            a.append(_time_once(fn, device))
        else:
            a.append(_time_once(fn, device))
            b.append(_time_once(baseline, device))
    return statistics.median(a), statistics.median(b)


def _contiguous_fns(nbytes: int, device: torch.device) -> dict[str, Callable[[], None]]:
    """One pinned contiguous copy of ``nbytes`` each way, and both ways at once."""
    pin = device.type == "cuda"
    dev = [torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device) for _ in range(2)]
    host = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
    fns = {"store": lambda: host[0].copy_(dev[0], non_blocking=True),
           "load": lambda: dev[1].copy_(host[1], non_blocking=True)}
    if device.type == "cuda":
        s1, s2 = torch.cuda.Stream(device), torch.cuda.Stream(device)

        def both() -> None:
            s1.wait_stream(torch.cuda.current_stream(device))
            s2.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(s1):
                host[0].copy_(dev[0], non_blocking=True)
            with torch.cuda.stream(s2):
                dev[1].copy_(host[1], non_blocking=True)
            torch.cuda.current_stream(device).wait_stream(s1)
            torch.cuda.current_stream(device).wait_stream(s2)

        fns["both"] = both
    else:
        def both_cpu() -> None:
            host[0].copy_(dev[0])
            dev[1].copy_(host[1])

        fns["both"] = both_cpu
    return fns


def _bench_layout(args: argparse.Namespace, device: torch.device, layout: str,
                  rows: list[dict]) -> None:
    caches = make_kv_caches(args, device, layout)
    n = args.batch
    movers: list[tuple[str, type, list[str]]] = [("", KVBlockMover, args.methods)]
    if args.baseline_root:
        movers.append(("main: ", baseline_mover_class(args.baseline_root), args.baseline_methods))
    gen = torch.Generator().manual_seed(1)
    perm = torch.randperm(args.num_gpu_blocks, generator=gen).tolist()
    patterns = {
        "scattered": (perm[:n], perm[n:2 * n]),
        "runs": (list(range(n)), list(range(n, 2 * n))),
    }
    contig: dict[str, Callable[[], None]] | None = None
    for prefix, mover_class, labels in movers:
        mover = mover_class(caches, num_cpu_blocks=2 * n)
        if contig is None:
            contig = _contiguous_fns(n * mover.layout.block_bytes, device)
        for label in labels:
            apply_variant(mover, label)
            for pattern, ids in patterns.items():
                row = _bench_variant(args, device, mover, contig, ids)
                row.update(layout=layout, method=prefix + label, pattern=pattern,
                           pitched_layout=mover.copier.plan.pitch is not None)
                row["ok"] = row["ok"] and _check(mover, caches, ids[0], list(range(n)))
                rows.append(row)
                print(json.dumps(row), flush=True)
        restore(mover)
        mover.shutdown()
        del mover


_JOBS = iter(range(1 << 30))


def _bench_variant(args: argparse.Namespace, device: torch.device, mover: KVBlockMover,
                   contig: dict[str, Callable[[], None]], ids: tuple[list[int], list[int]]) -> dict:
    n = args.batch
    nbytes = n * mover.layout.block_bytes
    store_gpu, load_gpu = ids
    store_cpu, load_cpu = list(range(n)), list(range(n, 2 * n))

    def store() -> None:
        mover.submit_store(next(_JOBS), store_gpu, store_cpu)
        mover.wait()

    def load() -> None:
        mover.submit_load(next(_JOBS), load_cpu, load_gpu)
        mover.wait()

    def both() -> None:
        mover.submit_store(next(_JOBS), store_gpu, store_cpu)
        mover.submit_load(next(_JOBS), load_cpu, load_gpu)
        mover.wait()

    row: dict = {}
    # Host time to *issue* one store job on the caller's thread (the engine pays it before
    # its forward), on the issue thread where there is one, and from the submission to the
    # first DMA queued (the latency the transfer pays in full).
    submit_s, first_s = [], []
    mover.get_finished()
    clock = FirstCopyClock(mover) if device.type == "cuda" else None
    for _ in range(args.reps):
        _sync(device)
        t0 = time.perf_counter()
        mover.submit_store(next(_JOBS), store_gpu, store_cpu)
        submit_s.append(time.perf_counter() - t0)
        mover.wait()
        first = clock.first_after(t0) if clock is not None else None
        if first is not None:
            first_s.append(first)
    if clock is not None:
        clock.close()
    row["submit_ms"] = statistics.median(submit_s) * 1e3
    row["first_dma_ms"] = statistics.median(first_s) * 1e3 if first_s else float("nan")
    row["worker_issue_ms"] = statistics.median(
        r.issue_seconds or 0.0 for r in mover.get_finished()) * 1e3
    for name, fn, moved in (("store", store, nbytes), ("load", load, nbytes),
                            ("both", both, 2 * nbytes)):
        t_fn, t_base = _paired_medians(fn, contig[name], device, args.reps)
        row[name] = moved / t_fn / 1e9
        row[f"contig_{name}"] = moved / t_base / 1e9
    row["ok"] = all(r.success for r in mover.get_finished())
    return row


def _check(mover: KVBlockMover, caches: dict[str, torch.Tensor], gpu: list[int],
           cpu: list[int]) -> bool:
    """Byte-exact check of a few stored blocks against the device cache."""
    mover.submit_store(-1, gpu, cpu)
    mover.wait()
    if not all(r.success for r in mover.get_finished()):
        return False
    for i in (0, len(gpu) // 2, len(gpu) - 1):
        for dev_plane, cpu_plane in zip(mover.layout.planes, mover.cpu_planes, strict=True):
            if not torch.equal(dev_plane[gpu[i]].cpu(), cpu_plane[cpu[i]]):
                return False
    return True


def _table(rows: list[dict]) -> str:
    head = ("| layout | method | ids | store GB/s | x contig | load GB/s | x contig "
            "| store+load GB/s | x one-way contig | store issue ms (caller) "
            "| store issue ms (issue thread) | submit to first DMA ms | ok |")
    lines = [head, "|" + "---|" * 13]
    med = statistics.median
    c = {k: med(r[f"contig_{k}"] for r in rows) for k in ("store", "load", "both")}
    lines.append(f"| contiguous pinned copy (median of all pairings) | - | - | {c['store']:.1f} | 1.00 | "
                 f"{c['load']:.1f} | 1.00 | {c['both']:.1f} | "
                 f"{c['both'] / max(c['store'], c['load']):.2f} | - | - | - | - |")
    for r in rows:
        method = r["method"] + (" (default)" if r["method"] == "auto" else "")
        layout = r["layout"] + (" [2D]" if r["pitched_layout"] else "")
        one_way = max(r["contig_store"], r["contig_load"])
        lines.append(
            f"| {layout} | {method} | {r['pattern']} | {r['store']:.1f} | "
            f"{r['store'] / r['contig_store']:.2f} | {r['load']:.1f} | "
            f"{r['load'] / r['contig_load']:.2f} | {r['both']:.1f} | {r['both'] / one_way:.2f} | "
            f"{r['submit_ms']:.3f} | {r['worker_issue_ms']:.3f} | {r.get('first_dma_ms', float('nan')):.3f} | "
            f"{'yes' if r['ok'] else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print JSON rows, then a markdown table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_kv_args(p)
    p.add_argument("--num-gpu-blocks", type=int, default=None,
                   help="device blocks per cache (default 4096 on CUDA, 256 on CPU)")
    p.add_argument("--batch", type=int, default=None, help="blocks per transfer (default 256; 64 on CPU)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--methods", nargs="+", default=DEFAULT_VARIANTS,
                   help="transfer variants (see _transfer_variants.py)")
    p.add_argument("--baseline-root", default=None,
                   help="another checkout (main) whose mover is measured in the same run")
    p.add_argument("--baseline-methods", nargs="+", default=["auto"],
                   help="variants measured with the baseline mover")
    p.add_argument("--json", default=None, help="write results here (default $OUT/bench_transfer.json)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    on_cuda = device.type == "cuda"
    args.num_gpu_blocks = args.num_gpu_blocks or (4096 if on_cuda else 256)
    args.batch = args.batch or (256 if on_cuda else 64)
    block_bytes = args.layers * 2 * args.block_size * args.kv_heads * args.head_size * 2
    info = {
        "device": torch.cuda.get_device_name(device) if on_cuda else "cpu",
        "torch": torch.__version__, "block_MiB": block_bytes / 2**20, "batch": args.batch,
        "batch_MiB": args.batch * block_bytes / 2**20, "reps": args.reps,
    }
    print(json.dumps(info), flush=True)
    rows: list[dict] = []
    for layout in args.layouts:
        _bench_layout(args, device, layout, rows)
        if on_cuda:
            torch.cuda.empty_cache()
    table = _table(rows)
    out_path = args.json or (os.path.join(os.environ["OUT"], "bench_transfer.json")
                             if os.environ.get("OUT") else None)
    if out_path:
        with open(out_path, "w") as f:
            json.dump({"info": info, "rows": rows, "table": table}, f, indent=1)
    print(f"\n{info['device']}, torch {info['torch']}, {info['batch']} blocks of "
          f"{info['block_MiB']:.2f} MiB per transfer, median of {args.reps}")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
