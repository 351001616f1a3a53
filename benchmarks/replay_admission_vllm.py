"""Differential admission check: vLLM 0.33's KVCacheManager against ours, step by step.

Issue 12 cites 125 recorded vLLM KV-cache-manager traces (120 diverged at the first
admission before the admission fix); they are not in the repository. This rebuilds the
check: for each seed, a seeded random request stream (shared prefixes, random prompt and
output lengths, arrivals spread over steps) drives vLLM 0.33's ``KVCacheManager`` and
kvconnector's with the same calls, through one small FCFS scheduler loop (chunked
prefill under a token budget, preemption of a running request whose allocation fails,
admission with ``full_sequence_must_fit`` as vLLM's scheduler uses it by default). The
seeds cycle through four KV cache layouts (full attention, sliding window, chunked
local, hybrid full + sliding window) and several pool sizes, windows and budgets.

Compared at every call: the prefix-cache hit length (``get_computed_blocks``), whether
``allocate_slots`` admits (None or not), the number of new blocks per group, and the
free block count after every step. A seed *matches* when every comparison of its run
agrees; the first difference is reported otherwise.

Run in the vLLM venv::

    VLLM_TARGET_DEVICE=cpu .vllm-venv/bin/python benchmarks/replay_admission_vllm.py [--seeds 125]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core import kv_cache_manager as vkm  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1 import kv_cache_interface as vkv  # noqa: E402
from vllm.v1.request import Request as VRequest  # noqa: E402
from vllm.v1.request import RequestStatus as VStatus  # noqa: E402

from kvconnector_core.kv_cache import kv_cache_spec as kspec  # noqa: E402
from kvconnector_core.kv_cache.kv_cache_manager import KVCacheManager  # noqa: E402
from kvconnector_core.request import Request as KRequest  # noqa: E402
from kvconnector_core.request import RequestStatus as KStatus  # noqa: E402

init_none_hash(sha256)

KINDS = ("full", "sliding", "chunked", "hybrid")
BLOCK = 16
EOS = 2


@dataclass(frozen=True)
class Scenario:
    """One seed's layout and workload parameters."""

    seed: int
    kind: str
    num_blocks: int
    window: int
    chunk: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int = 512


@dataclass
class Outcome:
    """What one seed's replay found."""

    scenario: Scenario
    steps: int = 0
    admissions: int = 0
    rejections: int = 0
    preemptions: int = 0
    dropped: int = 0  # requests that could never fit the pool (both managers agreed)
    hit_tokens: int = 0
    divergence: str | None = None  # the first difference, None if every step matched
    checks: int = 0

    @property
    def matched(self) -> bool:
        """Every comparison agreed."""
        return self.divergence is None


def scenario(seed: int) -> Scenario:
    """The seed's layout: kinds cycle; pool size, window, chunk and budget are drawn."""
    rng = random.Random(seed)
    return Scenario(seed, KINDS[seed % len(KINDS)], num_blocks=rng.choice([24, 40, 64, 128]),
                    window=rng.choice([32, 48, 64, 100]), chunk=rng.choice([64, 128]),
                    max_num_batched_tokens=rng.choice([64, 128, 256]), max_num_seqs=rng.choice([4, 8]))


def _spec_args(kind: str, sc: Scenario) -> list[tuple[str, dict[str, Any]]]:
    shape = {"block_size": BLOCK, "num_kv_heads": 1, "head_size": 8}
    full = ("full", shape)
    sliding = ("sliding", {**shape, "sliding_window": sc.window})
    chunked = ("chunked", {**shape, "attention_chunk_size": sc.chunk})
    return {"full": [full], "sliding": [sliding], "chunked": [chunked],
            "hybrid": [full, sliding]}[kind]


def _managers(sc: Scenario, reserve_full_output: bool) -> tuple[Any, KVCacheManager]:
    v_cls = {"full": vkv.FullAttentionSpec, "sliding": vkv.SlidingWindowSpec,
             "chunked": vkv.ChunkedLocalAttentionSpec}
    k_cls = {"full": kspec.FullAttentionSpec, "sliding": kspec.SlidingWindowSpec,
             "chunked": kspec.ChunkedLocalAttentionSpec}
    specs = _spec_args(sc.kind, sc)
    v_groups = [vkv.KVCacheGroupSpec([f"l{i}"], v_cls[k](**a, dtype=torch.float16))
                for i, (k, a) in enumerate(specs)]
    k_groups = [kspec.KVCacheGroupSpec([f"l{i}"], k_cls[k](**a, dtype="float16"))
                for i, (k, a) in enumerate(specs)]
    v_mgr = vkm.KVCacheManager(vkv.KVCacheConfig(num_blocks=sc.num_blocks, kv_cache_tensors=[],
                                                 kv_cache_groups=v_groups),
                               max_model_len=sc.max_model_len, scheduler_block_size=BLOCK,
                               hash_block_size=BLOCK, max_in_flight_tokens=sc.max_num_batched_tokens,
                               enable_caching=True)
    k_mgr = KVCacheManager(kspec.KVCacheConfig(sc.num_blocks, k_groups), sc.max_model_len,
                           sc.max_num_batched_tokens, scheduler_block_size=BLOCK, hash_block_size=BLOCK,
                           reserve_full_output=reserve_full_output)
    return v_mgr, k_mgr


@dataclass
class _Pair:
    """One request as both engines see it."""

    v: Any
    k: KRequest
    max_tokens: int
    arrival: int
    outputs: int = 0
    tokens: list[int] = field(default_factory=list)


def _stream(sc: Scenario) -> list[_Pair]:
    rng = random.Random(sc.seed * 7919 + 1)
    hasher = get_request_block_hasher(BLOCK, sha256)
    prefixes = [[rng.randrange(10, 30_000) for _ in range(BLOCK * rng.randrange(1, 8))] for _ in range(4)]
    pairs, arrival = [], 0
    for i in range(rng.randrange(16, 40)):
        prompt = rng.choice(prefixes) + [rng.randrange(10, 30_000) for _ in range(rng.randrange(1, 120))]
        max_tokens = rng.randrange(1, 80)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        params.update_from_generation_config({}, EOS)
        v = VRequest(f"r{i}", list(prompt), params, pooling_params=None, mm_features=None,
                     block_hasher=hasher)
        k = KRequest(f"r{i}", list(prompt), max_tokens, hash_block_size=BLOCK)
        arrival += rng.choice([0, 0, 1, 2, 4])
        pairs.append(_Pair(v, k, max_tokens, arrival))
    return pairs


class _Diverged(Exception):
    pass


def _blocks_per_group(blocks: Any) -> list[int] | None:
    return None if blocks is None else [len(g) for g in blocks.blocks]


def replay(seed: int, *, reserve_full_output: bool = False, max_steps: int = 3000) -> Outcome:
    """Run one seed; stops at the first difference. ``reserve_full_output`` runs our
    manager with the option that counts prompt + ``max_tokens`` at admission (what ours
    did before issue 12): a control that must diverge."""
    sc = scenario(seed)
    out = Outcome(sc)
    v_mgr, k_mgr = _managers(sc, reserve_full_output)
    pending = _stream(sc)
    waiting: list[_Pair] = []
    running: list[_Pair] = []

    def check(what: str, v: Any, k: Any) -> None:
        out.checks += 1
        if v != k:
            msg = f"step {out.steps}: {what}: vLLM {v!r}, ours {k!r}"
            raise _Diverged(msg)

    def preempt(p: _Pair) -> None:
        v_mgr.free(p.v)
        k_mgr.free(p.k)
        p.v.num_computed_tokens = p.k.num_computed_tokens = 0
        p.v.status, p.k.status = VStatus.PREEMPTED, KStatus.PREEMPTED
        running.remove(p)
        waiting.insert(0, p)
        out.preemptions += 1

    try:
        while pending or waiting or running:
            if out.steps >= max_steps:
                raise _Diverged(f"still running after {max_steps} steps")
            while pending and pending[0].arrival <= out.steps:
                waiting.append(pending.pop(0))
            budget = sc.max_num_batched_tokens
            scheduled: list[tuple[_Pair, int]] = []
            preempted = False
            for p in list(running):
                n = min(p.k.num_tokens - p.k.num_computed_tokens, budget)
                if n <= 0:
                    continue
                vb, kb = v_mgr.allocate_slots(p.v, n), k_mgr.allocate_slots(p.k, n)
                check(f"allocate_slots({p.k.request_id}, {n}) running", _blocks_per_group(vb),
                      _blocks_per_group(kb))
                if kb is None:
                    preempt(p)
                    preempted = True
                    continue
                scheduled.append((p, n))
                budget -= n
            while not preempted and waiting and budget > 0 and len(running) < sc.max_num_seqs:
                p = waiting[0]
                v_blocks, v_hit, _ = v_mgr.get_computed_blocks(p.v)
                k_blocks, k_hit = k_mgr.get_computed_blocks(p.k)
                check(f"hit tokens of {p.k.request_id}", v_hit, k_hit)
                n = min(p.k.num_tokens - k_hit, budget)
                vb = v_mgr.allocate_slots(p.v, n, v_hit, v_blocks, full_sequence_must_fit=True)
                kb = k_mgr.allocate_slots(p.k, n, k_hit, k_blocks, full_sequence_must_fit=True)
                check(f"admission of {p.k.request_id} ({p.k.num_tokens} tokens, hit {k_hit}, {n} new)",
                      _blocks_per_group(vb), _blocks_per_group(kb))
                if kb is None:
                    out.rejections += 1
                    if not running:
                        # Nothing will ever free a block: the request can never fit (vLLM
                        # refuses such a max_model_len at startup). Both agreed; drop it.
                        waiting.pop(0)
                        out.dropped += 1
                        continue
                    break
                out.admissions += 1
                out.hit_tokens += k_hit
                waiting.pop(0)
                p.v.num_computed_tokens = p.k.num_computed_tokens = k_hit
                p.v.status, p.k.status = VStatus.RUNNING, KStatus.RUNNING
                running.append(p)
                scheduled.append((p, n))
                budget -= n
            for p, n in scheduled:
                p.v.num_computed_tokens += n
                p.k.num_computed_tokens += n
                if p.k.num_computed_tokens < p.k.num_tokens:
                    continue  # prefill goes on
                token = 1000 + p.outputs
                p.v.append_output_token_ids(token)
                p.k.append_output_token_ids(token)
                p.outputs += 1
                if p.outputs >= p.max_tokens:
                    v_mgr.free(p.v)
                    k_mgr.free(p.k)
                    running.remove(p)
            out.steps += 1
            check("free blocks", v_mgr.block_pool.get_num_free_blocks(), k_mgr.block_pool.get_num_free_blocks())
    except _Diverged as exc:
        out.divergence = str(exc)
    return out


def main(argv: list[str] | None = None) -> int:
    """Replay ``--seeds`` seeds; print a summary table and the first divergences."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=125)
    parser.add_argument("--reserve-full-output", action="store_true",
                        help="ours counts prompt + max_tokens at admission (the control)")
    args = parser.parse_args(argv)
    outcomes = [replay(s, reserve_full_output=args.reserve_full_output) for s in range(args.seeds)]
    matched = sum(o.matched for o in outcomes)
    first_admission = sum(1 for o in outcomes if o.divergence and ": admission of" in o.divergence
                          and o.admissions == 0)
    mode = "reserve_full_output=True" if args.reserve_full_output else "default admission"
    print(f"{matched} of {len(outcomes)} seeds match vLLM 0.33's KVCacheManager step by step ({mode}); "
          f"{first_admission} diverge at the first admission\n")
    print("| layout | seeds | match | steps | admissions | rejections | preemptions | never fit | hit tokens "
          "| checks |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for kind in KINDS:
        group = [o for o in outcomes if o.scenario.kind == kind]
        print(f"| {kind} | {len(group)} | {sum(o.matched for o in group)} | {sum(o.steps for o in group)} "
              f"| {sum(o.admissions for o in group)} | {sum(o.rejections for o in group)} "
              f"| {sum(o.preemptions for o in group)} | {sum(o.dropped for o in group)} "
              f"| {sum(o.hit_tokens for o in group)} "
              f"| {sum(o.checks for o in group)} |")
    for o in outcomes:
        if not o.matched:
            print(f"seed {o.scenario.seed} ({o.scenario}): {o.divergence}")
    return 0 if matched == len(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
