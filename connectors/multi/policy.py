"""How :class:`~connectors.multi.MultiConnector` picks the child that loads a request.

Every child is asked for its hit; the policy chooses among the answers. A policy is any
object with a ``select`` method; the ones selectable by name from ``extra_config`` are in
:data:`LOADER_POLICIES`.

Primitives: :class:`LoaderSelectionPolicy`, :class:`LongestHitPolicy`,
:class:`FirstHitPolicy`, :data:`LOADER_POLICIES`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

__all__ = ["LOADER_POLICIES", "FirstHitPolicy", "LoaderSelectionPolicy", "LongestHitPolicy"]


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
        best_tokens = 0
        for i, (num_tokens, _) in enumerate(hits):
            if num_tokens and num_tokens > best_tokens:
                best, best_tokens = i, num_tokens
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
