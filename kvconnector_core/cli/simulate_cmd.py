"""``kvconnector simulate``: hit rate of the CPU offload tier against its capacity.

Drives the offload tier's manager alone (no model, no GPU) over a trace, for several
cache policies and tier sizes, and prints hit rate per policy and size
(:mod:`connectors.offload.simulator` says what it models and what it leaves out).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kvconnector_core.cli._trace_args import fraction, positive_int

if TYPE_CHECKING:
    from connectors.offload.simulator import SimResult

__all__ = ["HELP", "add_arguments", "main"]

HELP = "Hit rate of the CPU offload tier per cache policy and capacity over a Mooncake trace."


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        msg = f"{text!r} is not a comma-separated list of positive integers"
        raise argparse.ArgumentTypeError(msg)
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``simulate`` options to ``parser``."""
    parser.add_argument("--trace", metavar="FILE", required=True,
                        help="Mooncake trace (timestamp, input_length, output_length, hash_ids)")
    parser.add_argument("--policies", default="lru,arc",
                        help="comma-separated cache policy names (default lru,arc)")
    parser.add_argument("--capacities", type=_int_list, default=[1024, 4096, 16384],
                        metavar="N,N,...", help="tier sizes in chunks (default 1024,4096,16384)")
    parser.add_argument("--tokens-per-id", type=positive_int, default=512, metavar="N",
                        help="tokens each hash id stands for (default 512, the trace's own)")
    parser.add_argument("--chunk-tokens", type=positive_int, default=512, metavar="N",
                        help="tokens per offload chunk, dividing --tokens-per-id (default 512)")
    parser.add_argument("--limit", type=positive_int, default=None, metavar="N",
                        help="use only the first N requests of the trace")
    parser.add_argument("--sample", type=fraction, default=None, metavar="F",
                        help="keep each request with probability F (seeded by --seed)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="draw hit rate against capacity per policy (needs matplotlib: "
                             "pip install 'kvconnector[plot]')")


def _fail(message: str) -> int:
    print(f"kvconnector simulate: error: {message}", file=sys.stderr)
    return 2


def main(args: argparse.Namespace) -> int:
    """Run the simulation; exit 2 with one line on a bad trace or policy name."""
    from connectors.offload.manager import get_cache_policy
    from connectors.offload.simulator import mooncake_chains, simulate
    from kvconnector_core.engine._trace import read_mooncake
    from kvconnector_core.errors import ConfigError

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    try:
        for name in policies:
            get_cache_policy(name)
        records = read_mooncake(args.trace, limit=args.limit, sample=args.sample,
                                seed=args.seed)
        chains = mooncake_chains(records, args.tokens_per_id, args.chunk_tokens)
    except (ConfigError, ValueError) as exc:
        return _fail(str(exc).splitlines()[0])
    except OSError as exc:
        return _fail(f"--trace {args.trace}: {exc.strerror or exc}")
    results = simulate(chains, policies, args.capacities)
    if args.json:
        print(json.dumps([{"policy": r.policy, "capacity": r.capacity, "hits": r.hits,
                           "asked": r.asked, "hit_rate": r.hit_rate, "seconds": r.seconds}
                          for r in results], indent=2))
    else:
        print(_table(results, args.capacities, len(records)))
    if args.plot:
        try:
            _plot(results, Path(args.plot))
        except ImportError as exc:
            return _fail(str(exc))
    return 0


def _table(results: list[SimResult], capacities: list[int], num_requests: int) -> str:
    asked = results[0].asked if results else 0
    head = f"{num_requests} requests, {asked} chunk lookups; hit rate per tier size (chunks):"
    lines = [head, "",
             "policy      " + "".join(f"{c:>10}" for c in capacities) + "   seconds"]
    by_policy: dict[str, list[SimResult]] = {}
    for r in results:
        by_policy.setdefault(r.policy, []).append(r)
    for policy, rows in by_policy.items():
        rates = "".join(f"{r.hit_rate:>10.4f}" for r in rows)
        lines.append(f"{policy:<12}{rates}{sum(r.seconds for r in rows):>10.2f}")
    return "\n".join(lines)


def _plot(results: list[SimResult], path: Path) -> None:
    try:
        import matplotlib  # type: ignore[import-not-found,unused-ignore]  # optional extra

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        msg = ("--plot needs matplotlib, an optional dependency: pip install 'kvconnector[plot]' "
               "(or pip install matplotlib)")
        raise ImportError(msg) from None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy in dict.fromkeys(r.policy for r in results):
        rows = [r for r in results if r.policy == policy]
        ax.plot([r.capacity for r in rows], [r.hit_rate for r in rows], marker="o", label=policy)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tier capacity (chunks)")
    ax.set_ylabel("tier hit rate")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
