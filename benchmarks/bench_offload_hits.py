"""Hit rate of the CPU offload tier's cache policies, driven the way the connectors drive them.

Every request of a trace offers its chain of block hashes to a fresh CPU offloading
manager per (policy, tier size): look up the leading ready keys, load them, record the
use, store the rest (``_drivers.run_offload_trace``). kvconnector's side follows
``OffloadingConnector`` with each ``recency`` setting: ``all_keys`` (the default, vLLM
0.33's rule: every key a request loaded, stored or found held, committed at finish) and
``hits_only`` (:class:`HitsOnlySide`: only the keys its admission hit, touched at finish);
vLLM 0.33's side follows its own connector (per-request context, recency committed at
request finish). Hit rate = keys served by the tier / keys offered.

Rows: kvconnector LRU and ARC with each recency rule, kvconnector ARC without store-miss
adaptation (the ARC of main before issue 12: adapts only on touches of ghosts), and, where
vLLM 0.33 is importable (``.vllm-venv``), vLLM's LRU and ARC. Only hit rates are reported;
the offload manager's speed is in ``compare_vllm.py``.

Usage::

    python benchmarks/bench_offload_hits.py [--trace large|unseen] [--seed 0]
        [--sizes 1024,2048,4096,8192] [--record benchmarks/RESULTS.md] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _drivers as d  # noqa: E402  (path set up above)

from connectors.offload.manager import ARCCachePolicy, register_cache_policy  # noqa: E402
from connectors.offload.manager import registry as policies  # noqa: E402

__all__ = ["ClassicARCCachePolicy", "hit_rates", "main", "render"]

SECTION = "## Offload tier hit rates (bench_offload_hits.py)"
DEFAULT_SIZES = (1024, 2048, 4096, 8192)


class ClassicARCCachePolicy(ARCCachePolicy):
    """ARC without store-miss adaptation (main before issue 12): store misses teach it nothing."""

    def on_store_miss(self, keys: Sequence[bytes]) -> None:
        """Ignore store misses (no adaptation, ghosts re-enter T1)."""


CLASSIC = "arc-no-store-miss-adaptation"


class HitsOnlySide(d.KvconnectorSide):
    """kvconnector's manager driven as ``OffloadingConnector`` drives it with
    ``extra_config["recency"] = "hits_only"``."""

    def offload_runner(self, num_blocks: int, policy: str) -> Any:
        """See :meth:`_drivers.Side.offload_runner`."""
        from connectors.offload.manager import CPUOffloadingManager

        m = CPUOffloadingManager(num_blocks, cache_policy=policy)

        def run(keys: list[bytes], req_id: str, local: int = 0) -> int:
            # Load the leading ready keys after the GPU hit (no use recorded), offer the
            # same keys for storing as with the default rule (held ones are skipped), and
            # at finish touch only the keys the admission hit, GPU prefix and loads.
            hits = m.lookup(keys[local:])
            if hits:
                loaded = keys[local:local + hits]
                m.prepare_load(loaded)
                m.complete_load(loaded)
            out = m.prepare_store(keys[local + hits:] if hits else keys)
            if out is not None and out.keys_to_store:
                m.complete_store(out.keys_to_store)
            m.touch(keys[:local + hits])
            return hits

        return run


@contextlib.contextmanager
def _classic_registered() -> Iterator[None]:
    # Registered only while the table runs: the registry is global, and error messages
    # elsewhere list the registered policies.
    register_cache_policy(CLASSIC, ClassicARCCachePolicy)
    try:
        yield
    finally:
        policies._POLICIES.pop(CLASSIC, None)


def hit_rates(chains: list[list[bytes]], sizes: Sequence[int], with_vllm: bool = True,
              gpu_blocks: int = 0) -> dict[str, dict[int, float]]:
    """Tier hit rate per ``"side policy"`` label and tier size.

    Args:
        chains: one key chain per request (``_drivers.offload_key_chains``).
        sizes: CPU tier sizes in blocks.
        with_vllm: also run vLLM 0.33's manager when it can be imported.
        gpu_blocks: size of the GPU prefix-cache model in front of the tier (0: none);
            the hit rate is then over the keys the GPU did not serve.

    Returns:
        ``{label: {size: hit rate}}``; the labels that ran, in table order.
    """
    ours, hits_only = d.KvconnectorSide(), HitsOnlySide()
    runs: list[tuple[str, d.Side, str]] = [
        ("kvconnector LRU, all_keys (default)", ours, "lru"),
        ("kvconnector LRU, hits_only", hits_only, "lru"),
        ("kvconnector ARC, all_keys (default)", ours, "arc"),
        ("kvconnector ARC, hits_only", hits_only, "arc"),
        ("kvconnector ARC, no store-miss adaptation", ours, CLASSIC),
    ]
    if with_vllm:
        try:
            vllm = d.VllmSide()
        except ImportError:
            print("vLLM 0.33 not importable: its rows are skipped", file=sys.stderr)
        else:
            runs += [("vLLM 0.33 LRU", vllm, "lru"), ("vLLM 0.33 ARC", vllm, "arc")]
    out: dict[str, dict[int, float]] = {}
    with _classic_registered():
        for label, side, policy in runs:
            for size in sizes:
                out.setdefault(label, {})[size] = _tier_hit_rate(side, chains, policy, size,
                                                                 gpu_blocks)
    return out


def _tier_hit_rate(side: d.Side, chains: list[list[bytes]], policy: str, size: int,
                   gpu_blocks: int) -> float:
    st = d.run_offload_trace(side, chains, policy=policy, num_blocks=size, gpu_blocks=gpu_blocks)
    print(f"{side.name} {policy:30s} gpu {gpu_blocks:5d} tier {size:6d}: hit rate "
          f"{st.tier_hit_rate:.4f}", file=sys.stderr)
    return st.tier_hit_rate


def render(tables: dict[int, dict[str, dict[int, float]]], sizes: Sequence[int],
           info: dict[str, str], trace_name: str, num_keys: int, seed: int = 0) -> str:
    """Markdown: per GPU-cache size, one row per policy, one column per tier size."""
    seed_note = f" seed {seed}" if seed else ""
    lines = [
        f"### Run {info['date']}",
        "",
        f"Machine: {info['cpu']}, {info['cores']} cores. Python {info['python']}, vLLM "
        f"{info['vllm']}. Trace `{trace_name}`{seed_note} ({num_keys:,} keys, 16-token blocks). "
        "Hit rate = keys served by the CPU tier / keys asked of it (the keys past the GPU "
        "prefix hit; the GPU cache model is an LRU of blocks).",
    ]
    for gpu_blocks, results in tables.items():
        gpu = f"{gpu_blocks} GPU blocks in front" if gpu_blocks else "no GPU cache in front"
        lines += ["", f"{gpu}:", "",
                  "| policy | " + " | ".join(f"{s} slots" for s in sizes) + " |",
                  "|---|" + "---:|" * len(sizes)]
        for label, by_size in results.items():
            lines.append(f"| {label} | " + " | ".join(f"{by_size[s]:.4f}" for s in sizes) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the hit-rate table; print it, optionally record it and dump JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default="large", choices=("large", "medium", "tiny", "unseen"))
    ap.add_argument("--seed", type=int, default=0, help="seed of the trace generator")
    ap.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)),
                    help="comma-separated CPU tier sizes in blocks")
    ap.add_argument("--gpu-blocks", default="0,2048",
                    help="comma-separated GPU prefix-cache sizes in blocks (0: none)")
    ap.add_argument("--no-vllm", action="store_true", help="skip vLLM 0.33 even if importable")
    ap.add_argument("--record", type=Path, help="append the table to this RESULTS.md")
    ap.add_argument("--json", type=Path, help="write the hit rates as JSON")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    trace = d.chat_trace(args.trace, args.seed)
    chains = d.offload_key_chains(trace)
    tables = {g: hit_rates(chains, sizes, with_vllm=not args.no_vllm, gpu_blocks=g)
              for g in (int(x) for x in args.gpu_blocks.split(","))}
    table = render(tables, sizes, d.machine_info(), trace.name, sum(len(c) for c in chains),
                   args.seed)
    print(table)
    if args.record:
        d.record_section(args.record, SECTION, table)
    if args.json:
        payload: dict[str, Any] = {
            str(g): {label: {str(s): v for s, v in by.items()} for label, by in res.items()}
            for g, res in tables.items()}
        args.json.write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
