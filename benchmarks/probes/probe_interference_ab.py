"""Probe: which of the mover's issue-path changes moves a model step's slowdown.

bench_interference.py measured this branch's default 1-1.5 points slower than main's in
one run (same harness, same H100). This probe switches the changes off one at a time on
the same mover, measured round robin in one process (3 trials, pairs of steps alternating
with the step alone), for the cross-layer and per-layer layouts:

* ``branch``: as committed;
* ``no steal``: a waiting caller waits for the issue thread instead of issuing a job;
* ``one lane``: batched jobs on one stream per direction;
* ``tensor descriptors``: one-plane descriptors built with tensor operations;
* ``all three off``;
* ``per-job buffers``: staged copies allocate their buffers and events per job;
* ``delay <ms> ms``: the issue thread sleeps that long when woken from idle;
* ``main-like <option>``: the branch with a ``_transfer_variants`` option (e.g. ``16 MiB
  stages``);
* ``method <variant>``: the branch running another ``_transfer_variants`` label (e.g.
  ``method batched``);
* ``baseline``: with ``--baseline-root``, the mover of another checkout (main), measured in
  the same round robin.

    PYTHONPATH=.:benchmarks python3 benchmarks/probes/probe_interference_ab.py      # CUDA only
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from _transfer_variants import add_kv_args, apply_variant, baseline_mover_class, make_kv_caches
from bench_interference import _compute_fn, _measure, _row, _Timer

from connectors.offload.transfer import KVBlockMover


def _patch(mover: KVBlockMover, name: str) -> None:
    if name.startswith("delay "):  # "delay 0.3 ms": the issue thread's start delay
        mover._issuer.delay = float(name.split()[1]) / 1e3
        return
    if name.startswith("method "):  # "method batched": another transfer variant on this mover
        apply_variant(mover, name.removeprefix("method "))
        return
    if name.startswith("main-like "):  # this branch with one of main's settings back
        apply_variant(mover, "auto, " + name.removeprefix("main-like "))
        return
    if name == "per-job buffers":
        apply_variant(mover, "auto, per-job buffers")
        return
    off = {"no steal", "one lane", "tensor descriptors"} if name == "all three off" else {name}
    if "no steal" in off:
        mover._await_issued = lambda job: job.issued.wait() if job.issued is not None else None
    if "one lane" in off:
        mover.copier.lanes = {True: [], False: []}
    if "tensor descriptors" in off:
        mover.copier.plan.single_plane_descriptors = lambda *args: None


def main() -> int:
    p = argparse.ArgumentParser()
    add_kv_args(p)
    p.add_argument("--num-gpu-blocks", type=int, default=2048)
    p.add_argument("--blocks", type=int, default=64)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--matmul-pairs", type=int, default=8)
    p.add_argument("--steps", type=int, default=90)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--variants", nargs="*",
                   default=["no steal", "one lane", "tensor descriptors", "all three off"],
                   help="besides 'branch': any of those, or 'per-job buffers'")
    p.add_argument("--baseline-root", default=None,
                   help="another checkout whose KVBlockMover runs as variant 'baseline'")
    args = p.parse_args(["--layouts", "cross-layer", "per-layer", *sys.argv[1:]])
    device = torch.device("cuda")
    compute, timer = _compute_fn(args, device), _Timer(device)
    B = args.blocks
    perm = torch.randperm(args.num_gpu_blocks, generator=torch.Generator().manual_seed(2)).tolist()
    ids = (perm[:B], list(range(B)), list(range(B, 2 * B)), perm[B:2 * B])
    names = ["branch", *args.variants]
    baseline = baseline_mover_class(args.baseline_root) if args.baseline_root else None
    if baseline is not None:
        names.insert(1, "baseline")
    rows = []
    for layout in args.layouts:
        caches = make_kv_caches(args, device, layout)
        movers = {}
        for name in names:
            if name == "baseline":
                movers[name] = baseline(caches, num_cpu_blocks=2 * B)
            else:
                movers[name] = KVBlockMover(caches, num_cpu_blocks=2 * B)
                _patch(movers[name], name)
            _measure(args, movers[name], compute, timer, device, ids, args.warmup)
        samples = {n: ([], [], []) for n in names}
        for _ in range(args.trials):
            for name in names:
                got = _measure(args, movers[name], compute, timer, device, ids, args.steps // args.trials)
                for acc, new in zip(samples[name], got, strict=True):
                    acc += new
        for name in names:
            rows.append(_row(layout, name, B, movers[name].layout.block_bytes, *samples[name]))
            print(json.dumps(rows[-1]), flush=True)
            movers[name].shutdown()
        del caches, movers
        torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name()}: {B} blocks each way, {args.steps} pairs in {args.trials} trials")
    print("| layout | variant | compute GPU slowdown | step slowdown [p25, p75] | store issue ms | load issue ms "
          "| issue-thread ms per job | ok |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layout']} | {r['method']} | {r['gpu_slowdown_pct']:+.1f}% | {r['wall_slowdown_pct']:+.1f}% "
              f"[{r['wall_slowdown_p25_pct']:+.1f}, {r['wall_slowdown_p75_pct']:+.1f}] | {r['store_issue_ms']:.3f} | "
              f"{r['load_issue_ms']:.3f} | {r['issue_thread_ms_per_job']:.3f} | {'yes' if r['ok'] else 'NO'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
