"""A connector's demo run: the options ``kvconnector run --connector NAME`` passes it.

With no config file, ``kvconnector run`` asks the connector class for an ``extra_config``
through its ``demo_extra_config(options)`` classmethod, with the same
:class:`DemoOptions` for every connector. A connector uses the options it can honour and
refuses the others (:meth:`DemoOptions.refuse`), so the command line knows no
connector's keys.

Primitives: :class:`DemoOptions`, :func:`demo_extra_config`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

import msgspec

from kvconnector_core.errors import ConfigError

if TYPE_CHECKING:
    from kvconnector_core.connector.base import KVConnectorBase_V1

__all__ = ["DemoOptions", "demo_extra_config"]

_FLAGS = {"cpu_blocks": "--cpu-blocks", "tiers": "--tier"}
"""The optional fields of :class:`DemoOptions`, in order, and the flag that sets each."""


class DemoOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What a demo run asks of the connector's settings.

    Attributes:
        connector: the name the run selected the connector by (errors name it).
        num_gpu_blocks: the run's GPU pool size, to size a tier against.
        cpu_blocks: ``--cpu-blocks``: the size of a CPU tier in chunks (None: the
            connector's choice).
        tiers: ``--tier`` values, ``disk:PATH`` or ``redis:URL``: secondary tiers, in order.
    """

    connector: str
    num_gpu_blocks: Annotated[int, msgspec.Meta(ge=1)]
    cpu_blocks: Annotated[int, msgspec.Meta(ge=1)] | None = None
    tiers: tuple[str, ...] = ()

    def given(self) -> list[str]:
        """The optional fields set (``cpu_blocks``, ``tiers``), in declaration order."""
        return [f for f in _FLAGS if getattr(self, f) not in (None, ())]

    def refuse(self, *honoured: str) -> None:
        """Refuse the options given that the connector does not honour.

        Args:
            honoured: the optional fields the connector uses (``"cpu_blocks"``, ``"tiers"``).

        Raises:
            ConfigError: an option is set that is not in ``honoured``; names the option's
                flag, the connector and the options valid for it.
        """
        bad = [_FLAGS[f] for f in self.given() if f not in honoured]
        if not bad:
            return
        valid = ", ".join(_FLAGS[f] for f in _FLAGS if f in honoured) or "none"
        verb = "does" if len(bad) == 1 else "do"
        msg = (f"{' and '.join(bad)} {verb} not apply to the {self.connector!r} connector; "
               f"options valid for it: {valid}")
        raise ConfigError(msg)


def demo_extra_config(cls: type[KVConnectorBase_V1], options: DemoOptions) -> dict[str, Any]:
    """``cls``'s ``extra_config`` for a demo run with ``options``.

    Calls ``cls.demo_extra_config(options)``. A connector written before
    :class:`DemoOptions` declares ``demo_extra_config(num_gpu_blocks)``, and takes the
    optional fields it honours as keywords of the same names; it gets those, and the
    options it has no keyword for are refused as the base class refuses them.

    Raises:
        ConfigError: an option the connector does not honour, or the connector's own
            error (e.g. a tier it cannot parse).
    """
    # typed loosely: the two forms take different arguments
    method: Callable[..., dict[str, Any]] = cls.demo_extra_config
    params = inspect.signature(method).parameters
    if next(iter(params), None) != "num_gpu_blocks":
        return method(options)
    honoured = [f for f in _FLAGS if f in params]
    options.refuse(*honoured)
    return method(options.num_gpu_blocks, **{f: getattr(options, f) for f in honoured})
