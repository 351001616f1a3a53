"""What tensor parallelism costs a secondary-tier lookup: 1 worker against 2 and 4 shards.

Under TP/PP the scheduler side counts a chunk as held by a tier only when every worker's
shard of it is there, so one lookup asks ``world_size`` keys per chunk (one pipeline of
``EXISTS`` on Redis, one ``stat`` per file on disk). This measures the wall time of
``TierLookups.sources`` for ``--chunks`` chunks, every shard of each stored beforehand,
from the first call (which submits the lookup to the tier's I/O threads) to the answer.

Same work on every side: each side is asked the same chunks, and the run is refused unless
every side answers "held by tier 0" for every chunk. Sides alternate within each repeat;
cells are the median of ``--repeats``.

    python benchmarks/bench_tier_shards.py [--chunks 256 --repeats 21] [--skip-redis]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_tiers import _start_redis  # noqa: E402

from connectors.offload.tiers import Shard, make_tier  # noqa: E402
from connectors.offload.tiers.records import tier_key  # noqa: E402
from connectors.offload.tiers.scheduler import TierLookups  # noqa: E402

SHARD_COUNTS = (1, 2, 4)


def _keys(chunks: int) -> list[bytes]:
    # Offload keys: a 32-byte chained hash and the 4-byte KV cache group (0).
    return [i.to_bytes(8, "big") * 4 + (0).to_bytes(4, "big") for i in range(chunks)]


def _fill(spec: dict, keys: list[bytes]) -> None:
    """Store every shard of every chunk, each through a tier of that shard (as workers do)."""
    for world in SHARD_COUNTS:
        for shard in Shard.all_of(world):
            tier = make_tier(spec, enable_events=False, shard=shard)
            try:
                if not tier.store([(tier_key(k, shard), b"\0" * 1024) for k in keys]):
                    raise SystemExit(f"{spec['type']}: a store was dropped while filling")
                if not tier.flush(timeout=60):
                    raise SystemExit(f"{spec['type']}: stores did not finish")
            finally:
                tier.close()


def _time_lookup(lookups: TierLookups, req: str, keys: list[bytes]) -> tuple[float, list]:
    start = time.perf_counter()
    while (answer := lookups.sources(req, keys)) is None:
        time.sleep(0)  # let the tier's I/O thread run
    elapsed = time.perf_counter() - start
    lookups.forget(req)
    return elapsed, answer


def bench(spec: dict, chunks: int, repeats: int) -> dict[int, float]:
    """Median seconds per lookup of ``chunks`` chunks, per number of shards."""
    keys = _keys(chunks)
    _fill(spec, keys)
    sides = {w: TierLookups([make_tier(spec, enable_events=False)], Shard.all_of(w))
             for w in SHARD_COUNTS}
    times: dict[int, list[float]] = {w: [] for w in SHARD_COUNTS}
    try:
        for r in range(repeats + 1):  # the first repeat warms up and is dropped
            order = list(SHARD_COUNTS) if r % 2 == 0 else list(reversed(SHARD_COUNTS))
            for w in order:
                elapsed, answer = _time_lookup(sides[w], f"r{r}w{w}", keys)
                if answer != [0] * chunks:
                    missing = sum(a != 0 for a in answer)
                    raise SystemExit(f"{spec['type']}, {w} shards: {missing} of {chunks} chunks "
                                     "not found; the sides would not do the same work")
                if r:
                    times[w].append(elapsed)
    finally:
        for lookups in sides.values():
            lookups.close()
    return {w: statistics.median(t) for w, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=256, help="chunks per lookup (default 256)")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--skip-redis", action="store_true")
    args = parser.parse_args(argv)
    if args.chunks < 1 or args.repeats < 1:
        parser.error(f"--chunks {args.chunks} and --repeats {args.repeats} must be >= 1")
    print(f"machine: {platform.processor() or platform.machine()}, Python {platform.python_version()}; "
          f"{args.chunks} chunks per lookup, median of {args.repeats}")
    print("| tier | shards | lookup ms | us per chunk | x 1 shard |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        specs = [{"type": "disk", "path": str(Path(tmp) / "disk"), "capacity_bytes": 1 << 30}]
        proc = None
        if not args.skip_redis:
            proc, url = _start_redis(Path(tmp))
            specs.append({"type": "redis", "url": url, "model": "bench", "layout": "bench"})
        try:
            for spec in specs:
                medians = bench(spec, args.chunks, args.repeats)
                for w, s in medians.items():
                    print(f"| {spec['type']} | {w} | {s * 1e3:.2f} | {s * 1e6 / args.chunks:.2f} "
                          f"| {s / medians[1]:.2f} |")
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
