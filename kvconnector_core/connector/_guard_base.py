"""What both guarded sides share: the connector, its label, the error counts, and the one
place where a hook's exception is caught (:meth:`GuardBase._contained`).

Primitives: :class:`GuardBase`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from kvconnector_core.connector.config import DEFAULT_QUARANTINE_AFTER_RAISES
from kvconnector_core.errors import ConnectorHookError

if TYPE_CHECKING:
    from kvconnector_core.connector.base import KVConnectorBase_V1

__all__ = ["GuardBase"]

logger = logging.getLogger("kvconnector_core.connector.guard")
T = TypeVar("T")
D = TypeVar("D")  # the default's own type: inferring T from both would make a None default fix T

MAX_PENDING_STEPS = 64
"""Consecutive asks for which a guard answers that its connector has pending work; past
this the engine is let go idle (logged once), so a connector that never delivers cannot
keep it stepping forever."""


class GuardBase:
    """A connector (one role) behind the failure contract.

    Args:
        connector: the connector instance.
        label: names the connector in log lines and errors (default: its ``name``).
        errors: the dict to count errors in (hook name -> count); default: a new one.
    """

    def __init__(self, connector: KVConnectorBase_V1, *, label: str | None = None,
                 errors: dict[str, int] | None = None) -> None:
        self.connector = connector
        self.label = label or connector.name
        self.errors: dict[str, int] = {} if errors is None else errors
        """Per hook name, how many times the connector raised (contained)."""
        self._pending_asks = 0
        config = getattr(connector, "config", None)
        self.quarantine_after: int | None = getattr(config, "quarantine_after_raises",
                                                    DEFAULT_QUARANTINE_AFTER_RAISES)
        """Raises in a row of one hook after which the connector is quarantined (None: never)."""
        self.quarantined = False
        """Set once one hook raised ``quarantine_after`` times in a row; never cleared."""
        self._streaks: dict[str, int] = {}  # hook -> raises in a row
        # Hooks that raised since the last step began: the worker's hot hooks inline their
        # try (no per-call success bookkeeping), so their streaks end at the next step
        # in which they did not raise (GuardedWorker.begin_step).
        self._raised_now: set[str] = set()

    def has_pending_work(self) -> bool:
        """Whether the engine should run another step for this connector: the guard's own
        redeliveries (:meth:`_own_pending`) or the connector's ``has_pending_work`` (a
        raise counts as no). After :data:`MAX_PENDING_STEPS` consecutive yeses, no."""
        hook = getattr(self.connector, "has_pending_work", None)  # optional: older connectors lack it
        pending = self._own_pending() or (
            hook is not None and bool(self._contained("has_pending_work", "taken as no", hook, False)[0]))
        self._pending_asks = self._pending_asks + 1 if pending else 0
        if self._pending_asks == MAX_PENDING_STEPS + 1:
            logger.error("connector %s: still has pending work after %d steps; the engine may go idle",
                         self.label, MAX_PENDING_STEPS)
        return pending and self._pending_asks <= MAX_PENDING_STEPS

    def _own_pending(self) -> bool:
        """What the guard itself still has to deliver (subclasses)."""
        return False

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.label}>"

    def _count(self, hook: str) -> None:
        self.errors[hook] = self.errors.get(hook, 0) + 1

    def _contained(self, hook: str, consequence: str, call: Callable[[], T], default: D) -> tuple[T | D, bool]:
        """Run one hook call; on an exception log it (naming the connector, the hook and
        ``consequence``), count it and return ``(default, False)``."""
        try:
            result = call()
        except Exception:  # noqa: BLE001 - containing it is the contract
            self._raised(hook, consequence)
            return default, False
        if self._streaks:
            self._streaks.pop(hook, None)
        return result, True

    def _note_raise(self, hook: str) -> None:
        """Quarantine the connector once ``hook`` raised ``quarantine_after`` times in a row
        (for the worker's per-step hooks: in consecutive steps; see ``_raised_now``)."""
        streak = self._streaks[hook] = self._streaks.get(hook, 0) + 1
        if self.quarantined or self.quarantine_after is None or streak < self.quarantine_after:
            return
        self.quarantined = True
        self._count("quarantined")
        logger.error("connector %s quarantined: %s raised %d times in a row; no more loads or stores "
                     "go through it", self.label, hook, streak)

    def _raised(self, hook: str, consequence: str) -> None:
        """Log (with the traceback) and count the exception being handled; called from
        the ``except`` block of a hot hook that inlines its ``try`` instead of building a
        closure for :meth:`_contained` (the per-layer and per-step hooks)."""
        logger.exception("connector %s raised in %s; %s", self.label, hook, consequence)
        self._count(hook)
        self._raised_now.add(hook)
        self._note_raise(hook)

    def _not_contained(self, hook: str, call: Callable[[], None]) -> None:
        """Run a setup hook whose failure means misconfiguration.

        Raises:
            ConnectorHookError: the hook raised (the original is the cause).
        """
        try:
            call()
        except Exception as exc:
            msg = f"connector {self.label} raised in {hook}: {type(exc).__name__}: {exc}"
            raise ConnectorHookError(msg, self.label, hook) from exc
