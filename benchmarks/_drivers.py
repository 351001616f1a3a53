"""Deterministic benchmark workloads and the adapters that run them on one implementation.

``bench_core.py`` runs these workloads on kvconnector alone; ``compare_vllm.py`` runs the
*same* workloads, with the same sequence of calls, on kvconnector and on vLLM 0.33 in one
process. Everything implementation-specific lives in a :class:`Side` (constructors,
requests, the few call shapes that differ); the workload functions below only call
methods both implementations share, so the two sides do identical work.

Workloads (each returns nanoseconds spent in its timed region plus what it counted):

- :func:`run_block_pool` -- block pool primitives, per block: allocate, free (uncached and
  cached), cache full blocks, touch, cached-block lookup (hit / miss), evicting allocation.
- :func:`run_manager_trace` -- a small batch simulation of a multi-turn chat trace through
  a ``KVCacheManager``: admission with prefix-cache lookup, prefill allocation, one-token
  decode allocations, preemption when the pool runs dry, frees.
- :func:`run_offload_trace` -- the trace's block-hash chains through a CPU offloading
  manager (lookup / load / store / touch), LRU or ARC.
- :func:`run_events` -- msgpack encode and decode of KV event batches.
- :func:`run_hashing` -- chained block hashing of the trace's prompts.

Timed regions run with the garbage collector disabled (after a ``gc.collect()``), on both
sides alike; setup (building requests, hashing prompts for the manager workload, filling
pools) is never timed.

No vLLM import happens here at module level: :class:`VllmSide` imports vLLM in its
constructor, so ``bench_core.py`` and the smoke tests run without vLLM installed.

The sides live in ``_sides.py``, the block-pool and manager workloads in
``_pool_drivers.py``, timing and recording in ``_measure.py``; this module re-exports
them and holds the trace inputs and the offload, events and hashing workloads.
"""

from __future__ import annotations

import statistics
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import _sides
from _measure import emit_table, machine_info, record_section, stopwatch
from _pool_drivers import ManagerStats, build_manager_requests, run_block_pool, run_manager_trace
from _sides import BLOCK_SIZE, SPECS, KvconnectorSide, Side, VllmSide, configure

__all__ = [
    "BLOCK_SIZE",
    "SPECS",
    "TRACES",
    "KvconnectorSide",
    "ManagerStats",
    "OffloadStats",
    "Side",
    "VllmSide",
    "build_manager_requests",
    "chat_trace",
    "configure",
    "emit_table",
    "hashing_inputs",
    "machine_info",
    "offload_key_chains",
    "record_section",
    "run_block_pool",
    "run_events",
    "run_events_interleaved",
    "run_hashing",
    "run_manager_trace",
    "run_offload_trace",
    "stopwatch",
]


# --------------------------------------------------------------------------- workload


TRACES = ("large", "medium", "tiny", "unseen", "long", "short", "shared", "noshare")
"""Trace names :func:`chat_trace` builds (``large`` is what the rows were tuned on)."""


def chat_trace(size: str = "large", seed: int = 0) -> Any:
    """A named benchmark trace.

    Args:
        size: ``"large"`` (``chat_large``: 1000 requests, ~1.3 M prompt tokens),
            ``"medium"`` (200 requests), ``"tiny"`` (a few requests, for smoke tests),
            ``"unseen"`` (the ``mixed`` workload at scale 40 with another seed), or one of
            the shapes no benchmark was tuned on: ``"long"`` (24 prompts of 8k-32k tokens,
            each asked twice), ``"short"`` (4000 requests of 8-120 tokens, a
            16-token shared prefix), ``"shared"`` (24 documents of 2k tokens asked 40 times
            each: heavy prefix sharing) and ``"noshare"`` (1500 unrelated prompts of
            200-1200 tokens: no prefix sharing at all).
        seed: RNG seed of the generator.

    Returns:
        A :class:`kvconnector_core.engine.workloads.Trace`.

    Raises:
        ValueError: unknown ``size``.
    """
    from kvconnector_core.engine import workloads

    if size == "large":
        return workloads.get_workload("chat_large", seed)
    if size == "medium":
        return workloads.multi_turn_chat(seed, num_users=40, turns=5, system_prompt_len=512,
                                         user_turn_len=64, max_new_tokens=48, vocab=32000,
                                         user_interval=1.0, turn_interval=100.0,
                                         name="chat_medium")
    if size == "tiny":
        return workloads.multi_turn_chat(seed, num_users=3, turns=3, system_prompt_len=48,
                                         user_turn_len=20, max_new_tokens=8, vocab=500,
                                         name="chat_tiny")
    if size == "unseen":
        # For checking a claim on data the benchmarks were never tuned on: documents asked
        # about repeatedly plus many users with private prefixes, merged, new seed.
        return workloads.mixed(seed + 1009, vocab=32000, scale=40, name="unseen_mixed")
    if size in _SHAPES:
        return _SHAPES[size](seed)
    raise ValueError(f"unknown trace size {size!r}; valid sizes: {', '.join(TRACES)}")


def _random_trace(name: str, seed: int, count: int, lengths: tuple[int, int], shared: int,
                  max_new_tokens: int, repeats: int = 1) -> Any:
    # ``count`` distinct prompts of random length behind a ``shared``-token common prefix,
    # each asked ``repeats`` times (asks shuffled), one arrival per request.
    import random

    from kvconnector_core.engine import workloads

    rng = random.Random(seed)
    prefix = [rng.randrange(32000) for _ in range(shared)]
    prompts = [prefix + [rng.randrange(32000) for _ in range(rng.randint(*lengths))]
               for _ in range(count)]
    order = [(i, q) for i in range(count) for q in range(repeats)]
    rng.shuffle(order)
    reqs = [workloads.TraceRequest(arrival=float(n), prompt_token_ids=prompts[i] + [q],
                                   max_new_tokens=max_new_tokens, request_id=f"{name}-{i}-{q}")
            for n, (i, q) in enumerate(order)]
    return workloads.Trace(name=name, requests=reqs)


_SHAPES = {
    "long": lambda seed: _random_trace("long", seed, 24, (8192, 32000), 0, 16, repeats=2),
    "short": lambda seed: _random_trace("short", seed, 4000, (8, 120), 16, 8),
    "shared": lambda seed: _random_trace("shared", seed, 24, (2048, 2048), 0, 24, repeats=40),
    "noshare": lambda seed: _random_trace("noshare", seed, 1500, (200, 1200), 0, 32),
}


def offload_key_chains(trace: Any) -> list[list[bytes]]:
    """Chained block hashes (kvconnector's sha256) of every prompt, one list per request.

    Both sides of the offload comparison use these same byte strings as keys (vLLM's side
    appends its 4-byte group index, as its connector does).
    """
    from kvconnector_core.kv_cache.hashing import hash_request_tokens

    return [hash_request_tokens(r.prompt_token_ids, _sides.BLOCK_SIZE) for r in trace.requests]


# --------------------------------------------------------------------------- offload


@dataclass
class OffloadStats:
    """What one offload-trace run did.

    Attributes:
        requests: requests driven.
        keys: keys offered (sum of chain lengths).
        hit_keys: keys served by the offload tier (leading ready keys).
        gpu_hit_keys: keys served by the GPU prefix cache model (``gpu_blocks``).
        ns: nanoseconds in the timed region.
        per_request: tier hit keys of each request, in order (two implementations did
            the same work only if these lists are equal, not just their sums).

    One *operation* is one key offered to the manager (looked up, then loaded or
    stored), so operations/s is ``keys / seconds`` on both sides.
    """

    requests: int = 0
    keys: int = 0
    hit_keys: int = 0
    gpu_hit_keys: int = 0
    ns: int = 0
    per_request: list[int] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        """Hit keys / keys offered."""
        return self.hit_keys / self.keys if self.keys else 0.0

    @property
    def tier_hit_rate(self) -> float:
        """Hit keys / keys the tier was asked for (those past the GPU prefix hits)."""
        asked = self.keys - self.gpu_hit_keys
        return self.hit_keys / asked if asked else 0.0


def run_offload_trace(side: Side, chains: list[list[bytes]], *, policy: str = "lru",
                      num_blocks: int = 4096, gpu_blocks: int = 0) -> OffloadStats:
    """Drive every request's key chain through a fresh CPU offloading manager (timed).

    Args:
        side: the implementation.
        chains: one list of keys per request (see :func:`offload_key_chains`).
        policy: ``"lru"`` or ``"arc"``.
        num_blocks: slots of the CPU tier.
        gpu_blocks: size of a GPU prefix cache in front of the tier (an LRU of keys,
            0 = none). Its leading hits are served before the tier is asked, and are
            not counted as tier hits; they are recorded as uses, as the connector does.

    Returns:
        Counters and elapsed nanoseconds.
    """
    run = side.offload_runner(num_blocks, policy)
    st = OffloadStats(requests=len(chains))
    ids = [f"r{i}" for i in range(len(chains))]
    keyed = side.offload_keys(chains)  # untimed on both sides
    per_request = st.per_request
    gpu: OrderedDict[bytes, None] = OrderedDict()
    with stopwatch() as sw:
        for keys, rid in zip(keyed, ids):
            local = 0
            if gpu_blocks:
                while local < len(keys) and keys[local] in gpu:
                    local += 1
            st.gpu_hit_keys += local
            per_request.append(run(keys, rid, local))
            if gpu_blocks:
                for key in reversed(keys):  # the head of the prefix ends most recent
                    gpu[key] = None
                    gpu.move_to_end(key)
                while len(gpu) > gpu_blocks:
                    gpu.popitem(last=False)
    st.ns = sw.ns
    st.hit_keys = sum(per_request)
    st.keys = sum(len(c) for c in chains)
    return st


# --------------------------------------------------------------------------- events


def _event_batches(kv_events: Any, chains: list[list[bytes]], trace: Any,
                   batch_events: int) -> list[Any]:
    # One BlockStored (the last 8 blocks of the prompt, with their tokens) and one
    # BlockRemoved (the 4 blocks before them) per request, in batches of ``batch_events``.
    def h(x: bytes) -> int:
        return int.from_bytes(x[-8:], "big")

    events: list[Any] = []
    for chain, req in zip(chains, trace.requests):
        tail = chain[-8:]
        start = len(chain) - len(tail)
        parent = h(chain[start - 1]) if start else None
        events.append(kv_events.BlockStored(
            block_hashes=[h(x) for x in tail], parent_block_hash=parent,
            token_ids=list(req.prompt_token_ids[start * _sides.BLOCK_SIZE:len(chain) * _sides.BLOCK_SIZE]),
            block_size=_sides.BLOCK_SIZE, lora_id=None, medium="GPU", lora_name=None,
            extra_keys=[None] * len(tail), group_idx=0))
        events.append(kv_events.BlockRemoved(block_hashes=[h(x) for x in chain[max(0, start - 4):start]],
                                             medium="GPU", group_idx=0))
    return [kv_events.KVEventBatch(ts=float(i), events=events[i:i + batch_events])
            for i in range(0, len(events), batch_events)]


def run_events(side: Side, chains: list[list[bytes]], trace: Any,
               batch_events: int = 16, passes: int = 21) -> dict[str, Any]:
    """msgpack encode, then decode, the same KV event batches built with ``side``'s structs.

    One pass (all batches of the large trace) takes about a millisecond, too short to time
    reliably on a shared machine: each pass is timed on its own, ``passes`` times, and the
    median pass is reported (scaled to all passes), so a burst of interference from other
    processes does not decide the row. One untimed pass first warms msgspec's per-type
    caches.

    Returns:
        ``{"encode": (ns, events), "decode": (ns, events), "payloads": [bytes, ...],
        "batches": [batch, ...]}`` (payloads and batches for cross-decoding checks).
    """
    kv_events, encode, decode = side.event_codec()
    batches = _event_batches(kv_events, chains, trace, batch_events)
    n = sum(len(b.events) for b in batches)
    payloads = [encode(b) for b in batches]
    for p in payloads:
        decode(p)
    clock = time.thread_time_ns
    enc_ns: list[int] = []
    dec_ns: list[int] = []
    with stopwatch():  # gc off for all passes; each pass is timed inside
        for _ in range(passes):
            t0 = clock()
            payloads = [encode(b) for b in batches]
            enc_ns.append(clock() - t0)
    with stopwatch():
        for _ in range(passes):
            t0 = clock()
            for p in payloads:
                decode(p)
            dec_ns.append(clock() - t0)
    return {"encode": (int(statistics.median(enc_ns)), n), "decode": (int(statistics.median(dec_ns)), n),
            "payloads": payloads, "batches": batches}


def run_events_interleaved(sides: Sequence[Side], chains: list[list[bytes]], trace: Any,
                           batch_events: int = 16, passes: int = 21) -> dict[str, dict[str, Any]]:
    """:func:`run_events` for several sides at once, alternating them pass by pass.

    A pass takes about a millisecond, so load from other processes drifts on a longer
    time scale than one pass; alternating the sides at every pass (and which goes first)
    exposes them to the same conditions, which matters for rows that are at parity by
    construction (both sides run the same msgspec code).

    Returns:
        ``{side name: run_events-shaped result}`` with median-pass timings.
    """
    state = []
    for side in sides:
        kv_events, encode, decode = side.event_codec()
        batches = _event_batches(kv_events, chains, trace, batch_events)
        payloads = [encode(b) for b in batches]
        for p in payloads:
            decode(p)
        state.append((side, encode, decode, batches, payloads, [], []))
    n = sum(len(b.events) for b in state[0][3])
    clock = time.thread_time_ns
    with stopwatch():
        for i in range(passes):
            for side, encode, _decode, batches, _payloads, enc_ns, _ in (state if i % 2 == 0 else state[::-1]):
                t0 = clock()
                for b in batches:
                    encode(b)
                enc_ns.append(clock() - t0)
        for i in range(passes):
            for side, _encode, decode, _batches, payloads, _, dec_ns in (state if i % 2 == 0 else state[::-1]):
                t0 = clock()
                for p in payloads:
                    decode(p)
                dec_ns.append(clock() - t0)
    return {side.name: {"encode": (int(statistics.median(enc)), n),
                        "decode": (int(statistics.median(dec)), n),
                        "payloads": payloads, "batches": batches}
            for side, _e, _d, batches, payloads, enc, dec in state}


# --------------------------------------------------------------------------- hashing


def hashing_inputs(trace: Any, max_requests: int | None = None) -> list[list[list[int]]]:
    """Each prompt cut into full ``BLOCK_SIZE``-token blocks (lists), one list per request."""
    reqs = trace.requests if max_requests is None else trace.requests[:max_requests]
    bs = _sides.BLOCK_SIZE
    out = []
    for r in reqs:
        t = r.prompt_token_ids
        out.append([t[i:i + bs] for i in range(0, len(t) - bs + 1, bs)])
    return out


def run_hashing(side: Side, blocks_per_request: list[list[list[int]]]) -> tuple[int, int]:
    """Chained hashing of every request's blocks with ``side``'s default block hash.

    Returns:
        ``(nanoseconds, blocks hashed)``.
    """
    f = side.block_hasher()
    n = sum(len(b) for b in blocks_per_request)
    with stopwatch() as sw:
        for blocks in blocks_per_request:
            parent = None
            for tokens in blocks:
                parent = f(parent, tokens)
    return sw.ns, n

