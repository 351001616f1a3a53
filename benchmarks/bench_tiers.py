"""Secondary tier throughput: each tier against its raw client moving the same bytes.

Rows (GB/s = 1e9 bytes/s, median of ``--repeats``, sides alternating in each repeat):

- ``disk``: :class:`DiskTier` store (queue + flush: framing, checksum, temp file + rename)
  and load (``load_into``: read + checksum check into a destination buffer, as the engine
  reads into a CPU slot) vs plain ``open().write()`` / ``open().readinto()`` of one file
  per value in the same directory tree, into the same destination buffers.
- ``redis``: :class:`RedisTier` (``load_into``) vs redis-py pipelines of ``SET`` / ``GET``
  with the same batch size, each value copied into its destination buffer, against the
  same server (a fresh ``redis-server`` on a loopback port unless ``--redis-url`` names one).

The harness checks both sides do the same work: same number of values and bytes, and
every destination buffer equal to the value written, on both sides.

``--engine``: the engine on a workload whose working set exceeds the CPU tier, with
GPU only (no connector), GPU+CPU, GPU+CPU+disk and GPU+CPU+Redis: hit rates and prefill
tokens computed / saved. Every run's outputs must equal the GPU-only run's.

    python benchmarks/bench_tiers.py [--count 256 --value-kib 256 --repeats 5] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from connectors.offload.tiers import DiskTier, RedisTier, TierKey  # noqa: E402


def _values(count: int, size: int) -> list[tuple[TierKey, bytes]]:
    return [(TierKey(i.to_bytes(8, "big") * 4), os.urandom(16) * (size // 16)) for i in range(count)]


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _check(side: str, got: list[bytes | None], items: list[tuple[TierKey, bytes]]) -> None:
    if got != [v for _, v in items]:
        raise SystemExit(f"{side}: read back differs from what was written")


def _run_sides(what: str, items, r: int, raw: tuple, tier, batch: int, tier_out: tuple,
               dests: list[bytearray]) -> None:
    """Time one repeat of both sides (raw first on even repeats), checking the read-back.

    Both loads fill ``dests`` (one buffer per value, like a CPU slot), cleared before
    each side.
    """
    def tier_store():
        for i in range(0, len(items), batch):
            while not tier.store(items[i:i + batch]):
                tier.flush()  # never drop here: both sides must write every value
        tier.flush()

    def tier_load():
        if not all(tier.load_into([k for k, _ in items], [[memoryview(d)] for d in dests]).values()):
            raise SystemExit(f"{what} tier: a load failed; the comparison is void")

    sides = [("raw", *raw), ("tier", tier_store, tier_load, *tier_out)]
    for name, store, load, s_out, l_out in (sides if r % 2 == 0 else sides[::-1]):
        s_out.append(_timed(store))
        for d in dests:
            d[:] = bytes(len(d))
        l_out.append(_timed(load))
        _check(f"{what} {name}", [bytes(d) for d in dests], items)


def bench_disk(items, repeats: int, root: Path) -> dict:
    total = sum(len(v) for _, v in items)
    raw_s, raw_l, tier_s, tier_l, read_bytes_l = [], [], [], [], []
    dests = [bytearray(len(v)) for _, v in items]
    for r in range(repeats):
        raw_dir, tier_dir = root / f"raw{r}", root / f"tier{r}"

        def raw_store(raw_dir=raw_dir):
            for key, value in items:
                path = raw_dir / key.name[:2] / key.name
                path.parent.mkdir(parents=True, exist_ok=True)
                with open(path, "wb") as f:
                    f.write(value)

        def raw_load(raw_dir=raw_dir):
            for (k, _), dest in zip(items, dests, strict=True):
                with open(raw_dir / k.name[:2] / k.name, "rb", buffering=0) as f:
                    f.readinto(dest)

        tier = DiskTier({"path": str(tier_dir), "capacity_bytes": 4 * total})

        _run_sides("disk", items, r, (raw_store, raw_load, raw_s, raw_l), tier, 16, (tier_s, tier_l),
                   dests)
        # The earlier baseline, for continuity: read_bytes() makes a new bytes per value.
        got = []
        read_bytes_l.append(_timed(lambda raw_dir=raw_dir, got=got: got.extend(
            (raw_dir / k.name[:2] / k.name).read_bytes() for k, _ in items)))
        _check("disk read_bytes", got, items)
        tier.close()
        shutil.rmtree(raw_dir)
        shutil.rmtree(tier_dir)
    row = _row("disk", total, raw_s, raw_l, tier_s, tier_l)
    row["raw_read_bytes_gbps"] = total / statistics.median(read_bytes_l) / 1e9
    return row


def bench_redis(items, repeats: int, url: str, batch: int) -> dict:
    import redis

    total = sum(len(v) for _, v in items)
    client = redis.Redis.from_url(url)
    raw_s, raw_l, tier_s, tier_l = [], [], [], []
    dests = [bytearray(len(v)) for _, v in items]
    for r in range(repeats):
        client.flushdb()
        tier = RedisTier({"url": url, "model": "bench", "layout": "bench", "batch_size": batch,
                          "tenant_salt": f"r{r}", "ttl_seconds": None})
        names = [f"raw:{r}:{k.name}" for k, _ in items]

        def raw_store(names=names):
            for i in range(0, len(items), batch):
                pipe = client.pipeline(transaction=False)
                for name, (_, value) in zip(names[i:i + batch], items[i:i + batch], strict=True):
                    pipe.set(name, value)
                pipe.execute()

        def raw_load(names=names):
            for i in range(0, len(names), batch):
                pipe = client.pipeline(transaction=False)
                for name in names[i:i + batch]:
                    pipe.get(name)
                for dest, value in zip(dests[i:i + batch], pipe.execute(), strict=True):
                    dest[:] = value

        _run_sides("redis", items, r, (raw_store, raw_load, raw_s, raw_l), tier, batch,
                   (tier_s, tier_l), dests)
        if tier.stats()["redis_store_failures"]:
            raise SystemExit("redis tier: stores failed; the comparison is void")
        tier.close()
    client.close()
    return _row("redis", total, raw_s, raw_l, tier_s, tier_l)


def _row(name, total, raw_s, raw_l, tier_s, tier_l) -> dict:
    def gbps(times):
        return total / statistics.median(times) / 1e9

    row = {"tier": name, "bytes": total,
           "raw_store_gbps": gbps(raw_s), "tier_store_gbps": gbps(tier_s),
           "raw_load_gbps": gbps(raw_l), "tier_load_gbps": gbps(tier_l)}
    row["store_ratio"] = row["tier_store_gbps"] / row["raw_store_gbps"]
    row["load_ratio"] = row["tier_load_gbps"] / row["raw_load_gbps"]
    return row


def bench_engine(workload: str, num_gpu_blocks: int, cpu_chunks: int, tmp: Path,
                 redis_url: str | None) -> list[dict]:
    from kvconnector_core.engine.engine import Engine, EngineConfig
    from kvconnector_core.engine.workloads import get_workload

    trace = get_workload(workload)
    max_len = max(512, 16 + max(len(r.prompt_token_ids) + r.max_new_tokens for r in trace))
    setups: list[tuple[str, dict | None]] = [("GPU only", None), ("GPU+CPU", {"tiers": []}),
                                             ("GPU+CPU+disk", {"tiers": [
                                                 {"type": "disk", "path": str(tmp / "disk"),
                                                  "capacity_bytes": 1 << 32}]})]
    if redis_url is not None:
        setups.append(("GPU+CPU+Redis", {"tiers": [{"type": "redis", "url": redis_url,
                                                    "model": "bench-engine", "ttl_seconds": None}]}))
    rows, base = [], None
    for label, extra in setups:
        connector = None if extra is None else {
            "name": "cpu_offload", "extra_config": {"num_cpu_blocks": cpu_chunks, **extra}}
        config = EngineConfig(num_gpu_blocks=num_gpu_blocks, max_model_len=max_len,
                              max_num_batched_tokens=256, max_num_seqs=8, connector=connector)
        with Engine(config) as engine:
            result = engine.run(trace)
        if base is None:
            base = result
        elif result.outputs != base.outputs:
            raise SystemExit(f"{label}: outputs differ from the GPU-only run; the comparison is void")
        m = result.metrics
        rows.append({"setup": label, "prompt_tokens": m.num_prompt_tokens,
                     "gpu_hit_rate": m.gpu_hit_rate, "connector_hit_rate": m.connector_hit_rate,
                     "total_hit_rate": m.total_hit_rate, "prefill_computed": m.prefill_tokens_computed,
                     "recomputed": m.recomputed_tokens,
                     "saved_vs_gpu_only": base.metrics.prefill_tokens_computed + base.metrics.recomputed_tokens
                     - m.prefill_tokens_computed - m.recomputed_tokens,
                     "tier_loads": sum(v for k, v in m.connector_stats.items() if k.endswith("_loads")),
                     "tier_stores": sum(v for k, v in m.connector_stats.items() if k.endswith("_stores")),
                     "tier_stores_dropped": sum(v for k, v in m.connector_stats.items()
                                                if k.endswith("_stores_dropped"))})
    return rows


def _start_redis(tmp: Path) -> tuple[subprocess.Popen, str]:
    import socket

    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server is not installed: apt-get install -y redis-server "
                         "(or pass --redis-url, or --skip-redis)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis

    deadline = time.monotonic() + 30
    while True:
        try:
            redis.Redis(port=port).ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=256, help="values per run (default 256)")
    parser.add_argument("--value-kib", type=int, default=256, help="value size (default 256 KiB)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16, help="Redis keys per pipeline (both sides)")
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--skip-redis", action="store_true")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--engine", action="store_true", help="also run the engine-level rows")
    parser.add_argument("--workload", default="documents")
    parser.add_argument("--gpu-blocks", type=int, default=64)
    parser.add_argument("--cpu-chunks", type=int, default=32)
    args = parser.parse_args(argv)
    items = _values(args.count, args.value_kib * 1024)
    rows, engine_rows = [], []
    with tempfile.TemporaryDirectory(prefix="bench-tiers-") as tmp:
        rows.append(bench_disk(items, args.repeats, Path(tmp)))
        proc = None
        url = args.redis_url
        try:
            if not args.skip_redis:
                if url is None:
                    proc, url = _start_redis(Path(tmp))
                rows.append(bench_redis(items, args.repeats, url, args.batch))
            if args.engine:
                engine_rows = bench_engine(args.workload, args.gpu_blocks, args.cpu_chunks,
                                           Path(tmp), None if args.skip_redis else url)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(30)
    machine = f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    print(f"# {args.count} values x {args.value_kib} KiB, median of {args.repeats}; {machine}")
    print("| tier | raw store GB/s | tier store GB/s | store ratio | raw load GB/s | tier load GB/s | load ratio |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tier']} | {r['raw_store_gbps']:.2f} | {r['tier_store_gbps']:.2f} | "
              f"{r['store_ratio']:.2f}x | {r['raw_load_gbps']:.2f} | {r['tier_load_gbps']:.2f} | "
              f"{r['load_ratio']:.2f}x |")
        if "raw_read_bytes_gbps" in r:
            print(f"  ({r['tier']}: raw read_bytes() without a destination buffer: "
                  f"{r['raw_read_bytes_gbps']:.2f} GB/s)")
    if engine_rows:
        print(f"\n# engine: workload {args.workload!r}, {args.gpu_blocks} GPU blocks, "
              f"{args.cpu_chunks} CPU chunks; outputs identical to GPU only in every row")
        print("| setup | GPU hit rate | connector hit rate | total hit rate | prefill computed "
              "(+recomputed) | saved vs GPU only | tier stores / dropped / loads |")
        print("|---|---|---|---|---|---|---|")
        for r in engine_rows:
            print(f"| {r['setup']} | {r['gpu_hit_rate']:.1%} | {r['connector_hit_rate']:.1%} | "
                  f"{r['total_hit_rate']:.1%} | {r['prefill_computed']} (+{r['recomputed']}) | "
                  f"{r['saved_vs_gpu_only']} | {r['tier_stores']} / {r['tier_stores_dropped']} / "
                  f"{r['tier_loads']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine, "rows": rows,
                                               "engine_rows": engine_rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
