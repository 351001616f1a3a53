"""A minimal stand-in scheduler that drives a ModelRunner with hand-built SchedulerOutputs.

No prefix caching, no eviction: each request gets fresh blocks from a shuffled free list
(so block placement differs between runs) and is prefilled in chunks of at most
``chunk`` tokens per step across the batch. Used by the model and worker tests to check
the worker on its own, independently of the real scheduler.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from kvconnector_core.kv_cache.kv_cache_spec import KVCacheConfig, get_kv_cache_config
from kvconnector_core.scheduler.output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from kvconnector_core.worker.model import ModelConfig
from kvconnector_core.worker.model_runner import ModelRunner

__all__ = ["HarnessRequest", "make_kv_cache_config", "run_requests"]


def make_kv_cache_config(
    model_config: ModelConfig,
    block_size: int = 4,
    num_blocks: int = 400,
    max_model_len: int = 256,
    max_num_batched_tokens: int = 64,
) -> KVCacheConfig:
    """KV cache config for ``model_config`` with ``num_blocks`` blocks."""
    specs = model_config.kv_cache_specs(block_size)
    budget = num_blocks * sum(s.page_size_bytes for s in specs.values())
    return get_kv_cache_config(specs, budget, max_model_len, max_num_batched_tokens)


@dataclass
class HarnessRequest:
    """Scheduler-side view of one request in the harness."""

    req_id: str
    tokens: list[int]
    num_prompt: int
    block_ids: list[list[int]]
    num_computed: int = 0
    sent: bool = False
    output: list[int] = field(default_factory=list)


def run_requests(
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    model_config: ModelConfig | None = None,
    chunk: int = 1000,
    block_seed: int = 0,
    block_size: int = 4,
    runner: ModelRunner | None = None,
    before_step: Callable[[int, ModelRunner, dict[str, HarnessRequest]], None] | None = None,
    outputs: list[ModelRunnerOutput] | None = None,
) -> dict[str, list[int]]:
    """Generate ``max_new_tokens`` for every prompt; return outputs by request id ``r<i>``.

    Args:
        prompts: the prompts.
        max_new_tokens: tokens to generate per request.
        model_config: the model (default ``ModelConfig()``).
        chunk: token budget of one step (prefills are chunked to fit).
        block_seed: shuffles the free block list.
        block_size: tokens per block.
        runner: reuse a runner (its config wins).
        before_step: called as ``before_step(step, runner, requests)`` before each step.
        outputs: if given, every ModelRunnerOutput is appended to it.
    """
    model_config = model_config or ModelConfig()
    if runner is None:
        runner = ModelRunner(model_config, make_kv_cache_config(model_config, block_size))
    cfg = runner.kv_cache_config
    bs = cfg.kv_cache_groups[0].kv_cache_spec.block_size
    num_groups = len(cfg.kv_cache_groups)
    free = list(range(1, cfg.num_blocks))
    random.Random(block_seed).shuffle(free)
    reqs = {
        f"r{i}": HarnessRequest(f"r{i}", list(p), len(p), [[] for _ in range(num_groups)])
        for i, p in enumerate(prompts)
    }
    step = 0
    while any(len(r.output) < max_new_tokens for r in reqs.values()):
        if before_step is not None:
            before_step(step, runner, reqs)
        budget = chunk
        new: list[NewRequestData] = []
        cached = CachedRequestData.make_empty()
        scheduled: dict[str, int] = {}
        for r in reqs.values():
            if len(r.output) >= max_new_tokens or budget == 0:
                continue
            n = min(len(r.tokens) - r.num_computed, budget)
            budget -= n
            needed = -(-(r.num_computed + n) // bs)
            added = []
            for g in range(num_groups):
                more = [free.pop() for _ in range(needed - len(r.block_ids[g]))]
                r.block_ids[g] += more
                added.append(more)
            scheduled[r.req_id] = n
            if not r.sent:
                r.sent = True
                new.append(
                    NewRequestData(
                        r.req_id,
                        r.tokens[: r.num_prompt],
                        tuple(list(b) for b in r.block_ids),
                        r.num_computed,
                    )
                )
            else:
                cached.req_ids.append(r.req_id)
                cached.new_token_ids.append([])
                cached.new_block_ids.append(tuple(added))
                cached.num_computed_tokens.append(r.num_computed)
        so = SchedulerOutput(new, cached, scheduled, sum(scheduled.values()), set(), set())
        out = runner.execute_model(so)
        if outputs is not None:
            outputs.append(out)
        for req_id, n in scheduled.items():
            r = reqs[req_id]
            r.num_computed += n
            for token in out.sampled_token_ids[req_id]:
                r.tokens.append(token)
                r.output.append(token)
        step += 1
    return {k: r.output for k, r in reqs.items()}
