"""Fault sweep inside vLLM 0.33: seeded rig runs under faults, every damage column at 0.

Each run builds a :class:`~kvconnector_core.testing.vllm.VllmRig` (vLLM's own scheduler and
worker-side connector code on CPU, a stub model writing a pattern per block hash) with one
connector wrapped in the kit's ``FaultInjector`` through its kv-transfer config, runs a
seeded prefix-sharing workload (vLLM's prefix cache is reset and every KV byte zeroed
half-way, so the second half's hits come from the connector), and counts:

- ``wrong_loaded``: wrong bytes in blocks a connector load wrote;
- ``wrong_hit``: wrong bytes in blocks vLLM served as prefix-cache hits (a failed load left
  cached);
- ``wrong_computed``: wrong bytes in blocks a request computed itself (the stub model writes
  wrong KV for tokens computed while an earlier block held wrong bytes: KV computed on a
  failed or late load that vLLM kept);
- ``unfinished``: requests not finished within the step budget;
- ``escaped``: exceptions that escaped into vLLM;
- ``blocks_held``: GPU blocks still held after idle, a prefix-cache reset and shutdown;
- ``requests_held``: requests vLLM still held once idle.

Connectors: the disk example (synchronous loads), cpu_offload with a disk tier
(asynchronous), the TTL example, a kvconnector MultiConnector of the disk example and
cpu_offload. Faults: one hook raising once at a random step (``raise_once``), one hook
raising at 1% and 10% of its calls (the hook cycles with the seed over every hook of both
roles), loads failing and reported by block (``load_errors``), completions up to 3 steps
late (``late``). vLLM settings drawn per run from the seed: sync or async scheduling,
``recompute`` or ``fail``, 1 or 2 workers (the disk example refuses 2), full attention or
a hybrid full + sliding-window model (cpu_offload behind ``KVConnectorAdapterHMA``), and
one of the six KV cache layouts (BLHNC, the cross-layer layout, for the disk example).

    python benchmarks/vllm_fault_sweep.py --seeds 0:50            # 50 x 4 x 5 = 1,000 runs
    python benchmarks/vllm_fault_sweep.py --seeds 7:8 --connectors disk --faults raise_once -v
    python benchmarks/vllm_fault_sweep.py --log /tmp/s.jsonl; ... --summarize /tmp/s.jsonl

Run it with vLLM 0.33's Python (``make vllm-venv``), ``VLLM_TARGET_DEVICE=cpu``. Prints a
progress line per seed on stderr, then a Markdown table; exits 1 when any run did damage.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import logging
import random
import shutil
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

import msgspec

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "examples" / "disk_connector")]
warnings.filterwarnings("ignore")

from kvconnector_core.testing.fault_settings import FAULT_HOOKS, FaultSettings, HookFault  # noqa: E402
from kvconnector_core.testing.vllm import (  # noqa: E402
    LAYOUTS,
    RigReport,
    VllmRig,
    adapter_config,
    connector,
    multi,
    prompt,
    with_faults,
)

__all__ = ["COLUMNS", "CONNECTORS", "FAULTS", "SweepRun", "cache_distributions", "run_one",
           "summarize", "sweep"]

CONNECTORS = ("disk", "offload_disk", "ttl", "multi")
FAULTS = ("raise_once", "hook_1pct", "hook_10pct", "load_errors", "late")
COLUMNS = ("wrong_loaded", "wrong_hit", "wrong_computed", "unfinished", "escaped", "blocks_held",
           "requests_held")
# Set-up hooks fail the engine's construction on purpose (the guard does not contain them).
# ``shutdown`` is not contained either: the failure contract reports it to the caller.
HOOKS = tuple(sorted(FAULT_HOOKS - {"register_kv_caches", "bind_gpu_block_pool", "shutdown"}))
STEP_BUDGET = 3000
_ONCE_MAX_STEP = 40


class SweepRun(msgspec.Struct):
    """One seeded run: its cell, vLLM settings, damage counts and the rig's report."""

    seed: int
    connector: str
    fault: str
    settings: str
    counts: dict[str, int]
    hit_tokens: int
    layer_blocks_checked: int
    detail: str = ""

    @property
    def failed(self) -> list[str]:
        """The damage columns this run is not 0 in."""
        return [c for c in COLUMNS if self.counts.get(c)]


def _faults(fault: str, seed: int, rng: random.Random) -> FaultSettings:
    hook = HOOKS[seed % len(HOOKS)]
    fault_seed = rng.randrange(2**31)
    if fault == "raise_once":
        once = HookFault(hook=HOOKS[rng.randrange(len(HOOKS))],
                         at_step=rng.randrange(_ONCE_MAX_STEP))
        return FaultSettings(raise_in=(once,), seed=fault_seed)
    if fault in ("hook_1pct", "hook_10pct"):
        rate = 0.01 if fault == "hook_1pct" else 0.1
        return FaultSettings(raise_in=(HookFault(hook=hook, rate=rate),), seed=fault_seed)
    if fault == "load_errors":
        return FaultSettings(load_failure_rate=0.25, seed=fault_seed)
    if fault == "late":
        return FaultSettings(completion_delay_steps=3, seed=fault_seed)
    msg = f"unknown fault {fault!r}; valid: {', '.join(FAULTS)}"
    raise ValueError(msg)


def _connector(name: str, tmp: Path, rng: random.Random) -> dict[str, Any]:
    disk = connector("DiskConnector", {"path": str(tmp / "disk")})
    disk["kvconnector"]["module_path"] = "disk_connector.connector"
    offload = connector("cpu_offload", {"num_cpu_blocks": rng.randrange(16, 48),
                                        "tiers": [{"type": "disk", "path": str(tmp / "tier"),
                                                   "capacity_bytes": 1 << 26}]})
    ttl = connector("ttl", {"ttl_seconds": 1000, "max_pinned_blocks": 6})
    return {"disk": disk, "offload_disk": offload, "ttl": ttl, "multi": multi(disk, offload)}[name]


def _rig(name: str, fault: str, seed: int, tmp: Path) -> tuple[VllmRig, str]:
    rng = random.Random(f"{seed}:{name}:{fault}")
    hybrid = name == "offload_disk" and rng.random() < 0.5
    workers = 1 if name in ("disk", "multi") else rng.choice((1, 2))
    async_sched = rng.random() < 0.5
    policy = rng.choice(("recompute", "fail"))
    # the disk example needs the cross-layer layout (a block is one contiguous chunk)
    layout = ("BLHNC" if name in ("disk", "multi") else "LBHNC" if hybrid
              else rng.choice(LAYOUTS))
    config = with_faults(adapter_config(_connector(name, tmp, rng), hma=hybrid, policy=policy),
                         _faults(fault, seed, rng))
    settings = (f"{'async' if async_sched else 'sync'}-sched {policy} {workers}w "
                f"{'hybrid' if hybrid else 'full'} {layout}")
    rig = VllmRig.from_kv_transfer_config(
        config, layout=layout, num_workers=workers, async_scheduling=async_sched,
        num_gpu_blocks=rng.randrange(18, 28), num_layers=2, max_num_seqs=rng.choice((2, 4)),
        max_num_batched_tokens=rng.choice((32, 64)), raise_on_wrong=False,
        sliding_window=24 if hybrid else None, hma=True if hybrid else None)
    return rig, settings


def _workload(rig: VllmRig, seed: int) -> None:
    """Requests on three shared prefixes; half-way, vLLM's prefix cache is reset and every
    KV byte zeroed, so the second half's prefix hits must come from the connector."""
    rng = random.Random(f"{seed}:workload")
    prefixes = [prompt(seed * 10 + i, 16 * rng.randrange(2, 5)) for i in range(3)]
    for i in range(8):
        rig.add(rng.choice(prefixes) + prompt(seed * 100 + i, rng.randrange(1, 24)),
                max_tokens=rng.randrange(1, 12))
        for _ in range(rng.randrange(0, 3)):
            rig.step()
        if i == 3:
            rig.run(STEP_BUDGET)
            if rig.scheduler.reset_prefix_cache():
                rig.wipe()


def run_one(name: str, fault: str, seed: int) -> SweepRun:
    """One seeded run of a (connector, fault) cell."""
    tmp = Path(tempfile.mkdtemp(prefix="kvc-vllm-sweep-"))
    try:
        rig, settings = _rig(name, fault, seed, tmp)
        try:
            _workload(rig, seed)
            report = rig.check(STEP_BUDGET)
        except Exception as exc:  # noqa: BLE001 - an exception escaping into vLLM is a finding
            report = RigReport(connector=name, layout=rig.layout,
                               exceptions=[f"{type(exc).__name__}: {exc}"[:300]])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    counts = {"wrong_loaded": report.wrong_bytes_loaded, "wrong_hit": report.wrong_bytes_hit,
              "wrong_computed": report.wrong_bytes_other, "unfinished": report.unfinished,
              "escaped": len(report.exceptions), "blocks_held": report.leaked_blocks,
              "requests_held": report.held_requests}
    detail = "; ".join(filter(None, [report.first_bad_block, *report.exceptions]))
    return SweepRun(seed, name, fault, settings, counts, report.hit_tokens,
                    report.layer_blocks_checked, detail)


def sweep(seeds: range, connectors: tuple[str, ...], faults: tuple[str, ...],
          verbose: bool = False, log: Path | None = None) -> list[SweepRun]:
    """Every cell for every seed, with a progress line per seed on stderr; each run is
    appended to ``log`` (JSON lines) as it ends, so a sweep cut short can be summarized."""
    runs: list[SweepRun] = []
    t0 = time.perf_counter()
    for i, seed in enumerate(seeds):
        for name in connectors:
            for fault in faults:
                run = run_one(name, fault, seed)
                runs.append(run)
                if log is not None:
                    with log.open("ab") as f:
                        f.write(msgspec.json.encode(run) + b"\n")
                if verbose or run.failed:
                    print(f"seed {seed} {name}/{fault} [{run.settings}]: {run.counts} "
                          f"{run.detail}", file=sys.stderr, flush=True)
        bad = sum(1 for r in runs if r.failed)
        print(f"seed {seed} done ({i + 1}/{len(seeds)}): {len(runs)} runs, {bad} with damage, "
              f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return runs


def summarize(runs: list[SweepRun]) -> str:
    """The Markdown table: per cell, runs, hits, layer-blocks checked, runs with each damage."""
    cells: dict[tuple[str, str], list[SweepRun]] = defaultdict(list)
    for r in runs:
        cells[(r.connector, r.fault)].append(r)
    head = ["connector", "fault", "runs", "hit tokens", "layer-blocks checked", *COLUMNS,
            "first failing run"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    total: dict[str, int] = defaultdict(int)
    for (name, fault), rs in cells.items():
        per = {c: sum(1 for r in rs if r.counts.get(c)) for c in COLUMNS}
        failing = [r for r in rs if r.failed]
        first = f"seed {failing[0].seed} ({', '.join(failing[0].failed)})" if failing else "-"
        hits = sum(r.hit_tokens for r in rs)
        checked = sum(r.layer_blocks_checked for r in rs)
        lines.append(f"| {name} | {fault} | {len(rs)} | {hits:,} | {checked:,} | "
                     + " | ".join(str(v) for v in per.values()) + f" | {first} |")
        for key, value in (("runs", len(rs)), ("hits", hits), ("checked", checked), *per.items()):
            total[key] += value
    lines.append(f"| **total** | | {total['runs']:,} | {total['hits']:,} | {total['checked']:,} | "
                 + " | ".join(str(total[c]) for c in COLUMNS) + " | |")
    return "\n".join(lines)


def cache_distributions() -> None:
    """Answer ``importlib.metadata.packages_distributions()`` from a cache: kvconnector's
    plugin policy asks it for every connector built from a ``module_path`` (the kit's
    ``FaultInjector``, the disk example), which scans every installed distribution's file
    list and was 85% of a run's time. Nothing is installed while the sweep runs."""
    if not hasattr(importlib.metadata.packages_distributions, "cache_info"):
        importlib.metadata.packages_distributions = functools.lru_cache(maxsize=1)(
            importlib.metadata.packages_distributions)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns 1 when a run did damage."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0:50", help="START:STOP (STOP excluded); default 0:50")
    parser.add_argument("--connectors", nargs="+", choices=CONNECTORS, default=list(CONNECTORS))
    parser.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS))
    parser.add_argument("-v", "--verbose", action="store_true", help="print every run")
    parser.add_argument("--log", type=Path, help="append every run to this JSON-lines file")
    parser.add_argument("--summarize", type=Path, metavar="LOG",
                        help="print the table of a --log file (of a sweep cut short) and exit")
    args = parser.parse_args(argv)
    if args.summarize:
        logged = [msgspec.json.decode(line, type=SweepRun)
                  for line in args.summarize.read_bytes().splitlines() if line.strip()]
        print(summarize(logged))
        return 1 if any(r.failed for r in logged) else 0
    start, _, stop = args.seeds.partition(":")
    seeds = range(int(start), int(stop) if stop else int(start) + 1)
    import torch

    torch.set_num_threads(1)
    cache_distributions()
    logging.disable(logging.CRITICAL)  # the guard logs every contained fault
    t0 = time.perf_counter()
    runs = sweep(seeds, tuple(args.connectors), tuple(args.faults), args.verbose, args.log)
    print(summarize(runs))
    print(f"{len(runs)} runs, seeds {seeds.start}-{seeds.stop - 1}, "
          f"{time.perf_counter() - t0:.0f} s")
    return 1 if any(r.failed for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
