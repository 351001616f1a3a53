"""kvconnector vs vLLM 0.33's pure-Python core, side by side, in one process.

The same deterministic workloads (``benchmarks/_drivers.py``) run through both
implementations, alternating kvconnector/vLLM (and which goes first) on every repeat, and
the table shows the median of each side and the ratio *kvconnector / vLLM* in throughput
(> 1 means kvconnector is faster). Rows:

- block pool primitives, per block (allocate, free cached / uncached, touch, cache full
  blocks, cached-block lookup hit / miss, allocation that evicts);
- the KV cache manager on a 1000-request multi-turn chat trace with shared system prompts
  (~1.3 M prompt tokens), events off and on: requests/s and steps/s, with both prefix hit
  rates (the run fails if the two implementations disagree on any counter);
- the CPU offloading manager, LRU and ARC, on the same trace's block-hash chains:
  operations (keys) per second and both hit rates;
- KV event batches: msgpack encode and decode, events/s (plus a cross-decoding check:
  our bytes with vLLM's types and vice versa);
- chained block hashing: blocks/s (each side's default: vLLM's pickle + sha256, ours
  msgpack + sha256).

Needs vLLM 0.33 installed (``make compare-vllm`` builds ``.vllm-venv`` and runs this with
``VLLM_TARGET_DEVICE=cpu``). Not part of CI.

Usage::

    python benchmarks/compare_vllm.py [--repeats 5] [--json out.json] [--record benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _drivers as d  # noqa: E402  (path set up above)

__all__ = ["Row", "compare", "main", "render_run", "render_table"]

SECTION = "## Side by side with vLLM 0.33 (compare_vllm.py)"
_TARGET = 1.5  # every row: kvconnector at 1.5x vLLM 0.33's throughput or better


class Row:
    """One line of the table: per-repeat throughputs of both sides.

    Args:
        group: section of the table (``"block pool"``, ...).
        name: what is measured.
        unit: throughput unit (``"blocks/s"``, ...).
        target: the ratio the row should reach (1.0 = "no slower than vLLM").
    """

    __slots__ = ("extra", "failure", "group", "kvc", "name", "target", "unit", "vllm")

    def __init__(self, group: str, name: str, unit: str, target: float = _TARGET) -> None:
        self.group = group
        self.name = name
        self.unit = unit
        self.target = target
        self.kvc: list[float] = []
        self.vllm: list[float] = []
        self.extra: str = ""
        self.failure: str = ""  # non-empty: the two sides did not do the same work

    def discard_samples(self) -> None:
        """Forget the samples so far (the warm-up round)."""
        self.kvc.clear()
        self.vllm.clear()

    def add(self, side: str, units: float, ns: int) -> None:
        """Record one repeat: ``units`` processed in ``ns`` nanoseconds by ``side``."""
        rate = units / (ns / 1e9) if ns > 0 else float("inf")
        (self.kvc if side == "kvconnector" else self.vllm).append(rate)

    @property
    def ratio(self) -> float:
        """Median kvconnector throughput / median vLLM throughput."""
        return statistics.median(self.kvc) / statistics.median(self.vllm)

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly form (medians, all samples, ratio, target)."""
        return {
            "group": self.group, "name": self.name, "unit": self.unit,
            "kvconnector": statistics.median(self.kvc), "vllm": statistics.median(self.vllm),
            "ratio": self.ratio, "target": self.target, "note": self.extra,
            "failure": self.failure,
            "samples": {"kvconnector": self.kvc, "vllm": self.vllm},
        }


def _alternate(repeats: int, sides: tuple[d.Side, d.Side], fn: Callable[[d.Side], None],
               rows: Callable[[], list[Row]]) -> None:
    """One untimed warm-up round per side, then ``repeats`` alternating timed rounds.

    The warm-up fills caches, interns strings and specialises bytecode on both sides
    before any sample counts; its samples are discarded from ``rows()``.
    """
    for side in sides:
        fn(side)
    for row in rows():
        row.discard_samples()
    # Alternate which side goes first so slow drift (thermal, other tenants) hits both.
    for r in range(repeats):
        for side in (sides if r % 2 == 0 else sides[::-1]):
            fn(side)


def _fmt_rate(x: float) -> str:
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if x >= div:
            return f"{x / div:.2f}{suffix}"
    return f"{x:.1f}"


GROUPS = ("pool", "manager", "offload", "events", "hashing")
"""Row groups ``compare`` can run (``only=``)."""


def compare(repeats: int = 5, trace_size: str = "large", pool_blocks: int = 65537,
            manager_blocks: int = 4096, offload_blocks: int = 4096,
            log: Callable[[str], None] = print, *, seed: int = 0, block_size: int = 16,
            spec: str = "full", window: int = 1024,
            only: tuple[str, ...] = GROUPS) -> tuple[list[Row], dict[str, Any]]:
    """Run every workload on both sides; return the rows and the correctness checks.

    Args:
        repeats: runs per side per workload (medians are reported).
        trace_size: one of ``_drivers.TRACES`` (``"large"``: the 1000-request trace).
        pool_blocks: block pool size for the primitive rows.
        manager_blocks: KV cache size for the manager trace (small: preemption storms).
        offload_blocks: CPU tier slots for the offload trace.
        log: progress printer.
        seed: the trace generator's seed.
        block_size: tokens per block (KV blocks, hashes, offload keys) on both sides.
        spec: the manager's attention layout (``_sides.SPECS``: full, sliding, hybrid).
        window: sliding window in tokens for ``spec`` sliding / hybrid.
        only: the row groups to run (:data:`GROUPS`).

    Returns:
        ``(rows, checks)``; ``checks`` holds the manager counters of both sides, event
        cross-decoding results and whether the manager semantics matched.
    """
    t0 = time.perf_counter()
    trace = d.chat_trace(trace_size, seed)
    # max_model_len must hold the longest request on both sides (the long-prompt trace).
    longest = max(len(r.prompt_token_ids) + r.max_new_tokens for r in trace.requests)
    d.configure(block_size=block_size, max_model_len=max(8192, -(-longest // block_size) * block_size),
                spec=spec, window=window)
    kvc = d.KvconnectorSide()
    vl = d.VllmSide()  # imports vLLM (seconds), outside every timed region
    sides = (kvc, vl)
    log(f"vLLM imported in {time.perf_counter() - t0:.1f}s")
    chains = d.offload_key_chains(trace)
    log(f"trace {trace.name}: {len(trace)} requests, {trace.num_prompt_tokens} prompt tokens")
    checks_trace = (f"{trace.name} seed {seed} ({len(trace)} requests, {trace.num_prompt_tokens} "
                    f"prompt tokens), {block_size}-token blocks, {spec} attention"
                    + (f" (window {window})" if spec != "full" else "")
                    + f", {manager_blocks} manager blocks, {offload_blocks} offload slots")
    rows: list[Row] = []
    checks: dict[str, Any] = {"trace": checks_trace}

    # -- block pool
    pool_rows: dict[str, Row] = {}

    def pool(side: d.Side) -> None:
        for name, (ns, n) in d.run_block_pool(side, pool_blocks).items():
            row = pool_rows.setdefault(name, Row("block pool", name, "blocks/s"))
            row.add(side.name, n, ns)

    if "pool" in only:
        # Each pool row times only a few milliseconds, so it gets twice the repeats.
        _alternate(2 * repeats, sides, pool, lambda: list(pool_rows.values()))
        rows += pool_rows.values()
        log("block pool done")

    # -- KV cache manager
    stats: dict[tuple[str, bool], list[d.ManagerStats]] = {}
    for events in ((False, True) if "manager" in only else ()):
        label = "events on" if events else "events off"
        r_req = Row("KV cache manager", f"chat trace, {label}", "requests/s", _TARGET)
        r_step = Row("KV cache manager", f"chat trace, {label}", "steps/s", _TARGET)

        def manager(side: d.Side, events: bool = events, r_req: Row = r_req,
                    r_step: Row = r_step) -> None:
            reqs = d.build_manager_requests(side, trace)
            st = d.run_manager_trace(side, reqs, num_blocks=manager_blocks, events=events)
            stats.setdefault((side.name, events), []).append(st)
            r_req.add(side.name, st.requests, st.ns)
            r_step.add(side.name, st.steps, st.ns)

        _alternate(repeats, sides, manager, lambda r_req=r_req, r_step=r_step: [r_req, r_step])
        a, b = stats[("kvconnector", events)][0], stats[("vllm", events)][0]
        same = a.semantics() == b.semantics()
        checks[f"manager {label}"] = {
            "same_semantics": same,
            "kvconnector": dict(zip(_SEM_FIELDS, a.semantics())),
            "vllm": dict(zip(_SEM_FIELDS, b.semantics())),
        }
        note = f"hit rate {a.hit_rate:.4f} / {b.hit_rate:.4f}"
        for r in (r_req, r_step):
            r.extra = note
            if not same:
                r.failure = "counters differ"
        rows += [r_req, r_step]
    log("KV cache manager done")

    # -- offload manager
    for policy in (("lru", "arc") if "offload" in only else ()):
        r_off = Row("CPU offload manager", f"{policy.upper()}, {offload_blocks} slots", "ops/s",
                    _TARGET)
        hit: dict[str, tuple[int, int]] = {}
        per_req: dict[str, list[int]] = {}

        def offload(side: d.Side, policy: str = policy, r_off: Row = r_off,
                    hit: dict[str, tuple[int, int]] = hit, per_req: dict[str, list[int]] = per_req) -> None:
            st = d.run_offload_trace(side, chains, policy=policy, num_blocks=offload_blocks)
            r_off.add(side.name, st.keys, st.ns)
            hit[side.name] = (st.hit_keys, st.keys)
            per_req[side.name] = st.per_request

        _alternate(repeats, sides, offload, lambda r_off=r_off: [r_off])
        (kh, kn), (vh, vn) = hit["kvconnector"], hit["vllm"]
        r_off.extra = f"hit rate {kh / kn:.4f} / {vh / vn:.4f}"
        differ = sum(a != b for a, b in zip(per_req["kvconnector"], per_req["vllm"], strict=True))
        if (kh, kn) != (vh, vn) or differ:
            # Unequal hits mean unequal work (a miss stores, a hit loads): no fair ratio.
            r_off.failure = f"hit keys differ: {kh} vs {vh} of {kn} ({differ} requests differ)"
        checks[f"offload {policy}"] = {"kvconnector hit keys": kh, "vllm hit keys": vh,
                                       "keys": kn, "requests that differ": differ,
                                       "equal": kh == vh and not differ}
        rows.append(r_off)
    log("offload done")

    # -- events
    r_enc = Row("KV events", "msgpack encode", "events/s")
    r_dec = Row("KV events", "msgpack decode", "events/s")
    last: dict[str, dict[str, Any]] = {}

    if "events" in only:
        d.run_events_interleaved(sides, chains, trace)  # warm-up, discarded
        for r in range(repeats):
            # Both sides in one call, alternating pass by pass (see run_events_interleaved).
            res = d.run_events_interleaved(sides if r % 2 == 0 else sides[::-1], chains, trace)
            for name, one in res.items():
                r_enc.add(name, one["encode"][1], one["encode"][0])
                r_dec.add(name, one["decode"][1], one["decode"][0])
                last[name] = one
        rows += [r_enc, r_dec]
        checks["event cross-decoding"] = _cross_decode(kvc, vl, last)
        log("events done")

    # -- hashing
    if "hashing" in only:
        r_hash = Row("block hashing", "chained, default hash", "blocks/s")
        inputs = d.hashing_inputs(trace)
        _alternate(repeats, sides,
                   lambda side: r_hash.add(side.name, *reversed(d.run_hashing(side, inputs))),
                   lambda: [r_hash])
        r_hash.extra = "vLLM: pickle+sha256; ours: msgpack+sha256"
        rows.append(r_hash)
    checks["wall_seconds"] = round(time.perf_counter() - t0, 1)
    return rows, checks


_SEM_FIELDS = ("requests", "steps", "prompt_tokens", "hit_tokens", "allocate_calls",
               "free_calls", "preemptions", "events")


def _cross_decode(kvc: d.Side, vl: d.Side, last: dict[str, dict[str, Any]]) -> dict[str, str]:
    # Our bytes must decode with vLLM's types and vice versa, to the same values.
    import msgspec

    out: dict[str, str] = {}
    for src, dst in ((kvc, vl), (vl, kvc)):
        _, _, decode = dst.event_codec()
        payloads, batches = last[src.name]["payloads"], last[src.name]["batches"]
        key = f"{src.name} bytes -> {dst.name} types"
        try:
            for p, b in zip(payloads, batches):
                got = decode(p)
                if msgspec.to_builtins(got) != msgspec.to_builtins(b):
                    out[key] = "MISMATCH: decoded values differ"
                    break
            else:
                out[key] = "ok"
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            out[key] = f"FAIL: {type(exc).__name__}: {exc}"
    same_bytes = all(a == b for a, b in zip(last["kvconnector"]["payloads"], last["vllm"]["payloads"]))
    out["identical bytes"] = "yes" if same_bytes else "no"
    return out


def render_table(rows: list[Row]) -> str:
    """The comparison as a markdown table (medians, ratio, target, notes)."""
    lines = [
        "| group | workload | unit | kvconnector | vLLM 0.33 | ratio | target | note |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        mark = "" if r.ratio >= r.target else " **below**"
        if r.failure:
            mark = f" **FAILED: {r.failure}**"
        lines.append(
            f"| {r.group} | {r.name} | {r.unit} | {_fmt_rate(statistics.median(r.kvc))} | "
            f"{_fmt_rate(statistics.median(r.vllm))} | {r.ratio:.2f}{mark} | {r.target:.1f} | {r.extra} |"
        )
    return "\n".join(lines)


def render_run(rows: list[Row], checks: dict[str, Any], info: dict[str, str], repeats: int) -> str:
    """A complete markdown record of one run: header, machine, table, checks."""
    head = (f"### Run {info['date']}\n\n"
            f"Machine: {info['cpu']}, {info['cores']} cores ({info['platform']}). "
            f"Python {info['python']}, torch {info['torch']}, vLLM {info['vllm']}, "
            f"msgspec {info['msgspec']}. Trace {checks.get('trace')}. Median of {repeats} "
            f"alternating repeats after one warm-up round per side (block pool "
            f"{2 * repeats}; KV events alternate pass by pass, median of 21 passes per repeat); "
            f"ratio = kvconnector / vLLM throughput. Whole run {checks.get('wall_seconds')} s.\n")
    chk = ["", "Checks:"]
    for k, v in checks.items():
        if k in ("wall_seconds", "trace"):
            continue
        if isinstance(v, dict) and "same_semantics" in v:
            chk.append(f"- {k}: identical counters = {v['same_semantics']} "
                       f"({', '.join(f'{f}={x}' for f, x in v['kvconnector'].items())})")
        elif isinstance(v, dict):
            chk.append(f"- {k}: " + "; ".join(f"{a}: {b}" for a, b in v.items()))
        else:
            chk.append(f"- {k}: {v}")
    return head + "\n" + render_table(rows) + "\n" + "\n".join(chk) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns 0, or 1 if any row failed (unequal work)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5, help="runs per side per workload (default 5)")
    p.add_argument("--trace", default="large", choices=list(d.TRACES),
                   help="trace (default large: 1000 chat requests, ~1.3M prompt tokens; "
                        "unseen: a mixed trace no benchmark was tuned on; long, short, shared, "
                        "noshare: other shapes, see _drivers.chat_trace)")
    p.add_argument("--seed", type=int, default=0, help="trace generator seed (default 0)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    p.add_argument("--spec", default="full", choices=list(d.SPECS),
                   help="manager attention layout (default full)")
    p.add_argument("--window", type=int, default=1024,
                   help="sliding window in tokens for --spec sliding/hybrid (default 1024)")
    p.add_argument("--manager-blocks", type=int, default=4096,
                   help="KV cache blocks of the manager rows (small: preemption; default 4096)")
    p.add_argument("--offload-blocks", type=int, default=4096,
                   help="CPU tier slots of the offload rows (default 4096)")
    p.add_argument("--only", default=",".join(GROUPS),
                   help=f"comma-separated row groups to run (default all: {','.join(GROUPS)})")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    p.add_argument("--record", metavar="RESULTS_MD",
                   help="append this run to the compare section of a RESULTS.md")
    args = p.parse_args(argv)
    only = tuple(g for g in args.only.split(",") if g)
    if not only or set(only) - set(GROUPS):
        p.error(f"--only {args.only!r}: valid groups are {', '.join(GROUPS)}")
    info = d.machine_info()
    print(f"# {info['cpu']} x{info['cores']}, Python {info['python']}, torch {info['torch']}, "
          f"vLLM {info['vllm']}", flush=True)
    rows, checks = compare(repeats=args.repeats, trace_size=args.trace,
                           manager_blocks=args.manager_blocks, offload_blocks=args.offload_blocks,
                           log=lambda m: print(f"  .. {m}", flush=True), seed=args.seed,
                           block_size=args.block_size, spec=args.spec, window=args.window,
                           only=only)
    text = render_run(rows, checks, info, args.repeats)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"machine": info, "repeats": args.repeats, "rows": [r.as_dict() for r in rows],
             "checks": checks}, indent=2))
    if args.record:
        d.record_section(Path(args.record), SECTION, text)
    failed = [f"{r.group} / {r.name}: {r.failure}" for r in rows if r.failure]
    for line in failed:
        print(f"FAILED ROW: {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
