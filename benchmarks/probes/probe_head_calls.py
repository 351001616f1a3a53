"""Probe: host time of each call a staged store makes before its first DMA, one by one.

A per-layer store loses ~0.25 ms between its start event and its first DMA (the
timeline of ``probe_roundrobin.py``), made of a dozen Python-level calls. This probe
times each of them alone in a loop on the machine at hand (median of ``--reps`` calls,
microseconds, the GPU idle or nearly), so that the head's cost can be split into
bookkeeping, runtime calls and kernel launches:

    PYTHONPATH=.:benchmarks python3 benchmarks/probes/probe_head_calls.py      # CUDA only

Writes ``probe_head_calls.json`` to ``$OUT`` when set.
"""

from __future__ import annotations

import argparse
import array
import ctypes
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

from connectors.offload.transfer import cudart as _cudart
from connectors.offload.transfer.copy_plan import cpu_runs, estimate_joint_runs
from connectors.offload.transfer.staging import group_planes


def _median_us(fn: Callable[[], object], reps: int) -> float:
    times = []
    for i in range(reps + 20):
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        if i >= 20:
            times.append(dt)
        if i % 50 == 49:
            torch.cuda.synchronize()  # keep the queues short
    return 1e6 * statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=400)
    p.add_argument("--blocks", type=int, default=256)
    args = p.parse_args()
    n, row = args.blocks, 64 << 10
    plane = torch.randint(0, 1 << 60, (4096, row // 16, 2), dtype=torch.int64, device="cuda")
    plane = plane.view(torch.complex128).view(4096, -1)
    staging = torch.empty((n, plane.shape[1]), dtype=plane.dtype, device="cuda")
    perm = torch.randperm(4096, generator=torch.Generator().manual_seed(1))[:n]
    g_ids, c_ids = array.array("q", perm.tolist()), array.array("q", range(n))
    host = torch.empty(n, dtype=torch.int64, pin_memory=True)
    dev_ids = torch.empty(n, dtype=torch.int64, device="cuda")
    pinned = torch.empty(n * row, dtype=torch.uint8, pin_memory=True)
    memcpy = _cudart.memcpy_async()
    stream = torch.cuda.Stream()
    other = torch.cuda.Stream()
    event, timing = torch.cuda.Event(), torch.cuda.Event(enable_timing=True)
    event.record(other)
    dev_ids.copy_(perm.cuda())
    idx = torch.cuda.current_device()

    def side() -> None:
        with torch.cuda.stream(stream):
            torch.index_select(plane, 0, dev_ids, out=staging)

    calls: dict[str, Callable[[], object]] = {
        "min+max of the GPU ids (array, Python)": lambda: (min(g_ids), max(g_ids)),
        "estimate_joint_runs": lambda: estimate_joint_runs(g_ids, c_ids),
        "cpu_runs (one run)": lambda: cpu_runs(c_ids),
        "group_planes": lambda: group_planes(32, n * row * 32, taper=True),
        "torch.frombuffer (ids as a tensor)": lambda: torch.frombuffer(g_ids, dtype=torch.int64),
        "torch.cuda.current_stream(i)": lambda: torch.cuda.current_stream(idx),
        "torch.cuda.set_stream": lambda: torch.cuda.set_stream(torch.cuda.current_stream(idx)),
        "Event.record(stream)": lambda: event.record(stream),
        "timing Event.record(stream)": lambda: timing.record(stream),
        "Stream.wait_event": lambda: stream.wait_event(event),
        "Stream.cuda_stream": lambda: stream.cuda_stream,
        "tensor.data_ptr()": lambda: host.data_ptr(),
        "ctypes memmove 2 KiB": lambda: ctypes.memmove(host.data_ptr(), g_ids.buffer_info()[0], 8 * n),
        "cudaMemcpyAsync 2 KiB H2D (ctypes)": lambda: memcpy(dev_ids.data_ptr(), host.data_ptr(), 8 * n, stream.cuda_stream),
        "cudaMemcpyAsync 16 MiB D2H (ctypes)": lambda: memcpy(pinned.data_ptr(), staging.data_ptr(), n * row, stream.cuda_stream),
        "index_select(out=) 16 MiB": lambda: torch.index_select(plane, 0, dev_ids, out=staging),
        "index_select(out=) under torch.cuda.stream(s)": side,
    }
    rows = []
    for name, fn in calls.items():
        us = _median_us(fn, args.reps)
        rows.append({"call": name, "us": us})
        print(json.dumps(rows[-1]), flush=True)
    torch.cuda.synchronize()
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "probe_head_calls.json"), "w") as f:
            json.dump(rows, f, indent=1)
    print(f"\n{torch.cuda.get_device_name()}: host time per call, median of {args.reps}, {n} blocks")
    print("| call | us |\n|---|---|")
    for r in rows:
        print(f"| {r['call']} | {r['us']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
