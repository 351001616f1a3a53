"""Connector configuration: which connector to create and how.

:class:`KVConnectorConfig` is the typed counterpart of vLLM's ``KVTransferConfig``
(only the fields a connector framework needs). It is a msgspec Struct, so it
loads from a plain dict (``msgspec.convert``, see :meth:`KVConnectorConfig.from_dict`)
or from a JSON file (:func:`load_connector_config`) with type errors that name
the bad field.

Primitives: :class:`KVConnectorConfig`, :func:`load_connector_config`,
:data:`KV_ROLES`, :data:`LOAD_FAILURE_POLICIES`.
"""

from __future__ import annotations

import os
import re
from typing import Any

import msgspec

from kvconnector_core.errors import ConfigError

__all__ = [
    "KV_ROLES",
    "LOAD_FAILURE_POLICIES",
    "KVConnectorConfig",
    "load_connector_config",
]

KV_ROLES: tuple[str, ...] = ("kv_producer", "kv_consumer", "kv_both")
"""Valid values of :attr:`KVConnectorConfig.role`."""

LOAD_FAILURE_POLICIES: tuple[str, ...] = ("recompute", "fail")
"""Valid values of :attr:`KVConnectorConfig.load_failure_policy`."""


DEFAULT_QUARANTINE_AFTER_RAISES = 8
"""Default of :attr:`KVConnectorConfig.quarantine_after_raises`: at a 10% raise rate, eight
raises in a row of one hook come once in 10^8 calls, so only a broken hook gets there."""


class KVConnectorConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Which connector to create, and its settings.

    Attributes:
        name: registered connector name or alias (e.g. ``"MultiConnector"``,
            ``"cpu_offload"``); with ``module_path``, the class name in that module.
        role: ``"kv_producer"`` (only saves), ``"kv_consumer"`` (only loads)
            or ``"kv_both"``.
        extra_config: connector-specific settings, documented by each connector.
        module_path: import path of a module holding class ``name``; when set it
            wins over the registry (like vLLM's ``kv_connector_module_path``).
        engine_id: identifies the engine instance to connectors that share
            state between engines; None lets the connector choose.
        load_failure_policy: what the scheduler does when a KV load fails:
            ``"recompute"`` the missing tokens or ``"fail"`` the request.
        world_size: how many worker processes (tensor/pipeline-parallel ranks)
            report to the scheduler side; a transfer job is done only when all
            of them have reported it. 1 in kvconnector's own engine; the vLLM
            adapter sets it from vLLM's parallel config.
        rank: this worker's global rank among the ``world_size`` (``pp_rank * tp_size +
            tp_rank``, vLLM's numbering); connectors that keep per-worker data in a store
            shared by workers (cpu_offload's secondary tiers) key it by rank. 0 for the
            scheduler-role instance; the vLLM adapter sets it from vLLM's parallel config.
        pipeline_parallel_size: how many of the ``world_size`` workers are pipeline
            stages (the rest is tensor parallelism); with ``rank`` it names the shard of
            every KV block a worker holds.
        quarantine_after_raises: the failure contract's quarantine: once one hook
            of this connector raised this many times in a row, the engine's guard
            stops sending loads and stores through it (see
            ``docs/failure-contract.md``). None never quarantines.
        enable_kv_cache_events: whether anyone consumes the connector's KV events
            (``take_events``); a connector builds none when False, as vLLM 0.33's
            connectors do without ``kv_events_config.enable_kv_cache_events``. Set by
            the engine from :attr:`EngineConfig.enable_kv_cache_events` and by the vLLM
            adapter from vLLM's ``kv_events_config``; True for a connector built alone.

    Raises:
        ConfigError: on construction, when ``name`` is empty or ``role`` /
            ``load_failure_policy`` is not one of the valid values; when loaded
            from a dict or file, also for a field this class does not have
            (the message names the nearest valid one).
    """

    name: str
    role: str = "kv_both"
    extra_config: dict[str, Any] = msgspec.field(default_factory=dict)
    module_path: str | None = None
    engine_id: str | None = None
    load_failure_policy: str = "recompute"
    world_size: int = 1
    rank: int = 0
    pipeline_parallel_size: int = 1
    quarantine_after_raises: int | None = DEFAULT_QUARANTINE_AFTER_RAISES
    enable_kv_cache_events: bool = True

    def __post_init__(self) -> None:
        # msgspec runs __post_init__ on decode/convert too, so a bad file is
        # rejected with the same message as a bad constructor call.
        if not self.name:
            msg = "KVConnectorConfig.name must be a non-empty connector name"
            raise ConfigError(msg)
        if self.role not in KV_ROLES:
            msg = f"KVConnectorConfig.role must be one of {list(KV_ROLES)}, got {self.role!r}"
            raise ConfigError(msg)
        if self.load_failure_policy not in LOAD_FAILURE_POLICIES:
            msg = (
                f"KVConnectorConfig.load_failure_policy must be one of "
                f"{list(LOAD_FAILURE_POLICIES)}, got {self.load_failure_policy!r}"
            )
            raise ConfigError(msg)
        if self.world_size < 1:
            msg = f"KVConnectorConfig.world_size must be a number of workers >= 1, got {self.world_size!r}"
            raise ConfigError(msg)
        if not 0 <= self.rank < self.world_size:
            msg = (f"KVConnectorConfig.rank must be a worker rank in [0, {self.world_size}) "
                   f"(world_size={self.world_size}), got {self.rank!r}")
            raise ConfigError(msg)
        if self.pipeline_parallel_size < 1 or self.world_size % self.pipeline_parallel_size:
            msg = (f"KVConnectorConfig.pipeline_parallel_size must be >= 1 and divide "
                   f"world_size={self.world_size}, got {self.pipeline_parallel_size!r}")
            raise ConfigError(msg)
        if self.quarantine_after_raises is not None and self.quarantine_after_raises < 1:
            msg = ("KVConnectorConfig.quarantine_after_raises must be a number of raises >= 1 or None "
                   f"(never), got {self.quarantine_after_raises!r}")
            raise ConfigError(msg)
        if self.module_path == "":
            msg = "KVConnectorConfig.module_path must be a module import path or None, got ''"
            raise ConfigError(msg)

    @property
    def is_kv_producer(self) -> bool:
        """True when this connector saves KV (role ``kv_producer`` or ``kv_both``)."""
        return self.role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        """True when this connector loads KV (role ``kv_consumer`` or ``kv_both``)."""
        return self.role in ("kv_consumer", "kv_both")

    def get_from_extra_config(self, key: str, default: Any = None) -> Any:
        """Return ``extra_config[key]``, or ``default`` when the key is absent."""
        return self.extra_config.get(key, default)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | KVConnectorConfig) -> KVConnectorConfig:
        """Build a config from a plain dict (as parsed from JSON or TOML).

        Args:
            data: a mapping with the fields of this class (or a config, returned as is).

        Returns:
            The validated config.

        Raises:
            ConfigError: a field is missing, has the wrong type, or an invalid value.
        """
        if isinstance(data, KVConnectorConfig):
            return data
        try:
            return msgspec.convert(data, type=cls)
        except msgspec.ValidationError as exc:
            msg = f"invalid connector config {data!r}: {_explain(exc)}"
            raise ConfigError(msg) from exc

    def to_dict(self) -> dict[str, Any]:
        """Return the config as a plain dict (the inverse of :meth:`from_dict`)."""
        as_dict: dict[str, Any] = msgspec.to_builtins(self)
        return as_dict


def load_connector_config(path: str | os.PathLike[str]) -> KVConnectorConfig:
    """Load a connector config from a JSON file.

    Args:
        path: file holding one JSON object with the fields of :class:`KVConnectorConfig`.

    Returns:
        The validated config.

    Raises:
        ConfigError: the file cannot be read, is not valid JSON, or holds an
            invalid config; the message names the file.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        msg = f"cannot read connector config {os.fspath(path)!r}: {exc}"
        raise ConfigError(msg) from exc
    try:
        return msgspec.json.decode(raw, type=KVConnectorConfig)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        msg = f"invalid connector config in {os.fspath(path)!r}: {_explain(exc)}"
        raise ConfigError(msg) from exc


def _explain(exc: msgspec.MsgspecError) -> str:
    """msgspec's message, plus the nearest valid field for an unknown one."""
    text = str(exc)
    unknown = re.match(r"Object contains unknown field `([^`]*)`(?: - at `\$(?P<at>[^`]*)`)?", text)
    if unknown is None:
        return text
    from kvconnector_core._suggest import did_you_mean

    fields = KVConnectorConfig.__struct_fields__
    where = f" at {unknown['at']}" if unknown["at"] else ""
    return (f"unknown field {unknown[1]!r}{where}{did_you_mean(unknown[1], fields)}; "
            f"valid fields: {', '.join(fields)}")
