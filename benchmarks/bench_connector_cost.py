"""Benchmark: what a connector costs the engine per step, on CPU.

Runs the engine the way ``kvconnector run`` does (default workload ``mixed``, its GPU pool
sizing, the tiny model on CPU with one thread) once per variant and repeat, in rotated
order: without a connector, with the default ``cpu_offload`` connector, and with it and its
``copy_thread`` setting (the copies on the mover's thread; the thread's CPU time is
reported beside). Both sides get the same ``EngineConfig.enable_kv_cache_events`` (the
default, off without a publisher, or ``--kv-events``). The run is refused unless every
variant produced the same outputs and the connector variants the same hits and bytes.
Timers wrap, without changing
them, the scheduler's ``schedule`` and ``update_from_output`` (which call the
scheduler-side hooks through the guard) and every worker-side hook of the guard the model
runner calls (so the guard's own cost counts). Times are the engine thread's CPU time
(``time.thread_time_ns``): on a machine shared with other jobs, wall time mostly measures
the neighbours (the same run read 380-540 us/step wall, 142-155 us/step CPU). On CPU the
connector copies blocks on this thread, so the copies count too. Reading the thread clock
costs about a microsecond here, so the timers' own cost, calibrated in the same process on
a no-op, is subtracted per timed call. Each run starts from a collected, frozen heap (as
vLLM's engine core freezes its start-up heap). Reported per engine step:

* ``scheduler`` - ``schedule + update_from_output``, connector hooks included;
* ``scheduler hooks`` - the part of it spent inside the connector's scheduler-side hooks;
* ``worker hooks`` - the worker-side hooks (the model runner calls them);
* the ratio *(scheduler + worker hooks) with the connector / scheduler without*
  (target <= 1.1; the forward is left out on both sides);
* the mover thread's CPU time (``copy_thread``) and each run's wall time (forward included).

Second table: connector cost per request against prompt length. Each row runs N requests
with unique prompts of L tokens, then the same N prompts again (so the second half loads
from the CPU tier, sized to hold every prompt twice over); the connector's hook time is
divided by requests, by request-steps (each step a request is scheduled in) and by prompt
blocks. ``--per-hook`` prints instead each hook's time at the guard and inside the
connector. Flat per request-step and per
block means no hook rescans a request's whole history each step.

    python benchmarks/bench_connector_cost.py [--repeats 5] [--json out.json] [--kv-events]

Nothing is asserted; the numbers go to RESULTS.md.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgspec  # noqa: E402
import torch  # noqa: E402
from _cost_clock import _Clock, _mover_thread_ns  # noqa: E402

from kvconnector_core.cli import run_cmd  # noqa: E402
from kvconnector_core.engine.engine import Engine, EngineConfig  # noqa: E402
from kvconnector_core.engine.workloads import Trace, TraceRequest, get_workload  # noqa: E402

__all__ = ["main", "measure"]

SCHEDULER_HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                   "update_connector_output", "request_finished", "take_events",
                   "get_kv_connector_stats")
WORKER_HOOKS = ("bind_connector_metadata", "handle_preemptions", "start_load_kv",
                "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_finished",
                "get_block_ids_with_load_errors", "get_kv_connector_stats",
                "get_kv_connector_kv_cache_events", "build_connector_worker_meta",
                "clear_connector_metadata")


def _sizing(trace: Trace) -> dict[str, Any]:
    # The same pool and length sizing as `kvconnector run` (see run_cmd.main).
    max_model_len = max(512, 16 + max(len(r.prompt_token_ids) + r.max_new_tokens for r in trace))
    sizing = EngineConfig(max_num_batched_tokens=run_cmd.MAX_NUM_BATCHED_TOKENS,
                          max_model_len=max_model_len)
    blocks = max(run_cmd.DEFAULT_NUM_GPU_BLOCKS,
                 sizing.min_num_gpu_blocks + -(-run_cmd.MAX_NUM_BATCHED_TOKENS // sizing.block_size))
    return dict(num_gpu_blocks=blocks, max_num_batched_tokens=run_cmd.MAX_NUM_BATCHED_TOKENS,
                max_num_seqs=run_cmd.MAX_NUM_SEQS, device="cpu", max_model_len=max_model_len)


@dataclass(frozen=True)
class Variant:
    """One side of the comparison: with or without the connector, and how it runs."""

    label: str
    connector: bool
    copy_thread: bool = False  # the offload connector's copy_thread setting


NO_CONNECTOR = Variant("no connector", connector=False)
OFFLOAD = Variant("cpu_offload", connector=True)
OFFLOAD_THREAD = Variant("cpu_offload, copy_thread", connector=True, copy_thread=True)


def measure(trace: Trace, variant: Variant = OFFLOAD, hooks: bool = False,
            events: bool | None = None, cpu_blocks: int | None = None) -> dict[str, Any]:
    """Run ``trace`` once; return step count, request-steps, per-label CPU microseconds,
    the mover thread's CPU microseconds, the run's wall seconds and what the run did
    (outputs digest, hit and byte counts: the sides must agree).

    ``hooks``: also time the scheduler-side hooks inside the scheduler's calls;
    ``events``: ``EngineConfig.enable_kv_cache_events`` (None: the default, off without
    a publisher); both sides of a comparison get the same. ``cpu_blocks``: the CPU tier's
    size in chunks (default: ``kvconnector run``'s, four times the GPU pool).
    """
    base = _sizing(trace)
    connector = None
    if variant.connector:
        args = argparse.Namespace(config=None, connector=None, tier=[], cpu_blocks=cpu_blocks)
        connector = run_cmd._connector_config(args, base["num_gpu_blocks"])  # noqa: SLF001
        if variant.copy_thread:
            connector = msgspec.structs.replace(
                connector, extra_config={**connector.extra_config, "copy_thread": True})
    clock = _Clock()
    with Engine(EngineConfig(**base, connector=connector, enable_kv_cache_events=events)) as engine:
        clock.wrap(engine.scheduler, "schedule", "scheduler")
        clock.wrap(engine.scheduler, "update_from_output", "scheduler")
        clock.wrap(engine.scheduler, "take_events", "scheduler")  # the engine calls it per step
        if engine.scheduler_connector is not None:
            if hooks:  # inside the scheduler's calls: only when the split is asked for
                for name in SCHEDULER_HOOKS:
                    clock.wrap(engine.scheduler.connector, name, "scheduler hooks")
            guarded = engine.model_runner.connector  # the guard the runner calls
            for name in (*WORKER_HOOKS, "get_transfer_results"):
                clock.wrap(guarded, name, "worker hooks")
        request_steps = 0
        schedule = engine.scheduler.schedule

        def counting_schedule() -> Any:
            nonlocal request_steps
            out = schedule()
            request_steps += len(out.num_scheduled_tokens)
            return out

        engine.scheduler.schedule = counting_schedule
        # As vLLM's engine core does after start-up (freeze_gc_heap): the heap built so
        # far is frozen, so a full collection scans only what the run allocates. Without
        # it a full collection of the whole process (~40 ms here) lands in a random timed
        # hook now and then. Young collections caused by the run still count.
        gc.collect()
        gc.freeze()
        mover0 = _mover_thread_ns()
        t0 = time.perf_counter()
        try:
            result = engine.run(trace)
        finally:
            wall = time.perf_counter() - t0
            mover = _mover_thread_ns() - mover0  # before the engine closes: the thread ends there
            gc.unfreeze()
        steps = engine.num_steps
    nested = {"scheduler": ("scheduler hooks",)}
    out: dict[str, Any] = {label: clock.corrected_us(label, nested.get(label, ())) for label in clock.calls}
    m = result.metrics
    out.update(steps=steps, request_steps=request_steps, requests=len(trace), wall_s=wall,
               mover_thread_us=mover / 1e3, connector_hit_tokens=m.connector_hit_tokens,
               bytes_stored=m.bytes_stored, bytes_loaded=m.bytes_loaded,
               outputs=hashlib.sha256(json.dumps(result.outputs, sort_keys=True).encode()).hexdigest()[:16])
    return out


def _alternating(trace: Trace, variants: list[Variant], repeats: int, events: bool | None
                 ) -> dict[str, list[dict[str, Any]]]:
    """``repeats`` runs of each variant, in rotated order per repeat, after a warm-up."""
    runs: dict[str, list[dict[str, Any]]] = {v.label: [] for v in variants}
    for v in variants:  # warm-up: imports, registry, allocator, the mover's thread
        measure(trace, v, events=events)
    for r in range(repeats):
        for v in variants[r % len(variants):] + variants[:r % len(variants)]:
            runs[v.label].append(measure(trace, v, events=events))
    _check_same_work(runs, variants)
    return runs


def _check_same_work(runs: dict[str, list[dict[str, Any]]], variants: list[Variant]) -> None:
    """Every run produced the same outputs, and every connector run the same hits and
    bytes (the harness compares equal work, or refuses)."""
    digests = {r["outputs"] for v in variants for r in runs[v.label]}
    work = {(r["connector_hit_tokens"], r["bytes_stored"], r["bytes_loaded"])
            for v in variants if v.connector for r in runs[v.label]}
    if len(digests) != 1 or len(work) > 1:
        msg = f"the compared runs did different work: outputs {sorted(digests)}, (hits, stored, loaded) {sorted(work)}"
        raise SystemExit(msg)


def _med(runs: list[dict[str, Any]], key: str, per: Callable[[dict[str, Any]], float]) -> float:
    return statistics.median(r.get(key, 0.0) / per(r) for r in runs)


def step_table(repeats: int, events: bool | None = None, copy_thread: bool = True
               ) -> tuple[str, dict[str, Any]]:
    """Per-step cost on the default workload, without the connector and with it (and
    with its copy thread), alternating."""
    trace = get_workload(run_cmd.DEFAULT_WORKLOAD, 0)
    variants = [NO_CONNECTOR, OFFLOAD] + ([OFFLOAD_THREAD] if copy_thread else [])
    runs = _alternating(trace, variants, repeats, events)
    per_step = lambda r: r["steps"]  # noqa: E731
    base_runs = runs[NO_CONNECTOR.label]
    base = _med(base_runs, "scheduler", per_step)
    base_wall = statistics.median(r["wall_s"] for r in base_runs)
    lines = [("| run | steps | scheduler us/step | of which scheduler hooks | worker hooks us/step "
              "| scheduler + worker hooks us/step | x no connector | spread (paired runs) "
              "| mover thread CPU us/step | run wall ms | wall x no connector |"),
             "|---|---|---|---|---|---|---|---|---|---|---|",
             (f"| no connector | {base_runs[0]['steps']} | {base:.1f} | - | - | {base:.1f} | 1.00 | - "
              f"| - | {base_wall * 1e3:.0f} | 1.00 |")]
    split: dict[str, list[dict[str, Any]]] = {}
    for v in variants[1:]:
        vr = runs[v.label]
        sched = _med(vr, "scheduler", per_step)
        worker = _med(vr, "worker hooks", per_step)
        # The scheduler-side split comes from separate runs: timing hooks inside the
        # scheduler's calls would add the timers' cost to the ratio's numerator.
        split[v.label] = [measure(trace, v, hooks=True, events=events) for _ in range(max(3, repeats // 2))]
        hooks = _med(split[v.label], "scheduler hooks", per_step)
        totals = [(r["scheduler"] + r.get("worker hooks", 0.0)) / r["steps"] for r in vr]
        pairs = sorted(t / (b["scheduler"] / b["steps"]) for t, b in zip(totals, base_runs))
        total = statistics.median(totals)
        wall = statistics.median(r["wall_s"] for r in vr)
        mover = _med(vr, "mover_thread_us", per_step)
        lines.append(f"| {v.label} | {vr[0]['steps']} | {sched:.1f} | {hooks:.1f} | {worker:.1f} "
                     f"| {total:.1f} | {total / base:.2f} | {pairs[0]:.2f}-{pairs[-1]:.2f} "
                     f"| {mover:.1f} | {wall * 1e3:.0f} | {wall / base_wall:.2f} |")
    return "\n".join(lines), {"trace": trace.name, "runs": runs, "split": split, "events": events,
                              "timer_ns": {"inner": _Clock.inner, "outer": _Clock.outer}}


def hook_table(repeats: int, events: bool | None = None) -> str:
    """Per hook and engine step: the time at the guard (what the engine pays) and inside the
    connector's role object (``scheduler_side`` / ``worker_side``); the rest is the guard
    and the facade. Both are timed in the same run (the inner timer's cost is subtracted
    from the outer one), ``cpu_offload`` on the default workload, median of ``repeats``."""
    trace = get_workload(run_cmd.DEFAULT_WORKLOAD, 0)
    sched = list(SCHEDULER_HOOKS)
    work = [h for h in WORKER_HOOKS if h not in ("wait_for_layer_load", "save_kv_layer")]
    work.append("get_transfer_results")
    runs = []
    for r in range(repeats + 1):  # the first is a warm-up
        base = _sizing(trace)
        args = argparse.Namespace(config=None, connector=None, tier=[], cpu_blocks=None)
        config = run_cmd._connector_config(args, base["num_gpu_blocks"])  # noqa: SLF001
        clock = _Clock()
        with Engine(EngineConfig(**base, connector=config, enable_kv_cache_events=events)) as engine:
            guards = (("scheduler", engine.scheduler.connector, sched, "scheduler_side"),
                      ("worker", engine.model_runner.connector, work, "worker_side"))
            for side, guard, names, role in guards:
                for name in names:
                    clock.wrap(guard, name, f"{side}|{name}")
                    clock.wrap(getattr(guard.connector, role), name, f"{side}|{name}|inner")
            gc.collect()
            gc.freeze()
            try:
                engine.run(trace)
            finally:
                gc.unfreeze()
            steps = engine.num_steps
        if r:
            runs.append({label: (clock.corrected_us(label, (label + "|inner",)) / steps,
                                 clock.calls[label] / steps) for label in clock.calls})
    rows = []
    for label in runs[0]:
        if label.endswith("|inner"):
            continue
        outer = statistics.median(run.get(label, (0.0, 0.0))[0] for run in runs)
        inner = statistics.median(run.get(label + "|inner", (0.0, 0.0))[0] for run in runs)
        rows.append((outer, inner, label, runs[0][label][1]))
    rows.sort(reverse=True)
    lines = ["| side | hook | us/step at the guard | of which the connector | guard + facade | calls/step |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {label.split('|')[0]} | {label.split('|')[1]} | {o:.1f} | {i:.1f} | {o - i:.1f} | {n:.2f} |"
              for o, i, label, n in rows]
    lines.append(f"| | total | {sum(r[0] for r in rows):.1f} | {sum(r[1] for r in rows):.1f} "
                 f"| {sum(r[0] - r[1] for r in rows):.1f} | |")
    return "\n".join(lines)


def length_table(repeats: int, lengths: list[int], num_requests: int, events: bool | None = None
                 ) -> tuple[str, dict[str, Any]]:
    """Connector hook time per request, request-step and prompt block, by prompt length."""
    lines = [("| prompt tokens | requests | steps | tokens served by the connector | hook us / request "
              "| hook us / request-step | hook us / prompt block |"), "|---|---|---|---|---|---|---|"]
    data: dict[str, Any] = {}
    gen = torch.Generator().manual_seed(0)
    vocab = EngineConfig().model.vocab_size
    for length in lengths:
        prompts = [torch.randint(0, vocab, (length,), generator=gen).tolist()
                   for _ in range(num_requests)]
        reqs = [TraceRequest(arrival=float(i), prompt_token_ids=p, max_new_tokens=4)
                for i, p in enumerate(prompts + prompts)]
        trace = Trace(name=f"unique_{length}_twice", requests=reqs)
        # A CPU tier that holds every prompt (the default, four times the GPU pool, holds
        # fewer than 8 long prompts: LRU would evict each before its repeat came).
        runs = [measure(trace, OFFLOAD, hooks=True, events=events, cpu_blocks=4 * num_requests * length // 16)
                for _ in range(repeats)]
        hooks = [r.get("scheduler hooks", 0.0) + r.get("worker hooks", 0.0) for r in runs]
        blocks = 2 * num_requests * length / EngineConfig().block_size
        med = statistics.median
        lines.append(f"| {length} | {2 * num_requests} | {runs[0]['steps']} | {runs[0]['connector_hit_tokens']} | "
                     f"{med(h / r['requests'] for h, r in zip(hooks, runs)):.0f} | "
                     f"{med(h / r['request_steps'] for h, r in zip(hooks, runs)):.1f} | "
                     f"{med(h / blocks for h in hooks):.2f} |")
        data[str(length)] = runs
    return "\n".join(lines), data


def main(argv: list[str] | None = None) -> int:
    """Run both tables; print them (and write JSON when asked)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--json", default=None)
    p.add_argument("--kv-events", action="store_true",
                   help="both sides build KV events (EngineConfig.enable_kv_cache_events=True); "
                        "default: the engine's default, off without a publisher")
    p.add_argument("--lengths-only", action="store_true", help="only the table by prompt length")
    p.add_argument("--per-hook", action="store_true",
                   help="only the per-hook table (at the guard and inside the connector)")
    p.add_argument("--no-copy-thread", action="store_true",
                   help="leave out the cpu_offload run with copy_thread")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # as `kvconnector run` does on CPU
    t0 = time.perf_counter()
    _Clock.calibrate()
    print(f"timer cost per timed call: {_Clock.inner:.0f} ns own, {_Clock.outer:.0f} ns to an enclosing call")
    if args.per_hook:
        print(hook_table(max(3, args.repeats), events=True if args.kv_events else None))
        return 0
    step_data: dict[str, Any] = {}
    if not args.lengths_only:
        steps, step_data = step_table(args.repeats, events=True if args.kv_events else None,
                                      copy_thread=not args.no_copy_thread)
        print(steps, flush=True)
    lengths, length_data = length_table(max(1, args.repeats // 2), args.lengths, args.requests,
                                        events=True if args.kv_events else None)
    print(lengths)
    print(f"(median of {args.repeats} alternating repeats after a warm-up; {time.perf_counter() - t0:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps({"steps": step_data, "lengths": length_data}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
