"""Probe: where the host time from a store's submission to its first DMA goes.

A transfer of ~10 ms pays in full the host time before its first copy is queued (the
contiguous copy it is compared with queues its one copy at once). This probe submits
store jobs of 256 scattered 2 MiB blocks and records, from the submission, when each
step of the issue path is first reached (entry of the issue function, end of the run
scan, the index upload, the first gather kernel, the first DMA call, the end of the
issue), median over ``--jobs`` jobs, for each layout, issued on the issue thread (the
default) and inline.

    PYTHONPATH=.:benchmarks python3 benchmarks/probes/probe_issue_path.py      # CUDA only
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from _transfer_variants import FirstCopyClock, add_kv_args, make_kv_caches

from connectors.offload.transfer import KVBlockMover
from connectors.offload.transfer import copy_method as _cuda_copy
from connectors.offload.transfer import staging as _staged

_MARKS: list[tuple[str, float]] = []


def _mark(label: str, fn: Callable[..., Any], *, after: bool = False) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        if not after:
            _MARKS.append((label, time.perf_counter()))
        out = fn(*args, **kwargs)
        if after:
            _MARKS.append((label, time.perf_counter()))
        return out
    return timed


def _instrument(mover: KVBlockMover) -> None:
    mover._issue = _mark("issue entered", mover._issue)  # type: ignore[method-assign]
    mover.copier.plan.single_plane_descriptors = _mark(  # type: ignore[method-assign]
        "descriptors built", mover.copier.plan.single_plane_descriptors, after=True)


def main() -> int:
    p = argparse.ArgumentParser()
    add_kv_args(p)
    p.add_argument("--num-gpu-blocks", type=int, default=4096)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--jobs", type=int, default=15)
    args = p.parse_args()
    device = torch.device(args.device)
    on_cuda = device.type == "cuda"
    # Module-level steps, wrapped once for every mover.
    _cuda_copy.scan_runs = _mark("run scan done", _cuda_copy.scan_runs, after=True)
    _staged.StagingBuffers.upload_index = _mark(  # type: ignore[method-assign]
        "index uploaded", _staged.StagingBuffers.upload_index, after=True)
    _staged._move = _mark("first gather launched", _staged._move, after=True)
    n = args.batch
    perm = torch.randperm(args.num_gpu_blocks, generator=torch.Generator().manual_seed(1)).tolist()
    gpu, cpu = perm[:n], list(range(n))
    order = ["submit returned", "issue entered", "run scan done", "descriptors built",
             "index uploaded", "first gather launched", "first DMA call", "wait returned"]
    print(f"{torch.cuda.get_device_name() if on_cuda else 'cpu'}: ms from a store's submission ({n} scattered blocks), "
          f"median of {args.jobs}")
    print("| layout | issued | " + " | ".join(order) + " |")
    print("|---|---|" + "---|" * len(order))
    for layout in args.layouts:
        caches = make_kv_caches(args, device, layout)
        for thread in (True, False):
            mover = KVBlockMover(caches, num_cpu_blocks=n, issue_thread=thread)
            _instrument(mover)
            clock = FirstCopyClock(mover)  # on CPU: no runtime copies, no column
            samples: dict[str, list[float]] = {k: [] for k in order}
            for job in range(args.jobs + 3):
                if on_cuda:
                    torch.cuda.synchronize()
                _MARKS.clear()
                t0 = time.perf_counter()
                mover.submit_store(job, gpu, cpu)
                t_sub = time.perf_counter()
                mover.wait()
                t_end = time.perf_counter()
                if job < 3:
                    continue  # warm-up
                first: dict[str, float] = {"submit returned": t_sub - t0, "wait returned": t_end - t0}
                for label, t in _MARKS:
                    first.setdefault(label, t - t0)
                dma = clock.first_after(t0)
                if dma is not None:
                    first["first DMA call"] = dma
                for k in order:
                    if k in first:
                        samples[k].append(first[k] * 1e3)
            assert all(r.success for r in mover.get_finished())
            cells = [f"{statistics.median(v):.3f}" if v else "-" for v in samples.values()]
            print(f"| {layout} | {'issue thread' if thread else 'inline'} | " + " | ".join(cells) + " |",
                  flush=True)
            clock.close()
            mover.shutdown()
        del caches
        if on_cuda:
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
