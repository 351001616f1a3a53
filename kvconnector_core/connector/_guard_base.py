"""What both guarded sides share: the connector, its label, the error counts, and the one
place where a hook's exception is caught (:meth:`GuardBase._contained`).

Primitives: :class:`GuardBase`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from kvconnector_core.errors import ConnectorHookError

if TYPE_CHECKING:
    from kvconnector_core.connector.base import KVConnectorBase_V1

__all__ = ["GuardBase"]

logger = logging.getLogger("kvconnector_core.connector.guard")
T = TypeVar("T")
D = TypeVar("D")  # the default's own type: inferring T from both would make a None default fix T


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

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.label}>"

    def _count(self, hook: str) -> None:
        self.errors[hook] = self.errors.get(hook, 0) + 1

    def _contained(self, hook: str, consequence: str, call: Callable[[], T], default: D) -> tuple[T | D, bool]:
        """Run one hook call; on an exception log it (naming the connector, the hook and
        ``consequence``), count it and return ``(default, False)``."""
        try:
            return call(), True
        except Exception:  # containing it is the contract
            logger.exception("connector %s raised in %s; %s", self.label, hook, consequence)
            self._count(hook)
            return default, False

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
