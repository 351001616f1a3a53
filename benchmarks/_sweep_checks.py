"""What the fault sweep checks on a live engine: the event replica, and state left at the end.

The checks look at the engine and the connector objects from the outside and find what they
need by walking the connector's object graph (by type, not by attribute name), so they keep
working while the built-in connectors change shape (role objects, guards, wrappers).

Primitives: :class:`EventReplica`, :func:`real_media`, :func:`leftover_request_state`,
:func:`leaked_gpu_refs`, :func:`held_cpu_slots`, :func:`failed_store_hits`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

from connectors.offload.manager import CPUOffloadingManager
from kvconnector_core.kv_cache.hashing import get_block_hash, get_group_id
from kvconnector_core.kv_events import MEDIUM_CPU, MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, to_external_hash
from kvconnector_core.testing.faults import FaultInjectingConnector

__all__ = ["EventReplica", "failed_store_hits", "held_cpu_slots", "leaked_gpu_refs",
           "leftover_request_state", "real_media", "walk"]

# Objects of these modules are connector state and are walked into; everything else
# (requests, the block pool, tensors) is a leaf.
_STATE_MODULES = ("connectors", "ttl_connector", "_memory_connector", "kvconnector_core.testing",
                  "kvconnector_core.connector")


def _is_state(obj: Any) -> bool:
    return type(obj).__module__.startswith(_STATE_MODULES)


def walk(roots: Iterable[Any]) -> Iterator[Any]:
    """Every connector-state object reachable from ``roots`` (each once), roots included."""
    return (obj for obj, _ in walk_paths(roots))


def walk_paths(roots: Iterable[Any]) -> Iterator[tuple[Any, str]]:
    """Like :func:`walk`, with where each object was found (``Owner.attribute``)."""
    seen: set[int] = set()
    stack = [(r, type(r).__name__) for r in roots if r is not None]
    while stack:
        obj, path = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        yield obj, path
        for name, value in _named_children(obj, path):
            if isinstance(value, dict | list | tuple | set | frozenset) or _is_state(value):
                stack.append((value, name))


def _named_children(obj: Any, path: str) -> list[tuple[str, Any]]:
    if isinstance(obj, dict | list | tuple | set | frozenset) or not _is_state(obj):
        return [(path, v) for v in _children(obj)]
    if isinstance(obj, FaultInjectingConnector):
        return [(f"{type(obj.inner).__name__}", obj.inner)]
    owner = type(obj).__name__
    named = [(f"{owner}.{k}", v) for k, v in getattr(obj, "__dict__", {}).items()]
    for cls in type(obj).__mro__:
        named += [(f"{owner}.{slot}", getattr(obj, slot)) for slot in getattr(cls, "__slots__", ())
                  if hasattr(obj, slot)]
    return named


def _children(obj: Any) -> Iterable[Any]:
    if isinstance(obj, dict):
        return [*obj.keys(), *obj.values()]
    if isinstance(obj, list | tuple | set | frozenset):
        return list(obj)
    if not _is_state(obj):
        return ()
    if isinstance(obj, FaultInjectingConnector):
        return (obj.inner,)  # the wrapper's own bookkeeping is not the connector's state
    values = list(getattr(obj, "__dict__", {}).values())
    for cls in type(obj).__mro__:
        for slot in getattr(cls, "__slots__", ()):
            if hasattr(obj, slot):
                values.append(getattr(obj, slot))
    return values


class EventReplica:
    """What a consumer of the KV event stream believes each medium holds.

    GPU: a multiset of (group, hash) (two blocks may hold the same hash); CPU: a set of
    (group, hash). ``AllBlocksCleared`` clears its medium (every medium when it names none).
    """

    def __init__(self) -> None:
        self.gpu: Counter[tuple[int, int]] = Counter()
        self.cpu: set[tuple[int, int]] = set()
        self.errors: list[str] = []

    def apply(self, events: Iterable[Any]) -> None:
        """Replay events in order."""
        for ev in events:
            medium = getattr(ev, "medium", None)
            if isinstance(ev, AllBlocksCleared):
                if medium in (None, MEDIUM_GPU):
                    self.gpu.clear()
                if medium in (None, MEDIUM_CPU):
                    self.cpu.clear()
            elif isinstance(ev, BlockStored):
                for h in ev.block_hashes:
                    if medium == MEDIUM_GPU:
                        self.gpu[(ev.group_idx or 0, h)] += 1
                    else:
                        self.cpu.add((ev.group_idx or 0, h))
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    if medium == MEDIUM_GPU:
                        key = (ev.group_idx or 0, h)
                        if self.gpu[key] <= 0:
                            self.errors.append(f"GPU removal of a hash not held: {h}")
                        self.gpu[key] -= 1
                        if self.gpu[key] <= 0:
                            del self.gpu[key]
                    else:
                        self.cpu.discard((ev.group_idx or 0, h))

    def diff(self, gpu: Counter[tuple[int, int]], cpu: set[tuple[int, int]] | None) -> str | None:
        """None when the replica equals the real state, else what differs (short)."""
        if self.gpu != gpu:
            extra, missing = self.gpu - gpu, gpu - self.gpu
            return f"GPU replica: {sum(extra.values())} extra, {sum(missing.values())} missing"
        if cpu is not None and self.cpu != cpu:
            return f"CPU replica: {len(self.cpu - cpu)} extra, {len(cpu - self.cpu)} missing"
        return None


def real_media(engine: Any) -> tuple[Counter[tuple[int, int]], set[tuple[int, int]] | None]:
    """What the GPU prefix cache and the CPU tier (if any) really hold now."""
    pool = engine.scheduler.kv_cache_manager.block_pool
    gpu = Counter((get_group_id(b.block_hash), to_external_hash(get_block_hash(b.block_hash)))
                  for b in pool.iter_cached_blocks())
    managers = [o for o in walk([engine.scheduler_connector]) if isinstance(o, CPUOffloadingManager)]
    if not managers:
        return gpu, None
    # blocks_per_chunk=1 in the sweep: a chunk key is its GPU block's hash followed by
    # its KV cache group (4 big-endian bytes).
    cpu = {(int.from_bytes(k[-4:], "big"), to_external_hash(k[:-4]))
           for m in managers for k, e in m.policy if e.is_ready}
    return gpu, cpu


def leaked_gpu_refs(engine: Any) -> int:
    """Blocks whose ref count is not what the TTL pins explain (all requests are done)."""
    pinned: Counter[int] = Counter()
    for obj in walk([engine.scheduler_connector]):
        if type(obj).__name__ == "TTLPinConnector":
            pinned.update(pin.block.block_id for pin in obj._pins.values())
    pool = engine.scheduler.kv_cache_manager.block_pool
    return sum(1 for b in pool.blocks if not b.is_null and b.ref_cnt != pinned[b.block_id])


def held_cpu_slots(engine: Any) -> int:
    """CPU-tier entries still pinned by a load or being written (all requests are done)."""
    roots = [engine.scheduler_connector, engine.worker_connector]
    return sum(1 for m in walk(roots) if isinstance(m, CPUOffloadingManager)
               for _, e in m.policy if e.ref_cnt != 0)


def leftover_request_state(engine: Any, request_ids: set[str]) -> list[str]:
    """Where a connector (either role) still mentions a finished request.

    A request id found as a dict key, a container element or a record field anywhere in
    the connector's state counts; the fault wrappers' own bookkeeping does not.
    """
    found: list[str] = []
    for obj, path in walk_paths([engine.scheduler_connector, engine.worker_connector]):
        if isinstance(obj, dict | list | tuple | set | frozenset):
            items = obj.keys() if isinstance(obj, dict) else obj
            found += [f"{path} holds {i!r}" for i in items if isinstance(i, str) and i in request_ids]
        elif _is_state(obj):
            found += [f"{name} = {v!r}" for name, v in _named_children(obj, path)
                      if isinstance(v, str) and v in request_ids]
    return found


def failed_store_hits(engine: Any) -> int:
    """Lookups that claimed a block whose store failed, over every scheduler-side fault wrapper."""
    return sum(len(o.failed_store_hits) for o in walk([engine.scheduler_connector])
               if isinstance(o, FaultInjectingConnector))
