"""Record seeded operation traces of vLLM 0.33's ``CPUOffloadingManager`` (LRU and ARC).

Each trace is a seeded sequence of requests that overlap in time, driven the way vLLM
0.33's offloading connector drives its manager: a request looks up the leading keys of
its prefix chain, loads the hits (pinned until the load completes), offers the rest for
storing in pieces (a refused store is offered again later), completes its stores
(sometimes failing one) and finishes, which commits its recency. The manager's answer to
every operation and its policy's whole state after it (ARC: T1, T2, B1, B2 in order and
the target; LRU: the held keys in eviction order; ref counts of every held key) are
recorded, so a replay can compare after every single operation.

Keys are small integers in the file; the key of ``k`` is ``k.to_bytes(4, "big")``
followed by the KV cache group index (0) as 4 big-endian bytes, as vLLM's keys end.

Run in the vLLM venv from the repository root::

    VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 /work/main/.vllm-venv/bin/python \\
        benchmarks/record_vllm_offload_traces.py --seeds 160 \\
        --out tests/connectors/offload/data/vllm033_offload_traces.json.gz

The replay is ``tests/test_offload_vllm_traces.py`` (no vLLM needed).
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
from pathlib import Path
from typing import Any

__all__ = ["key_bytes", "main", "record_trace"]

GROUP = (0).to_bytes(4, "big")
BLOCK = 16  # tokens per key: positions are end tokens, as the connector sets them


def key_bytes(k: int) -> bytes:
    """The offload key of integer ``k`` (4 bytes of ``k``, then group 0)."""
    return k.to_bytes(4, "big") + GROUP


def _state(m: Any, policy: str) -> dict[str, Any]:
    pol = m._policy
    ints = lambda keys: [int.from_bytes(k[:4], "big") for k in keys]  # noqa: E731
    if policy == "arc":
        held = [*pol.t1.items(), *pol.t2.items()]
        out: dict[str, Any] = {"t1": ints(pol.t1), "t2": ints(pol.t2), "b1": ints(pol.b1),
                               "b2": ints(pol.b2), "target": pol.target_t1_size}
    else:
        order = sorted(pol.chunks, key=pol._ranks.__getitem__)
        held = [(k, pol.chunks[k]) for k in order]
        out = {"order": ints(order)}
    out["refs"] = [int(c.ref_cnt) for _, c in held]
    out["slots"] = [int(c.chunk_id) for _, c in held]
    return out


class _Req:
    def __init__(self, rid: str, keys: list[int], ctx: Any) -> None:
        self.rid, self.keys, self.ctx = rid, keys, ctx
        self.next = 0  # first key not yet offered for storing
        self.loads: list[list[int]] = []
        self.stores: list[list[int]] = []


def _docs(rng: random.Random) -> list[list[int]]:
    # Prefix chains sharing heads: a few roots, each extended by several branches.
    docs, nxt = [], 1
    for _ in range(rng.randint(2, 4)):
        root = list(range(nxt, nxt + rng.randint(1, 6)))
        nxt += len(root)
        for _ in range(rng.randint(1, 4)):
            tail = list(range(nxt, nxt + rng.randint(0, 8)))
            nxt += len(tail)
            docs.append(root + tail)
    return docs


def record_trace(seed: int, policy: str, steps: int = 160) -> dict[str, Any]:
    """Record one seeded trace of vLLM 0.33's manager under ``policy``."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    rng = random.Random(seed)
    capacity = rng.randint(3, 14)
    m = CPUOffloadingManager(capacity, cache_policy=policy)
    docs = _docs(rng)
    live: dict[str, _Req] = {}
    ops: list[list[Any]] = []
    counter = 0

    def emit(op: list[Any], result: Any) -> None:
        ops.append([*op, result, _state(m, policy)])

    for _ in range(steps):
        choice = rng.random()
        if choice < 0.25 and len(live) < 4:
            counter += 1
            doc = rng.choice(docs)
            keys = doc[:rng.randint(1, len(doc))]
            ctx = ReqContext(req_id=f"r{counter}")
            m.on_new_request(ctx)
            for i, k in enumerate(keys):
                ctx.set_offload_key_position(key_bytes(k), (i + 1) * BLOCK)
            req = _Req(ctx.req_id, keys, ctx)
            live[req.rid] = req
            hits = 0
            for k in keys:
                if m.lookup(key_bytes(k), ctx) is not LookupResult.HIT:
                    break
                hits += 1
            emit(["new", req.rid, keys], hits)
            if hits:
                m.prepare_load([key_bytes(k) for k in keys[:hits]], ctx)
                req.loads.append(keys[:hits])
                emit(["load", req.rid, keys[:hits]], None)
            req.next = hits
            continue
        if not live:
            continue
        req = live[rng.choice(sorted(live))]
        _step(rng, m, req, live, emit, choice)
    return {"seed": seed, "policy": policy, "capacity": capacity, "ops": ops}


def _step(rng: random.Random, m: Any, req: _Req, live: dict[str, _Req], emit: Any,
          choice: float) -> None:
    ctx = req.ctx
    if choice < 0.5 and req.next < len(req.keys):
        piece = req.keys[req.next:req.next + rng.randint(1, 4)]
        out = m.prepare_store([key_bytes(k) for k in piece], ctx)
        if out is None:
            emit(["store", req.rid, piece], None)
            return
        stored = [int.from_bytes(k[:4], "big") for k in out.keys_to_store]
        evicted = [int.from_bytes(k[:4], "big") for k in out.evicted_keys]
        emit(["store", req.rid, piece],
             [stored, evicted, [int(b) for b in out.store_spec.block_ids]])
        req.next += len(piece)
        if stored:
            req.stores.append(stored)
    elif choice < 0.65 and req.loads:
        keys = req.loads.pop(0)
        m.complete_load([key_bytes(k) for k in keys], ctx)
        emit(["load_done", req.rid, keys], None)
    elif choice < 0.85 and req.stores:
        keys = req.stores.pop(0)
        ok = rng.random() > 0.1
        m.complete_store([key_bytes(k) for k in keys], ctx, success=ok)
        emit(["store_done", req.rid, keys, ok], None)
    elif not req.loads and not req.stores and (req.next == len(req.keys) or choice > 0.95):
        m.on_request_finished(ctx)
        emit(["finish", req.rid], None)
        del live[req.rid]


def main() -> int:
    """Record ``--seeds`` traces per policy into one gzipped JSON file."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=160)
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--out", type=Path, default=Path("tests/connectors/offload/data/vllm033_offload_traces.json.gz"))
    args = ap.parse_args()
    import vllm

    traces = [record_trace(seed, policy, args.steps)
              for policy in ("lru", "arc") for seed in range(args.seeds)]
    payload = {"vllm": vllm.__version__, "block_tokens": BLOCK, "traces": traces}
    with gzip.open(args.out, "wt") as f:
        json.dump(payload, f, separators=(",", ":"))
    print(f"{len(traces)} traces, {sum(len(t['ops']) for t in traces)} ops -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
