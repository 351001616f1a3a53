"""The records that cross between the adapter's roles and the vLLM boundary.

Between the scheduler and worker roles (pickled by vLLM): the plan
(:class:`AdapterMetadata`) and the workers' report (:class:`AdapterWorkerMetadata`,
folded across workers with the connector's own ``aggregate``). Toward vLLM: stats
(:class:`AdapterStats`, vLLM's stats protocol), worker events (:class:`AdapterKVEvents`)
and KV events (:func:`to_vllm_events`, vLLM's event classes, field for field). From
vLLM: its ``KVConnectorOutput``, whose sets may be None (:func:`output_from_vllm`).

Primitives: :class:`AdapterMetadata`, :class:`AdapterWorkerMetadata`,
:class:`AdapterStats`, :class:`AdapterKVEvents`, :func:`output_from_vllm`,
:func:`to_vllm_events`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
from vllm.distributed import kv_events as vllm_events
from vllm.distributed.kv_events import KVConnectorKVEvents, KVEventAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata as VllmMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorWorkerMetadata as VllmWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvconnector_core.connector.metadata import KVConnectorOutput
from kvconnector_core.errors import InvariantError

if TYPE_CHECKING:
    from vllm.v1.outputs import KVConnectorOutput as VllmOutput

__all__ = [
    "AdapterKVEvents",
    "AdapterMetadata",
    "AdapterStats",
    "AdapterWorkerMetadata",
    "output_from_vllm",
    "to_vllm_events",
]


def output_from_vllm(output: VllmOutput) -> KVConnectorOutput:
    """kvconnector's output record for vLLM's (None sets become empty sets).

    Stats and events are not carried: the adapter handles both itself.
    """
    meta = output.kv_connector_worker_meta
    if not isinstance(meta, AdapterWorkerMetadata):
        meta = AdapterWorkerMetadata()
    return KVConnectorOutput(
        finished_sending=set(output.finished_sending or ()),
        finished_recving=set(output.finished_recving or ()),
        failed_recving=set(output.failed_recving or ()),
        invalid_block_ids=set(output.invalid_block_ids or ()),
        kv_connector_worker_meta=meta.inner,
        loads_failed=meta.loads_failed,
        stores_failed=meta.stores_failed,
    )


def to_vllm_events(events: Any) -> list[Any]:
    """kvconnector KV events as vLLM's event classes (same fields, same wire encoding).

    Fields vLLM's class lacks are dropped: kvconnector's ``AllBlocksCleared`` may name
    one ``medium`` (a connector's reset, or the guard's resync), vLLM's clears every
    medium. A consumer then drops more than was cleared, never holds a block that is
    gone, and the ``BlockStored`` events of a resync that follow restore the
    connector's blocks.
    """
    out = []
    for event in events or ():
        cls = getattr(vllm_events, type(event).__name__, None)
        if cls is None:
            msg = f"KV event {type(event).__name__} has no vLLM counterpart"
            raise InvariantError(msg)
        fields = cls.__struct_fields__
        out.append(cls(**{k: v for k, v in msgspec.structs.asdict(event).items() if k in fields}))
    return out


@dataclass
class AdapterMetadata(VllmMetadata):
    """The wrapped connector's plan, carried in vLLM's ``SchedulerOutput`` (pickled).

    Attributes:
        inner: the wrapped connector's plan (None when its ``build_connector_meta``
            raised: the guard then skips the step's loads and stores).
        failed_recving: requests whose load the scheduler side already knows failed
            (the connector raised while planning it); the worker reports them finished
            and failed, so vLLM stops waiting and recomputes.
        step: the scheduler side's step number of this plan; the worker names it in
            its report, so that a failure reaches the plan of its own step (with
            async scheduling the next plan is built before a step is reported).
        delayed_frees: finished requests whose blocks vLLM holds for the connector's
            stores, not reported sent yet (the worker reports them itself when its
            step's stores failed and it has nothing in flight).
        async_loads: the requests whose asynchronous load this plan carries (a request
            id the worker remembers from an earlier request's failed load is new again).
        sync_recving: the requests whose synchronous load this plan carries; vLLM waits
            for them as receives, so the worker completes them this step and reports
            them finished (failed when its loads failed).
        load_blocks: with several KV cache groups (HMA), the loads planned this step
            and every block each writes (all groups): the worker maps load errors by
            block to the receives they hit, whenever they are reported.
        unreported_sends: finished requests vLLM keeps until their ``finished_sending``
            (a delayed free), not reported yet; the worker reports a send only for
            these, once each (vLLM asserts on a report for a request it dropped, and a
            later request may reuse a dropped request's id).
    """

    inner: Any = None
    failed_recving: set[str] = field(default_factory=set)
    step: int = 0
    delayed_frees: set[str] = field(default_factory=set)
    unreported_sends: set[str] = field(default_factory=set)
    load_blocks: dict[str, set[int]] = field(default_factory=dict)
    async_loads: set[str] = field(default_factory=set)
    sync_recving: set[str] = field(default_factory=set)


@dataclass
class AdapterWorkerMetadata(VllmWorkerMetadata):
    """The wrapped connector's worker metadata and the guard's step flags, folded across
    TP/PP workers.

    Folding uses the record's own ``aggregate(other)`` (kvconnector's contract for
    worker metadata that several workers produce); a flag is set if any worker set it.

    Attributes:
        inner: the wrapped connector's ``build_connector_worker_meta()`` result.
        loads_failed: a worker hook failed so that the step's loads may not have run.
        stores_failed: likewise for the step's stores.
        step: the step of the plan the worker ran (:attr:`AdapterMetadata.step`).
    """

    inner: Any = None
    loads_failed: bool = False
    stores_failed: bool = False
    step: int | None = None

    def aggregate(self, other: VllmWorkerMetadata) -> AdapterWorkerMetadata:
        """Fold another worker's record of the same step into this one.

        Raises:
            InvariantError: the wrapped record has no ``aggregate`` method.
        """
        if not isinstance(other, AdapterWorkerMetadata):
            return self
        mine, theirs = self.inner, other.inner
        if mine is None or theirs is None:
            inner = theirs if mine is None else mine
        else:
            fold = getattr(mine, "aggregate", None)
            if fold is None:
                msg = (f"worker metadata {type(mine).__qualname__} has no aggregate(other); "
                       "it cannot be combined across several vLLM workers (TP/PP > 1)")
                raise InvariantError(msg)
            inner = fold(theirs)
        steps = [s for s in (self.step, other.step) if s is not None]
        return AdapterWorkerMetadata(inner, self.loads_failed or other.loads_failed,
                                     self.stores_failed or other.stores_failed,
                                     max(steps) if steps else None)


class AdapterKVEvents(KVConnectorKVEvents):
    """Worker-side KV events; across workers only the events every worker emitted are kept."""

    def __init__(self, events: list[Any], num_workers: int = 1) -> None:
        self._aggregator = KVEventAggregator(num_workers)
        self._aggregator.add_events(events)

    def add_events(self, events: list[Any]) -> None:
        """Add another worker's events."""
        self._aggregator.add_events(events)

    def aggregate(self) -> AdapterKVEvents:
        """Keep the events common to all workers (each once)."""
        common = self._aggregator.get_common_events()
        self._aggregator.clear_events()
        self._aggregator.add_events(common)
        self._aggregator.reset_workers()
        return self

    def increment_workers(self, count: int = 1) -> None:
        """Count more contributing workers."""
        self._aggregator.increment_workers(count)

    def get_all_events(self) -> list[Any]:
        """Every event held."""
        return self._aggregator.get_all_events()

    def get_number_of_workers(self) -> int:
        """Workers that contributed."""
        return self._aggregator.get_number_of_workers()

    def clear_events(self) -> None:
        """Drop every event."""
        self._aggregator.clear_events()
        self._aggregator.reset_workers()


def _flatten(stats: dict[str, Any], prefix: str, counters: dict[str, float],
             gauges: dict[str, float]) -> None:
    for key, value in stats.items():
        name = f"{prefix}{key}"
        if key == "gauges" and isinstance(value, dict):
            for g, level in value.items():
                if isinstance(level, int | float) and not isinstance(level, bool):
                    gauges[f"{prefix}{g}"] = level
        elif isinstance(value, dict):
            _flatten(value, f"{name}.", counters, gauges)
        elif isinstance(value, int | float) and not isinstance(value, bool):
            counters[name] = counters.get(name, 0) + value


@dataclass
class AdapterStats(KVConnectorStats):
    """kvconnector stats under vLLM's stats protocol.

    ``data`` is ``{"counters": {...}, "gauges": {...}}`` with dotted names
    (nested dicts such as a MultiConnector's ``children`` are flattened).
    Counters are per-step deltas that :meth:`aggregate` sums (across workers,
    the scheduler side and the steps of a logging interval); gauges are
    levels, of which the latest value wins.
    """

    data: dict[str, Any] = field(default_factory=lambda: {"counters": {}, "gauges": {}})

    @classmethod
    def from_kvconnector(cls, stats: dict[str, Any] | None) -> AdapterStats:
        """Wrap one ``get_kv_connector_stats()`` result."""
        counters: dict[str, float] = {}
        gauges: dict[str, float] = {}
        _flatten(stats or {}, "", counters, gauges)
        return cls({"counters": counters, "gauges": gauges})

    def reset(self) -> None:
        """Forget everything."""
        self.data = {"counters": {}, "gauges": {}}

    def aggregate(self, other: KVConnectorStats) -> AdapterStats:
        """Sum the counters, keep ``other``'s gauges where it has them."""
        counters = dict(self.data.get("counters", {}))
        for key, value in other.data.get("counters", {}).items():
            counters[key] = counters.get(key, 0) + value
        gauges = {**self.data.get("gauges", {}), **other.data.get("gauges", {})}
        self.data = {"counters": counters, "gauges": gauges}
        return self

    def reduce(self) -> dict[str, int | float]:
        """Counters summed over the interval, gauges as last seen (``gauges.`` prefix)."""
        out: dict[str, int | float] = dict(self.data.get("counters", {}))
        out.update({f"gauges.{k}": v for k, v in self.data.get("gauges", {}).items()})
        return out

    def is_empty(self) -> bool:
        """True when neither counters nor gauges were reported."""
        return not (self.data.get("counters") or self.data.get("gauges"))
