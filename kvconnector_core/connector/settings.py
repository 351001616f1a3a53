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

import re
import typing
from collections.abc import Mapping
from typing import Any, Literal, TypeVar

import msgspec

from kvconnector_core._suggest import did_you_mean
from kvconnector_core.errors import ConfigError

__all__ = ["ConnectorSettings", "convert_settings"]

S = TypeVar("S", bound=msgspec.Struct)

# msgspec ends a validation message with " - at `$.key...`"; the key is what we report.
_AT = re.compile(r"^(?P<reason>.*?)(?: - at `\$\.?(?P<path>[^`]*)`)?$", re.DOTALL)


class ConnectorSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base class of a connector's settings (keyword-only, unknown keys rejected)."""


def _literal_choices(settings_type: type, key: str) -> tuple[Any, ...]:
    """The allowed values of ``key`` when it is typed as a ``Literal`` or a bool (as JSON
    writes them; ``"true"``/``"false"`` strings convert too), else ``()``."""
    hint = typing.get_type_hints(settings_type).get(key)
    if hint is bool:
        return ("true", "false")
    return typing.get_args(hint) if typing.get_origin(hint) is Literal else ()


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
    valid = settings_type.__struct_fields__
    for key in extra_config:
        if key not in valid:
            msg = (f"{connector}: unknown extra_config key {key!r}{did_you_mean(str(key), valid)}; "
                   f"valid keys: {', '.join(valid) or 'none'}")
            raise ConfigError(msg)
    try:
        return msgspec.convert(dict(extra_config), type=settings_type, strict=False)
    except msgspec.ValidationError as exc:
        match = _AT.match(str(exc))
        reason = match["reason"] if match else str(exc)
        key = (match["path"] or "") if match else ""
        missing = re.search(r"missing required field `([^`]+)`", reason)
        if missing:
            msg = f"{connector}: extra_config needs {missing[1]!r}; valid keys: {', '.join(valid)}"
            raise ConfigError(msg) from None
        if key and key.split(".")[0].split("[")[0] in extra_config:
            root = key.split(".")[0].split("[")[0]
            choices = _literal_choices(settings_type, root)
            hint = f"; valid: {', '.join(map(str, choices))}" if choices else ""
            msg = (f"{connector}: extra_config {key}={extra_config[root]!r} is not valid: "
                   f"{reason}{hint}")
        else:
            msg = f"{connector}: extra_config is not valid: {reason}"
        raise ConfigError(msg) from None
