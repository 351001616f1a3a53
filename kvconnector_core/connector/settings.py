"""Typed connector settings: ``extra_config`` converted to a msgspec Struct, strictly.

A connector declares its settings as a Struct and names it in ``settings_type``::

    class DiskSettings(ConnectorSettings):
        path: str
        max_bytes: Annotated[int, msgspec.Meta(ge=1)] = 2**30
        fsync: bool = False

    class DiskConnector(KVConnectorBase_V1):
        name = "disk"
        settings_type = DiskSettings

The base class converts ``config.extra_config`` when the connector is created and
keeps the result in ``connector.settings``. A key the Struct does not declare, a
missing required key, a value of the wrong type or out of its bounds is a
:class:`~kvconnector_core.errors.ConfigError` that names the connector and the key,
and for an unknown key the nearest valid one. Conversion is lax about spelling
numbers and booleans as strings (``"64"``, ``"true"``), as JSON and TOML configs
written by hand often do.

Primitives: :class:`ConnectorSettings`, :func:`convert_settings`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import msgspec

from kvconnector_core._suggest import did_you_mean
from kvconnector_core.connector.validation import FieldProblem, field_choices, find_field_problem
from kvconnector_core.errors import ConfigError

__all__ = ["ConnectorSettings", "convert_settings"]

S = TypeVar("S", bound=msgspec.Struct)


class ConnectorSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base class of a connector's settings (keyword-only, unknown keys rejected)."""


def convert_settings(connector: str, settings_type: type[S], extra_config: Mapping[str, Any]) -> S:
    """Convert ``extra_config`` to ``settings_type``.

    Args:
        connector: the connector's name, for messages.
        settings_type: the connector's settings Struct.
        extra_config: the raw settings.

    Returns:
        The settings.

    Raises:
        ConfigError: an unknown key (with the nearest valid one), a missing required key,
            or a value of the wrong type or out of bounds; the message names the connector
            and the key.
    """
    try:
        return msgspec.convert(dict(extra_config), type=settings_type, strict=False)
    except msgspec.ValidationError as exc:
        problem = find_field_problem(settings_type, extra_config, strict=False)
        msg = (f"{connector}: extra_config is not valid: {exc}" if problem is None
               else _explain(connector, settings_type, extra_config, problem))
        raise ConfigError(msg) from None


def _explain(connector: str, settings_type: type[msgspec.Struct],
             extra_config: Mapping[str, Any], problem: FieldProblem) -> str:
    """The message for one bad key: it names the key, its value and the valid choices."""
    key = problem.field
    valid = ", ".join(settings_type.__struct_fields__)
    if problem.kind == "unknown":
        close = did_you_mean(key, settings_type.__struct_fields__)
        return (f"{connector}: unknown extra_config key {key!r}{close}; "
                f"valid keys: {valid or 'none'}")
    if problem.kind == "missing":
        return f"{connector}: extra_config needs {key!r}; valid keys: {valid}"
    choices = field_choices(settings_type, key)
    hint = f"; valid: {', '.join(map(str, choices))}" if choices else ""
    return (f"{connector}: extra_config {key}={extra_config[key]!r} is not valid: "
            f"{problem.reason}{hint}")
