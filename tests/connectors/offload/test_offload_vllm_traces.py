"""Our CPU offloading manager replays vLLM 0.33's recorded manager traces op for op.

``tests/connectors/offload/data/vllm033_offload_traces.json.gz`` holds seeded traces
recorded from vLLM 0.33's ``CPUOffloadingManager`` (LRU and ARC) by
``benchmarks/record_vllm_offload_traces.py``: overlapping requests that look up, load,
store (refused stores offered again), complete and finish. Each operation is replayed
on our manager, driven the way ``OffloadingConnector`` drives it, and its answer and the
policy's whole state after it (list order, ghosts, target, ref counts, slots) must equal
vLLM's. No vLLM is needed.
"""

from __future__ import annotations

import gzip
import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from connectors.offload.manager import (
    ARCCachePolicy,
    CPUOffloadingManager,
    OffloadKey,
    RequestAccess,
)

DATA = Path(__file__).resolve().parent / "data" / "vllm033_offload_traces.json.gz"
GROUP = (0).to_bytes(4, "big")


@cache
def _traces() -> list[dict[str, Any]]:
    with gzip.open(DATA, "rt") as f:
        return list(json.load(f)["traces"])


def _key(k: int) -> OffloadKey:
    return OffloadKey(k.to_bytes(4, "big") + GROUP)


def _ints(keys: Any) -> list[int]:
    return [int.from_bytes(k[:4], "big") for k in keys]


def _state(m: CPUOffloadingManager, policy: str) -> dict[str, Any]:
    pol = m.policy
    out: dict[str, Any]
    if policy == "arc":
        assert isinstance(pol, ARCCachePolicy)
        out = {"t1": _ints(pol.t1), "t2": _ints(pol.t2), "b1": _ints(pol.b1),
               "b2": _ints(pol.b2), "target": pol.target}
    else:
        out = {"order": _ints(k for k, _ in pol)}
    out["refs"] = [e.ref_cnt for _, e in pol]
    out["slots"] = [e.slot_id for _, e in pol]
    return out


class _Request:
    """What ``OffloadingConnector`` keeps per request for recency (its ``ReqState``)."""

    def __init__(self, keys: list[int]) -> None:
        self.position = {_key(k): i + 1 for i, k in enumerate(keys)}
        self.access = RequestAccess(position=self.position)


def _apply(m: CPUOffloadingManager, reqs: dict[str, _Request], op: list[Any]) -> Any:
    name, rid = op[0], op[1]
    if name == "new":
        reqs[rid] = _Request(op[2])
        return m.lookup([_key(k) for k in op[2]])
    req, keys = reqs[rid], [_key(k) for k in op[2]] if len(op) > 2 else []
    if name == "load":
        m.prepare_load(keys, req.access)
    elif name == "store":
        out = m.prepare_store(keys, req.access)
        if out is None:
            return None
        return [_ints(out.keys_to_store), _ints(out.evicted_keys), list(out.store_spec.block_ids)]
    elif name == "load_done":
        m.complete_load(keys)
    elif name == "store_done":
        m.complete_store(keys, success=op[3])
    elif name == "finish":
        access, position = req.access, reqs.pop(rid).position
        m.finish_request(sorted(access.seen, key=position.__getitem__), access.reused,
                         access.stored_only)
    return None


def _replay(trace: dict[str, Any]) -> str | None:
    """Replay one trace; the first divergence, described, or None."""
    policy = trace["policy"]
    m = CPUOffloadingManager(trace["capacity"], cache_policy=policy)
    reqs: dict[str, _Request] = {}
    for i, entry in enumerate(trace["ops"]):
        op, want, want_state = entry[:-2], entry[-2], entry[-1]
        got = _apply(m, reqs, op)
        if got != want:
            return f"op {i} {op}: answer {got} != vLLM's {want}"
        state = _state(m, policy)
        if state != want_state:
            return f"op {i} {op}: state {state} != vLLM's {want_state}"
    return None


def test_the_recorded_traces_cover_refused_stores_evictions_and_both_policies() -> None:
    traces = _traces()
    assert {t["policy"] for t in traces} == {"lru", "arc"}
    for policy in ("lru", "arc"):
        mine = [t for t in traces if t["policy"] == policy]
        assert len(mine) >= 150
        ops = [e for t in mine for e in t["ops"]]
        assert sum(1 for e in ops if e[0] == "store" and e[-2] is None) > 100
        assert sum(1 for e in ops if e[0] == "store" and e[-2] and e[-2][1]) > 1000


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_our_manager_replays_every_vllm_trace_op_for_op(policy: str) -> None:
    diverged = {t["seed"]: d for t in _traces() if t["policy"] == policy
                if (d := _replay(t)) is not None}
    assert not diverged, f"{len(diverged)} diverge; first: {next(iter(diverged.items()))}"
