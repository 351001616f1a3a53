"""What :class:`~connectors.multi.MultiConnector`'s two sides send each other.

The scheduler side's plan (:class:`MultiKVConnectorMetadata`, holding each child's plan
and the loads planned this step as :class:`MultiLoad` records) goes to the worker side;
the worker side's report (:class:`MultiKVConnectorWorkerMetadata`, each child's worker
metadata and which children failed) comes back.

Primitives: :class:`MultiLoad`, :class:`MultiKVConnectorMetadata`,
:class:`MultiKVConnectorWorkerMetadata`, :data:`NIL`.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvconnector_core.connector.metadata import KVConnectorMetadata
from kvconnector_core.errors import InvariantError

__all__ = ["NIL", "MultiKVConnectorMetadata", "MultiKVConnectorWorkerMetadata", "MultiLoad"]

NIL = msgspec.Raw(msgspec.msgpack.encode(None))
"""Placeholder for a skipped child's plan."""


class MultiLoad(msgspec.Struct, frozen=True):
    """One load planned this step, so the worker side can fail it if its child breaks.

    Attributes:
        child: index of the loading child.
        block_ids: GPU block ids (first KV cache group) the load writes.
        is_async: whether the load is asynchronous.
    """

    child: int
    block_ids: list[int]
    is_async: bool


class MultiKVConnectorMetadata(KVConnectorMetadata, kw_only=True):
    """MultiConnector's plan: the children's plans plus completion bookkeeping.

    Each child's metadata is msgpack-encoded separately (``msgspec.Raw``) so
    children with different metadata types survive the trip; the worker side
    decodes it with the child's ``metadata_type``.

    Attributes:
        children: encoded metadata per child (msgpack ``nil`` for a skipped child).
        skipped_children: children whose ``build_connector_meta`` raised; their
            worker hooks skip the step.
        delayed_sends: request id -> children that asked to delay its free.
        loads: request id -> the load planned for it this step.
        failed_loads: request id -> a load the scheduler side already knows failed.
        settled_sends: requests whose delayed free the scheduler side saw reported; the
            worker side stops waiting for them (a re-sent delayed free can reach it after
            the children already reported the request, and they do not report it twice).
        step: the scheduler side's plan number; the worker side echoes it in its report,
            so a child's failure reaches that step's plan even when later plans were built
            before the report came back (vLLM's async scheduling).
    """

    children: list[msgspec.Raw] = msgspec.field(default_factory=list)
    skipped_children: list[int] = msgspec.field(default_factory=list)
    delayed_sends: dict[str, list[int]] = msgspec.field(default_factory=dict)
    loads: dict[str, MultiLoad] = msgspec.field(default_factory=dict)
    failed_loads: dict[str, MultiLoad] = msgspec.field(default_factory=dict)
    settled_sends: list[str] = msgspec.field(default_factory=list)
    step: int = -1


class MultiKVConnectorWorkerMetadata(msgspec.Struct, frozen=True):
    """The children's worker metadata (worker -> scheduler), one entry per child.

    Attributes:
        metadata: child ``i``'s ``build_connector_worker_meta()`` result (None
            when it had nothing or raised), in child order.
        loads_failed: children whose loads of the step failed (their guard's flag).
        stores_failed: children whose stores of the step failed (their guard's flag).
        step: the :attr:`MultiKVConnectorMetadata.step` of the plan this reports on
            (-1: unknown).
    """

    metadata: tuple[Any, ...]
    loads_failed: tuple[int, ...] = ()
    stores_failed: tuple[int, ...] = ()
    step: int = -1

    def aggregate(self, other: MultiKVConnectorWorkerMetadata) -> MultiKVConnectorWorkerMetadata:
        """Fold another worker's record of the same step, child by child (None + x = x);
        a child failed if it failed on any worker.

        Raises:
            InvariantError: the records have different child counts, or a child's
                record has no ``aggregate`` method.
        """
        if len(other.metadata) != len(self.metadata):
            msg = (f"cannot aggregate MultiConnector worker metadata of {len(self.metadata)} and "
                   f"{len(other.metadata)} children")
            raise InvariantError(msg)
        merged = []
        for mine, theirs in zip(self.metadata, other.metadata, strict=True):
            if mine is None or theirs is None:
                merged.append(theirs if mine is None else mine)
            elif hasattr(mine, "aggregate"):
                merged.append(mine.aggregate(theirs))
            else:
                msg = f"child worker metadata {type(mine).__qualname__} has no aggregate(other)"
                raise InvariantError(msg)
        return MultiKVConnectorWorkerMetadata(
            tuple(merged), tuple(sorted({*self.loads_failed, *other.loads_failed})),
            tuple(sorted({*self.stores_failed, *other.stores_failed})), max(self.step, other.step))

