"""Throughput of kvconnector's core: block pool operations and the KV cache manager.

Two benchmarks, both on deterministic inputs (``benchmarks/_drivers.py``):

- **Block pool**: operations per second, per block, on a pool of 64 Ki blocks handled in
  batches of 16 (allocate, free uncached / cached, cache full blocks, touch, cached-block
  lookup hit / miss, allocation that evicts).
- **KV cache manager**: a batch simulation of the multi-turn chat trace (1000 requests
  with shared system prompts, ~1.3 M prompt tokens): prefix-cache lookup, prefill and
  one-token decode allocations, preemption, frees. Reports requests/s, steps/s,
  allocate + free calls per second and the prefix hit rate, with KV events off and on.

Medians over ``--repeats`` runs; the garbage collector is off inside timed regions.
``benchmarks/compare_vllm.py`` runs the same workloads next to vLLM 0.33.

Usage::

    python benchmarks/bench_core.py [--repeats 5] [--trace large] [--json out.json]
                                    [--record benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _drivers as d  # noqa: E402  (path set up above)

__all__ = ["bench_block_pool", "bench_kv_cache_manager", "main", "render"]

SECTION = "## Core (bench_core.py)"


def _median_rate(samples: list[tuple[float, int]]) -> float:
    # samples: (units, ns) pairs -> median units per second
    return statistics.median(u / (ns / 1e9) for u, ns in samples if ns > 0)


def bench_block_pool(num_blocks: int = 65537, batch: int = 16, repeats: int = 5) -> list[dict[str, Any]]:
    """Block pool primitives, per block (see :func:`_drivers.run_block_pool`).

    Args:
        num_blocks: pool size, null block included (``num_blocks - 1`` divisible by ``batch``).
        batch: blocks per call.
        repeats: runs (a fresh pool each); the median is reported.

    Returns:
        One dict per operation: ``{"name", "unit": "blocks/s", "rate", "ns_per_block"}``.
    """
    side = d.KvconnectorSide()
    samples: dict[str, list[tuple[float, int]]] = {}
    for _ in range(repeats):
        for name, (ns, n) in d.run_block_pool(side, num_blocks, batch).items():
            samples.setdefault(name, []).append((n, ns))
    out = []
    for name, s in samples.items():
        rate = _median_rate(s)
        out.append({"name": f"block pool: {name}", "unit": "blocks/s", "rate": rate,
                    "ns_per_block": 1e9 / rate})
    return out


def bench_kv_cache_manager(trace_size: str = "large", num_blocks: int = 4096, max_running: int = 32,
                           repeats: int = 5, events: tuple[bool, ...] = (False, True)) -> list[dict[str, Any]]:
    """The KV cache manager driven by the multi-turn chat trace (see :func:`_drivers.run_manager_trace`).

    Args:
        trace_size: ``"large"`` (1000 requests, ~1.3 M prompt tokens), ``"medium"`` or ``"tiny"``.
        num_blocks: KV cache blocks, null block included.
        max_running: batch size cap of the simulation.
        repeats: runs (fresh manager and requests each); medians are reported.
        events: run once per value: KV events off (False) and/or on (True).

    Returns:
        One dict per (events, metric): ``{"name", "unit", "rate", "hit_rate", "counters"}``;
        metrics are requests/s, steps/s and allocate+free calls/s.
    """
    side = d.KvconnectorSide()
    trace = d.chat_trace(trace_size)
    out = []
    for ev in events:
        runs = []
        for _ in range(repeats):
            reqs = d.build_manager_requests(side, trace)
            runs.append(d.run_manager_trace(side, reqs, num_blocks=num_blocks,
                                            max_running=max_running, events=ev))
        first = runs[0]
        label = f"KV cache manager ({trace.name}, {num_blocks} blocks, events {'on' if ev else 'off'})"
        counters = dict(zip(("requests", "steps", "prompt_tokens", "hit_tokens", "allocate_calls",
                             "free_calls", "preemptions", "events"), first.semantics()))
        for unit, count in (("requests/s", lambda s: s.requests), ("steps/s", lambda s: s.steps),
                            ("allocate+free calls/s", lambda s: s.allocate_calls + s.free_calls)):
            out.append({"name": label, "unit": unit,
                        "rate": _median_rate([(count(s), s.ns) for s in runs]),
                        "hit_rate": first.hit_rate, "counters": counters})
    return out


def render(results: list[dict[str, Any]], info: dict[str, str], repeats: int, trace_size: str) -> str:
    """Markdown record of a run: header line and one table."""
    lines = [
        f"### Run {info['date']}",
        "",
        f"Machine: {info['cpu']}, {info['cores']} cores. Python {info['python']}, "
        f"msgspec {info['msgspec']}. Trace: {trace_size}. Median of {repeats} repeats.",
        "",
        "| benchmark | unit | throughput | note |",
        "|---|---|---:|---|",
    ]
    for r in results:
        if "ns_per_block" in r:
            note = f"{r['ns_per_block']:.0f} ns/block"
        else:
            note = f"prefix hit rate {r['hit_rate']:.4f}"
        lines.append(f"| {r['name']} | {r['unit']} | {r['rate']:,.0f} | {note} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5, help="runs per benchmark (default 5)")
    p.add_argument("--trace", default="large", choices=["large", "medium", "tiny"],
                   help="chat trace size for the manager benchmark (default large)")
    p.add_argument("--pool-blocks", type=int, default=65537, help="block pool size (default 65537)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    p.add_argument("--record", metavar="RESULTS_MD", help="append this run to a RESULTS.md")
    args = p.parse_args(argv)
    info = d.machine_info()
    results = bench_block_pool(args.pool_blocks, repeats=args.repeats)
    results += bench_kv_cache_manager(args.trace, repeats=args.repeats)
    text = render(results, info, args.repeats, args.trace)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "results": results}, indent=2))
    if args.record:
        d.record_section(Path(args.record), SECTION, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
