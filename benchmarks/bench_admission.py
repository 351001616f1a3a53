"""Admission with and without reserving for the whole output: concurrency vs preemptions.

The scheduler alone (no model: every step samples one deterministic token per request
that reached the end of its tokens) runs the same trace twice on the same GPU pool:
once with the default admission (the tokens a request has now, as vLLM 0.33 counts)
and once with ``reserve_full_output=True`` (prompt + ``max_tokens`` must fit). Both runs
must finish the same requests with the same number of generated tokens.

Reported: steps to finish, mean and peak running requests per step, preemptions and
recomputed tokens (prompt tokens computed again after a preemption).

Usage::

    python benchmarks/bench_admission.py [--blocks 512] [--record benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _drivers as d  # noqa: E402  (path set up above)

from kvconnector_core.engine.workloads import Trace, multi_turn_chat  # noqa: E402
from kvconnector_core.kv_cache.kv_cache_spec import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from kvconnector_core.request import Request  # noqa: E402
from kvconnector_core.scheduler.output import ModelRunnerOutput  # noqa: E402
from kvconnector_core.scheduler.scheduler import Scheduler  # noqa: E402

__all__ = ["AdmissionRun", "main", "run"]

SECTION = "## Admission: whole-output reservation vs current tokens (bench_admission.py)"
BLOCK_SIZE = 16


@dataclass
class AdmissionRun:
    """What one scheduler run did."""

    steps: int = 0
    running_sum: int = 0
    peak_running: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0
    output_tokens: int = 0
    finished: int = 0

    @property
    def mean_running(self) -> float:
        """Mean number of running requests per step."""
        return self.running_sum / self.steps if self.steps else 0.0


def run(trace: Trace, num_blocks: int, reserve: bool, *, max_num_seqs: int = 64,
        budget: int = 2048, max_model_len: int = 8192) -> AdmissionRun:
    """Run ``trace`` through a model-less scheduler; arrivals are in steps."""
    spec = FullAttentionSpec(BLOCK_SIZE, 8, 128)
    cfg = KVCacheConfig(num_blocks, [KVCacheGroupSpec(["layer.0"], spec)])
    s = Scheduler(cfg, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                  max_model_len=max_model_len, scheduler_block_size=BLOCK_SIZE,
                  hash_block_size=BLOCK_SIZE, reserve_full_output=reserve)
    pending = list(trace.requests)
    st = AdmissionRun()
    i = 0
    while i < len(pending) or s.has_unfinished_requests():
        while i < len(pending) and pending[i].arrival <= st.steps:
            r = pending[i]
            s.add_request(Request(r.request_id or f"r{i}", r.prompt_token_ids, r.max_new_tokens,
                                  hash_block_size=BLOCK_SIZE))
            i += 1
        out = s.schedule()
        sampled = {}
        for rid in out.num_scheduled_tokens:
            req = s.requests[rid]
            if req.num_computed_tokens >= req.num_tokens:
                sampled[rid] = [sum(req.prompt_token_ids[:4]) % 97 + req.num_output_tokens]
        done = s.update_from_output(out, ModelRunnerOutput(
            req_ids=list(out.num_scheduled_tokens), sampled_token_ids=sampled))
        st.finished += len(done)
        st.output_tokens += sum(r.num_output_tokens for r in done)
        st.steps += 1
        st.running_sum += len(s.running)
        st.peak_running = max(st.peak_running, len(s.running))
    st.preemptions = s.stats.num_preemptions
    st.recomputed_tokens = s.stats.num_recomputed_tokens
    return st


def main(argv: Sequence[str] | None = None) -> int:
    """Run both admissions on the chat workload; print (and optionally record) the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", default="384,768", help="comma-separated GPU pool sizes")
    ap.add_argument("--record", type=Path, help="append the table to this RESULTS.md")
    args = ap.parse_args(argv)
    # Long answers relative to prompts, where the two counts differ most: 64 users x 4
    # turns, 256-token system prompt, 64-token user turns, 256 generated tokens each, all
    # arriving at step 0 (a burst: admission, not arrivals, limits concurrency).
    trace = multi_turn_chat(0, num_users=64, turns=4, system_prompt_len=256, user_turn_len=64,
                            max_new_tokens=256, vocab=32000, user_interval=0.0,
                            turn_interval=0.0, name="chat_long_answers_burst")
    info = d.machine_info()
    lines = [f"### Run {info['date']}", "",
             f"Machine: {info['cpu']}, {info['cores']} cores. Python {info['python']}. Trace "
             f"`{trace.name}` ({len(trace.requests)} requests at step 0, 256 output tokens each), "
             f"{BLOCK_SIZE}-token blocks, at most 64 running, 2048-token step budget; the "
             "scheduler alone (no model).", "",
             "| GPU blocks | admission | steps | mean running | peak running | preemptions "
             "| recomputed tokens | finished |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for blocks in (int(b) for b in args.blocks.split(",")):
        runs = {name: run(trace, blocks, reserve) for name, reserve in
                (("current tokens (default, vLLM 0.33)", False), ("reserve whole output", True))}
        a, b = runs.values()
        if (a.finished, a.output_tokens) != (b.finished, b.output_tokens):
            msg = f"the two admissions did different work: {a} vs {b}"
            raise SystemExit(msg)
        for name, st in runs.items():
            lines.append(f"| {blocks} | {name} | {st.steps} | {st.mean_running:.1f} | "
                         f"{st.peak_running} | {st.preemptions} | {st.recomputed_tokens:,} | "
                         f"{st.finished} |")
    return d.emit_table(lines, args.record, SECTION)


if __name__ == "__main__":
    raise SystemExit(main())
