"""The probe's sizes, buffers and timing (``probe_transfer_limits.py``); allocating the
buffers on import needs CUDA."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from connectors.offload.transfer import cudart as _cudart

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


def _print_table(head: str, rows: list[dict], cells: Callable[[dict], str]) -> None:
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in rows:
        print(f"| {r['name']} | " + (f"error: {r['error'][:120]}" if "error" in r else cells(r)) + " |")
