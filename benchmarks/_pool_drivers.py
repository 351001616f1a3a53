"""The block-pool and KV-cache-manager workloads (re-exported by ``_drivers``, which
documents them)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import _sides
from _measure import stopwatch
from _sides import Side

__all__ = ["ManagerStats", "build_manager_requests", "run_block_pool", "run_manager_trace"]


def _pool_requests(side: Side, num_batches: int, batch: int, salt: int) -> list[Any]:
    # Distinct prompts so every block has its own hash; ``salt`` separates the
    # "cached" hashes from the "miss" hashes.
    base = salt * num_batches * batch * _sides.BLOCK_SIZE
    out = []
    for i in range(num_batches):
        lo = base + i * batch * _sides.BLOCK_SIZE
        out.append(side.new_request(f"pool-{salt}-{i}", list(range(lo, lo + batch * _sides.BLOCK_SIZE)), 1))
    return out


def run_block_pool(side: Side, num_blocks: int = 65537, batch: int = 16) -> dict[str, tuple[int, int]]:
    """Block pool primitives on a fresh pool, each timed on its own.

    The pool holds ``num_blocks`` blocks (block 0 is the null block); the usable blocks are
    handled in batches of ``batch`` (a typical request's allocation), the way the KV cache
    manager calls the pool. Rows, in order (each starts from the state the previous left):

    ``allocate`` (fresh, uncached blocks), ``free uncached`` (reverse order, as managers
    free), ``allocate`` again (untimed), ``cache full blocks``, ``free cached``,
    ``lookup hit``, ``lookup miss``, ``touch`` (revives cached free blocks), ``free`` again
    (untimed), ``allocate evicting`` (every block popped is cached and gets evicted).

    Args:
        side: the implementation.
        num_blocks: pool size including the null block; ``num_blocks - 1`` must be a
            multiple of ``batch``.
        batch: blocks per call.

    Returns:
        ``{row: (nanoseconds, blocks processed)}``.

    Raises:
        ValueError: ``num_blocks - 1`` is not a positive multiple of ``batch``.
    """
    usable = num_blocks - 1
    if usable <= 0 or usable % batch:
        raise ValueError(f"num_blocks - 1 = {usable} must be a positive multiple of batch={batch}")
    n = usable // batch
    pool = side.new_pool(num_blocks)
    reqs = _pool_requests(side, n, batch, salt=1)
    hit_hashes = [h for r in reqs for h in r.block_hashes]
    miss_hashes = [h for r in _pool_requests(side, n, batch, salt=2) for h in r.block_hashes]
    groups = [0]
    get_new_blocks, free_blocks = pool.get_new_blocks, pool.free_blocks
    rows: dict[str, tuple[int, int]] = {}

    with stopwatch() as sw:
        batches = [get_new_blocks(batch) for _ in range(n)]
    rows["allocate"] = (sw.ns, usable)
    rev = [b[::-1] for b in batches]
    with stopwatch() as sw:
        for b in rev:
            free_blocks(b)
    rows["free uncached"] = (sw.ns, usable)

    batches = [get_new_blocks(batch) for _ in range(n)]
    cache_full_blocks = pool.cache_full_blocks
    with stopwatch() as sw:
        for req, b in zip(reqs, batches):
            cache_full_blocks(req, b, 0, batch, _sides.BLOCK_SIZE, 0)
    rows["cache full blocks"] = (sw.ns, usable)
    rev = [b[::-1] for b in batches]
    with stopwatch() as sw:
        for b in rev:
            free_blocks(b)
    rows["free cached"] = (sw.ns, usable)

    get_cached_block = pool.get_cached_block
    with stopwatch() as sw:
        for h in hit_hashes:
            get_cached_block(h, groups)
    rows["lookup hit"] = (sw.ns, usable)
    with stopwatch() as sw:
        for h in miss_hashes:
            get_cached_block(h, groups)
    rows["lookup miss"] = (sw.ns, usable)

    touch = pool.touch
    with stopwatch() as sw:
        for b in batches:
            touch(b)
    rows["touch"] = (sw.ns, usable)
    for b in rev:
        free_blocks(b)

    with stopwatch() as sw:
        for _ in range(n):
            get_new_blocks(batch)
    rows["allocate evicting"] = (sw.ns, usable)
    if pool.get_num_free_blocks() != 0:
        raise RuntimeError(f"{side.name}: pool should be exhausted, {pool.get_num_free_blocks()} free")
    return rows


# --------------------------------------------------------------------------- KV cache manager


@dataclass
class ManagerStats:
    """What one manager-trace run did (identical on both sides when semantics match).

    Attributes:
        requests: requests finished.
        steps: engine steps simulated.
        prompt_tokens: prompt tokens admitted (first admissions only).
        hit_tokens: prefix-cache hit tokens at first admission.
        allocate_calls: ``allocate_slots`` calls (successful or not).
        free_calls: ``free`` calls (finish and preemption).
        preemptions: requests preempted because the pool ran dry.
        events: KV events taken (events-on runs).
        ns: nanoseconds in the timed region.
    """

    requests: int = 0
    steps: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    allocate_calls: int = 0
    free_calls: int = 0
    preemptions: int = 0
    events: int = 0
    ns: int = 0

    @property
    def hit_rate(self) -> float:
        """Prefix-cache hit tokens / prompt tokens at first admission."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def semantics(self) -> tuple[int, ...]:
        """The counters that must match between implementations (everything but time)."""
        return (self.requests, self.steps, self.prompt_tokens, self.hit_tokens,
                self.allocate_calls, self.free_calls, self.preemptions, self.events)


def build_manager_requests(side: Side, trace: Any) -> list[Any]:
    """The trace's requests as ``side`` requests (prompt hashes computed; untimed setup)."""
    return [side.new_request(r.request_id or f"req-{i}", r.prompt_token_ids, r.max_new_tokens)
            for i, r in enumerate(trace.requests)]


def run_manager_trace(side: Side, requests: list[Any], *, num_blocks: int = 8192,
                      max_running: int = 32, events: bool = False) -> ManagerStats:
    """Drive a multi-turn chat trace through a fresh KV cache manager (timed).

    A deterministic batch simulation, the same calls on both sides: each step first gives
    every running request one decode slot (``allocate_slots(req, 1)``); when that fails
    the most recently admitted request is preempted (freed, ``num_computed_tokens = 0``,
    back to the front of the queue) and the allocation retried. Then it admits waiting
    requests in arrival order while fewer than ``max_running`` run
    (``get_computed_blocks`` + ``allocate_slots`` for the whole uncached prompt; a
    ``None`` stops admission for this step). Each scheduled request then gets one output token
    (``append_output_token_ids``, which also hashes newly full blocks); requests with
    ``max_tokens`` outputs are freed. With ``events``, ``take_events()`` runs every step.

    Args:
        side: the implementation.
        requests: fresh requests from :func:`build_manager_requests` (consumed: they are
            mutated by the run).
        num_blocks: KV cache blocks (null block included).
        max_running: batch size cap.
        events: enable KV cache events and drain them every step.

    Returns:
        The run's counters and elapsed nanoseconds.

    Raises:
        RuntimeError: a request can never be admitted (the pool is too small).
    """
    mgr = side.new_manager(num_blocks, events=events)
    get_computed_blocks = side.get_computed_blocks
    set_status = side.set_status
    allocate_slots, free = mgr.allocate_slots, mgr.free
    take_events = mgr.take_events
    st = ManagerStats()
    waiting: deque[Any] = deque(requests)
    running: list[Any] = []
    seen: set[str] = set()
    with stopwatch() as sw:
        while waiting or running:
            st.steps += 1
            scheduled: list[Any] = []
            # Decode first (running requests have priority), preempting from the back.
            i = 0
            while i < len(running):
                req = running[i]
                while True:
                    st.allocate_calls += 1
                    if allocate_slots(req, 1) is not None:
                        scheduled.append(req)
                        i += 1
                        break
                    victim = running.pop()
                    free(victim)
                    st.free_calls += 1
                    st.preemptions += 1
                    victim.num_computed_tokens = 0
                    set_status(victim, "PREEMPTED")
                    waiting.appendleft(victim)
                    if victim is req:
                        break
            # Then admit.
            while waiting and len(running) < max_running:
                req = waiting[0]
                blocks, num_hit = get_computed_blocks(mgr, req)
                st.allocate_calls += 1
                if allocate_slots(req, req.num_tokens - num_hit, num_hit, blocks) is None:
                    if not running:
                        raise RuntimeError(f"{side.name}: request {req.request_id} can never fit "
                                           f"in {num_blocks} blocks")
                    break
                waiting.popleft()
                if req.request_id not in seen:
                    seen.add(req.request_id)
                    st.prompt_tokens += req.num_prompt_tokens
                    st.hit_tokens += num_hit
                set_status(req, "RUNNING")
                running.append(req)
                scheduled.append(req)
            # "Forward pass": every scheduled request computes its tokens and samples one.
            for req in scheduled:
                req.num_computed_tokens = req.num_tokens
                req.append_output_token_ids(len(req.output_token_ids) & 1023)
            if any(len(r.output_token_ids) >= r.max_tokens for r in running):
                still = []
                for req in running:
                    if len(req.output_token_ids) >= req.max_tokens:
                        free(req)
                        st.free_calls += 1
                        st.requests += 1
                    else:
                        still.append(req)
                running = still
            if events:
                st.events += len(take_events())
    st.ns = sw.ns
    return st
