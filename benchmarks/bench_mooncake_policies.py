"""Offload tier hit rate per cache policy and tier size on Mooncake's conversation trace.

Every request of the trace is driven through a fresh CPU offloading manager per (policy,
tier size), one request at a time, the way ``kvconnector simulate`` does
(:func:`connectors.offload.simulator.drive_request`: look up, load, store the rest,
commit the request's recency). Where vLLM 0.33 is importable (run in ``.vllm-venv``), its
``CPUOffloadingManager`` is driven over the same keys in the same process the way its
connector drives it (per-key lookups, per-request ``ReqContext`` with each key's
position, ``on_request_finished``); its hit counts must equal ours for LRU and ARC at
every size, and the ratio of the two sides' CPU time is printed.

Usage (from the repository root)::

    VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 .vllm-venv/bin/python \\
        benchmarks/bench_mooncake_policies.py \\
        --trace ../shared/data/mooncake/conversation_trace.jsonl \\
        --policies lru,arc,s3fifo --capacities 1024,4096,16384 --record benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _measure import machine_info, record_section  # noqa: E402

from connectors.offload.manager import CPUOffloadingManager  # noqa: E402
from connectors.offload.simulator import Chain, drive_request, mooncake_chains  # noqa: E402
from kvconnector_core.engine._trace import read_mooncake  # noqa: E402

__all__ = ["main", "run_ours", "run_vllm"]

SECTION = "## Offload policies on the Mooncake conversation trace (bench_mooncake_policies.py)"


def run_ours(chains: Sequence[Chain], policy: str, capacity: int) -> tuple[int, float]:
    """Tier hits and CPU seconds of our manager over ``chains``."""
    m = CPUOffloadingManager(capacity, cache_policy=policy)
    start = time.process_time()
    hits = sum(drive_request(m, chain) for chain in chains)
    return hits, time.process_time() - start


def _vllm_driver(policy: str, capacity: int) -> Callable[[Chain, str], int]:
    from vllm.v1.kv_offload.base import LookupResult, ReqContext
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager as VllmManager

    m = VllmManager(capacity, cache_policy=policy)
    hit = LookupResult.HIT

    def run(chain: Chain, req_id: str) -> int:
        keys = chain.keys
        ctx = ReqContext(req_id=req_id)
        m.on_new_request(ctx)
        for i, k in enumerate(keys):
            ctx.set_offload_key_position(k, i + 1)
        hits = 0
        for k in keys[:chain.loadable]:
            if m.lookup(k, ctx) is not hit:
                break
            hits += 1
        if hits:
            m.prepare_load(keys[:hits], ctx)
            m.complete_load(keys[:hits], ctx)
        out = m.prepare_store(keys[hits:] if hits else keys, ctx)
        if out is not None and out.keys_to_store:
            m.complete_store(out.keys_to_store, ctx)
        m.on_request_finished(ctx)
        return hits

    return run


def run_vllm(chains: Sequence[Chain], policy: str, capacity: int) -> tuple[int, float]:
    """Tier hits and CPU seconds of vLLM 0.33's manager over ``chains``."""
    run = _vllm_driver(policy, capacity)
    ids = [f"r{i}" for i in range(len(chains))]
    start = time.process_time()
    hits = sum(run(chain, rid) for chain, rid in zip(chains, ids))
    return hits, time.process_time() - start


def _rows(chains: Sequence[Chain], policies: list[str], capacities: list[int],
          with_vllm: bool) -> list[dict[str, Any]]:
    rows = []
    for policy in policies:
        for capacity in capacities:
            hits, secs = run_ours(chains, policy, capacity)
            row: dict[str, Any] = {"policy": policy, "capacity": capacity, "hits": hits,
                                   "seconds": secs}
            if with_vllm and policy in ("lru", "arc"):
                row["vllm_hits"], row["vllm_seconds"] = run_vllm(chains, policy, capacity)
            print(row, file=sys.stderr)
            rows.append(row)
    return rows


def render(rows: list[dict[str, Any]], capacities: list[int], asked: int, info: dict[str, str],
           command: str) -> str:
    """Markdown: hit rate per policy and size, then ours against vLLM's."""
    lines = [f"### Run {info['date']}", "",
             f"Machine: {info['cpu']}, {info['cores']} cores. Python {info['python']}, vLLM "
             f"{info['vllm']}. {asked:,} chunk lookups (one chunk = one 512-token hash id). "
             f"Command: `{command}`", "",
             "| policy | " + " | ".join(f"{c} chunks" for c in capacities) + " |",
             "|---|" + "---:|" * len(capacities)]
    for policy in dict.fromkeys(r["policy"] for r in rows):
        mine = [r for r in rows if r["policy"] == policy]
        lines.append(f"| {policy} | " + " | ".join(f"{r['hits'] / asked:.4f}" for r in mine)
                     + " |")
    versus = [r for r in rows if "vllm_hits" in r]
    if versus:
        lines += ["", "| policy | chunks | our hits | vLLM 0.33 hits | equal | our CPU s | "
                  "vLLM CPU s | vLLM / ours |", "|---|---:|---:|---:|---|---:|---:|---:|"]
        lines += [f"| {r['policy']} | {r['capacity']} | {r['hits']} | {r['vllm_hits']} | "
                  f"{'yes' if r['hits'] == r['vllm_hits'] else 'NO'} | {r['seconds']:.2f} | "
                  f"{r['vllm_seconds']:.2f} | {r['vllm_seconds'] / r['seconds']:.2f} |"
                  for r in versus]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the table; exit 1 if ours and vLLM's hit counts differ anywhere."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", type=Path,
                    default=Path("../shared/data/mooncake/conversation_trace.jsonl"))
    ap.add_argument("--policies", default="lru,arc")
    ap.add_argument("--capacities", default="1024,4096,16384")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--record", type=Path, help="append the table to this RESULTS.md")
    args = ap.parse_args(argv)
    policies = args.policies.split(",")
    capacities = [int(c) for c in args.capacities.split(",")]
    chains = mooncake_chains(read_mooncake(args.trace, limit=args.limit))
    with_vllm = not args.no_vllm
    if with_vllm:
        try:
            import vllm.v1.kv_offload.cpu.manager  # noqa: F401
        except ImportError:
            print("vLLM 0.33 not importable: its columns are skipped", file=sys.stderr)
            with_vllm = False
    rows = _rows(chains, policies, capacities, with_vllm)
    command = "python benchmarks/bench_mooncake_policies.py " + " ".join(
        sys.argv[1:] if argv is None else argv)
    table = render(rows, capacities, sum(c.loadable for c in chains), machine_info(), command)
    print(table)
    if args.record:
        record_section(args.record, SECTION, table)
    return 0 if all(r["hits"] == r.get("vllm_hits", r["hits"]) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
