"""Policies and records of :class:`~connectors.multi.MultiConnector` (shared by its two sides).

Primitives: :class:`LoaderSelectionPolicy`, :class:`LongestHitPolicy`,
:class:`FirstHitPolicy`, :data:`LOADER_POLICIES`, :class:`MultiLoad`,
:class:`MultiKVConnectorMetadata`, :class:`MultiKVConnectorWorkerMetadata`,
:func:`aggregate_stats`, :func:`call_each`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import msgspec

from kvconnector_core.connector.metadata import KVConnectorMetadata
from kvconnector_core.errors import ConnectorHookError, InvariantError

if TYPE_CHECKING:
    from kvconnector_core.connector._guard_base import GuardBase

__all__ = [
    "LOADER_POLICIES",
    "NIL",
    "STANDARD_STAT_KEYS",
    "FirstHitPolicy",
    "LoaderSelectionPolicy",
    "LongestHitPolicy",
    "MultiKVConnectorMetadata",
    "MultiKVConnectorWorkerMetadata",
    "MultiLoad",
    "aggregate_stats",
    "call_each",
]

NIL = msgspec.Raw(msgspec.msgpack.encode(None))
"""Placeholder for a skipped child's plan."""
STANDARD_STAT_KEYS: tuple[str, ...] = ("bytes_loaded", "bytes_stored", "load_seconds", "store_seconds")
"""Stats keys summed over the children."""


def call_each(calls: Iterable[Callable[[], None]]) -> None:
    """Run every call (a child's setup hook through its guard), then raise the first
    :class:`ConnectorHookError`: one broken child must not keep the others unset."""
    first: ConnectorHookError | None = None
    for call in calls:
        try:
            call()
        except ConnectorHookError as exc:
            first = first or exc
    if first is not None:
        raise first


def new_hook_errors(guards: Sequence[GuardBase], reported: dict[str, int]) -> dict[str, int]:
    """Per ``"<child label>.<hook>"``, the contained errors since the last call.

    Stats are per-interval deltas (an engine sums them over steps), while each guard
    counts errors over its life; ``reported`` remembers what was already reported.
    """
    out: dict[str, int] = {}
    for guard in guards:
        for hook, count in guard.errors.items():
            key = f"{guard.label}.{hook}"
            if count > reported.get(key, 0):
                out[key] = count - reported.get(key, 0)
                reported[key] = count
    return out


def aggregate_stats(per_child: Mapping[str, Any], hook_errors: Mapping[str, int],
                    keys: Sequence[str] = STANDARD_STAT_KEYS) -> dict[str, Any] | None:
    """``{"children": per_child}``, the sums of ``keys``, and ``hook_errors`` when any;
    None when there is nothing at all."""
    if not per_child and not hook_errors:
        return None
    out: dict[str, Any] = {"children": dict(per_child)}
    for key in keys:
        values = [s[key] for s in per_child.values()
                  if isinstance(s, dict) and isinstance(s.get(key), int | float)]
        if values:
            out[key] = sum(values)
    if hook_errors:
        out["hook_errors"] = dict(hook_errors)
    return out


# --------------------------------------------------------------------- policies


@runtime_checkable
class LoaderSelectionPolicy(Protocol):
    """Chooses which child loads a request."""

    def select(self, hits: Sequence[tuple[int | None, bool]]) -> int | None:
        """Return the index of the loading child, or None for no load.

        Args:
            hits: each child's ``(num_tokens, load_async)``, in priority order;
                never contains a None count (those short-circuit earlier).
        """
        ...


class LongestHitPolicy:
    """Load from the child with the most tokens; ties go to the earlier child (default)."""

    def select(self, hits: Sequence[tuple[int | None, bool]]) -> int | None:
        """Return the index of the longest positive hit, or None when all miss."""
        best: int | None = None
        for i, (num_tokens, _) in enumerate(hits):
            if num_tokens and num_tokens > 0 and (best is None or num_tokens > (hits[best][0] or 0)):
                best = i
        return best


class FirstHitPolicy:
    """Load from the first child with a positive hit (vLLM's MultiConnector behaviour)."""

    def select(self, hits: Sequence[tuple[int | None, bool]]) -> int | None:
        """Return the index of the first positive hit, or None when all miss."""
        return next((i for i, (n, _) in enumerate(hits) if n and n > 0), None)


LOADER_POLICIES: dict[str, Callable[[], LoaderSelectionPolicy]] = {
    "longest": LongestHitPolicy,
    "first": FirstHitPolicy,
}
"""Policies selectable with ``extra_config["loader_policy"]``."""


# --------------------------------------------------------------------- metadata


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

