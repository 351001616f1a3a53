"""Per-step cost of the CPU offload connector's scheduler side against prompt length.

One request with a prompt of N tokens (1k to 128k) is admitted, prefilled in one step,
then decoded for ``--steps`` steps of one token; every decode step calls
``build_connector_meta`` (which plans that step's stores). The median time of a decode
step's ``build_connector_meta`` is reported. Store planning touches only the chunks a
step completes, so the cost should not grow with N.

Baseline, in the same run and on the same request: what main (before issue 12) did on
top of that in every step for every scheduled request, rebuilding the request's whole
chunk-key list (``[hashes[f*i + f - 1] for i in range(len(hashes) // f)]``), timed
alone. Both columns are medians over the same steps.

Usage::

    python benchmarks/bench_offload_planning.py [--steps 200] [--record benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _drivers as d  # noqa: E402  (path set up above)

from connectors.offload.connector import OffloadingConnector  # noqa: E402
from kvconnector_core.connector.base import KVConnectorRole  # noqa: E402
from kvconnector_core.connector.config import KVConnectorConfig  # noqa: E402
from kvconnector_core.kv_cache.block_pool import KVCacheBlock  # noqa: E402
from kvconnector_core.kv_cache.kv_cache_manager import KVCacheBlocks  # noqa: E402
from kvconnector_core.kv_cache.kv_cache_spec import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from kvconnector_core.request import Request  # noqa: E402
from kvconnector_core.scheduler.output import (  # noqa: E402
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)

__all__ = ["main", "measure"]

SECTION = "## Offload store planning cost vs prompt length (bench_offload_planning.py)"
BS = 16
PROMPT_LENGTHS = (1024, 8192, 32768, 131072)


def _output(new: list[NewRequestData], cached: CachedRequestData, scheduled: dict[str, int]
            ) -> SchedulerOutput:
    return SchedulerOutput(scheduled_new_reqs=new, scheduled_cached_reqs=cached,
                           num_scheduled_tokens=scheduled,
                           total_num_scheduled_tokens=sum(scheduled.values()),
                           finished_req_ids=set(), preempted_req_ids=set())


def measure(prompt_len: int, steps: int) -> tuple[float, float]:
    """Median ns of a decode step's ``build_connector_meta``, and of main's key rebuild."""
    num_blocks = prompt_len // BS + steps // BS + 8
    spec = FullAttentionSpec(BS, 8, 128)
    kv = KVCacheConfig(num_blocks + 1, [KVCacheGroupSpec(["l0"], spec)])
    conn = OffloadingConnector(
        KVConnectorConfig(name="cpu_offload", extra_config={
            "num_cpu_blocks": num_blocks, "enable_events": False}),
        KVConnectorRole.SCHEDULER, kv)
    prompt = [i % 30000 for i in range(prompt_len)]
    req = Request("r", prompt, steps + 1, hash_block_size=BS)
    blocks = [KVCacheBlock(i + 1) for i in range(-(-prompt_len // BS))]
    conn.update_state_after_alloc(req, KVCacheBlocks((blocks,)), 0)
    ids = [b.block_id for b in blocks]
    conn.build_connector_meta(_output(
        [NewRequestData("r", prompt, (ids,), 0)],
        CachedRequestData([], set(), [], [], []), {"r": prompt_len}))
    next_block = len(ids) + 1
    ours: list[int] = []
    old: list[int] = []
    clock = time.perf_counter_ns
    for step in range(steps):
        req.append_output_token_ids(step % 1000)
        computed = prompt_len + step
        new_ids = None
        if computed % BS == 0:  # the token computed this step starts a new block
            new_ids = ([next_block],)
            next_block += 1
        out = _output([], CachedRequestData(["r"], set(), [[step % 1000]], [new_ids], [computed]),
                      {"r": 1})
        t0 = clock()
        conn.build_connector_meta(out)
        ours.append(clock() - t0)
        hashes = req.block_hashes
        t0 = clock()
        keys = [hashes[i] for i in range(len(hashes))]  # main's _chunk_keys with f = 1
        old.append(clock() - t0)
        del keys
    return statistics.median(ours), statistics.median(old)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the table; print it and optionally record it."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--record", type=Path)
    args = ap.parse_args(argv)
    info = d.machine_info()
    lines = [f"### Run {info['date']}", "",
             f"Machine: {info['cpu']}, {info['cores']} cores. Python {info['python']}. One "
             f"request, {BS}-token blocks, one-token decode steps (median of {args.steps}); "
             "`build_connector_meta` of the CPU offload connector's scheduler side. Baseline: "
             "the whole chunk-key list rebuild main did per request per step, timed alone "
             "(main paid it on top of the rest).", "",
             "| prompt tokens | build_connector_meta per step (us) | main's key-list rebuild "
             "alone (us) | rebuild / ours |",
             "|---:|---:|---:|---:|"]
    for n in PROMPT_LENGTHS:
        ours, old = measure(n, args.steps)
        lines.append(f"| {n:,} | {ours / 1e3:.1f} | {old / 1e3:.1f} | {old / ours:.1f}x |")
        print(lines[-1], file=sys.stderr)
    return d.emit_table(lines, args.record, SECTION)


if __name__ == "__main__":
    raise SystemExit(main())
