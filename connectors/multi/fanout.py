"""What both sides of :class:`~connectors.multi.MultiConnector` do over all their children:
run a setup hook on every child before raising, and fold the children's stats and
contained errors into one report.

Primitives: :func:`call_each`, :func:`new_hook_errors`, :func:`aggregate_stats`,
:data:`STANDARD_STAT_KEYS`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvconnector_core.errors import ConnectorHookError

if TYPE_CHECKING:
    from kvconnector_core.connector.guard import GuardBase

__all__ = ["STANDARD_STAT_KEYS", "aggregate_stats", "call_each", "new_hook_errors"]

STANDARD_STAT_KEYS: tuple[str, ...] = (
    "bytes_loaded", "bytes_stored", "load_seconds", "store_seconds")
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
