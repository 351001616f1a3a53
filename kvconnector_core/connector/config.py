"""Connector configuration: which connector to create and how.

:class:`KVConnectorConfig` is the typed counterpart of vLLM's ``KVTransferConfig``
(only the fields a connector framework needs). It is a msgspec Struct, so it
loads from a plain dict (``msgspec.convert``, see :meth:`KVConnectorConfig.from_dict`)
or from a JSON file (:func:`load_connector_config`) with errors that name the bad field,
its value and the nearest valid one.

Each field's valid values are in its type (``Literal`` choices, ``msgspec.Meta``
bounds); each closed choice is defined once, as a ``Literal`` alias, and its tuple of
values derived from it. The connector ``name`` stays open (plugins add names): the
registry checks it.

Primitives: :class:`KVConnectorConfig`, :func:`load_connector_config`,
:data:`KVRole`, :data:`LoadFailurePolicy`, :data:`KV_ROLES`, :data:`LOAD_FAILURE_POLICIES`,
:data:`DEFAULT_QUARANTINE_AFTER_RAISES`.
"""

from __future__ import annotations

import os
import typing
from typing import Annotated, Any, ClassVar, Literal

import msgspec

from kvconnector_core._suggest import did_you_mean
from kvconnector_core.connector.validation import find_field_problem
from kvconnector_core.errors import ConfigError

__all__ = [
    "DEFAULT_QUARANTINE_AFTER_RAISES",
    "KV_ROLES",
    "LOAD_FAILURE_POLICIES",
    "KVConnectorConfig",
    "KVRole",
    "LoadFailurePolicy",
    "load_connector_config",
]

KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
"""What a connector does with KV: only saves, only loads, or both."""

LoadFailurePolicy = Literal["recompute", "fail"]
"""What the scheduler does when a KV load fails: recompute the tokens or fail the request."""

KV_ROLES: tuple[str, ...] = typing.get_args(KVRole)
"""Valid values of :attr:`KVConnectorConfig.role`."""

LOAD_FAILURE_POLICIES: tuple[str, ...] = typing.get_args(LoadFailurePolicy)
"""Valid values of :attr:`KVConnectorConfig.load_failure_policy`."""

DEFAULT_QUARANTINE_AFTER_RAISES = 8
"""Default of :attr:`KVConnectorConfig.quarantine_after_raises`: at a 10% raise rate, eight
raises in a row of one hook come once in 10^8 calls, so only a broken hook gets there."""

_NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]
_Positive = Annotated[int, msgspec.Meta(ge=1)]

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
        ConfigError: on construction, when a field's value does not fit its type (an
            empty ``name``, a ``role`` or ``load_failure_policy`` not among the choices,
            a count below 1) or ``rank`` / ``pipeline_parallel_size`` do not fit
            ``world_size``; when loaded from a dict or file, also for a field this class
            does not have. The message names the field, the bad value and the nearest
            valid one.
    """

    name: _NonEmpty
    role: KVRole = "kv_both"
    extra_config: dict[str, Any] = msgspec.field(default_factory=dict)
    module_path: _NonEmpty | None = None
    engine_id: str | None = None
    load_failure_policy: LoadFailurePolicy = "recompute"
    world_size: _Positive = 1
    rank: Annotated[int, msgspec.Meta(ge=0)] = 0
    pipeline_parallel_size: _Positive = 1
    quarantine_after_raises: _Positive | None = DEFAULT_QUARANTINE_AFTER_RAISES
    enable_kv_cache_events: bool = True

    ENGINE_FIELDS: ClassVar[tuple[str, ...]] = (
        "role", "engine_id", "load_failure_policy", "enable_kv_cache_events", "world_size",
        "rank", "pipeline_parallel_size")
    """The fields the engine sets on the connector it builds (vLLM's adapter from vLLM's
    config): a connector built inside another one (a MultiConnector child, the connector a
    FaultInjector wraps) takes them from its parent."""

    def __post_init__(self) -> None:
        # msgspec checks the field types on decode and convert, not in the constructor, and
        # a rule between fields in neither: both are checked here (msgspec runs this on
        # decode too), so a bad constructor call and a bad file fail with one message.
        problem = find_field_problem(type(self), {f: getattr(self, f)
                                                  for f in self.__struct_fields__})
        field = problem.field if problem is not None else self._cross_field_problem()
        if field is not None:
            raise ConfigError(_field_error(field, getattr(self, field), self.world_size,
                                           problem.reason if problem is not None else ""))

    def _cross_field_problem(self) -> str | None:
        """The field breaking a rule between fields (rank and pipeline stages against
        ``world_size``), or None."""
        if self.rank >= self.world_size:
            return "rank"
        if self.world_size % self.pipeline_parallel_size:
            return "pipeline_parallel_size"
        return None

    @property
    def is_kv_producer(self) -> bool:
        """True when this connector saves KV (role ``kv_producer`` or ``kv_both``)."""
        return self.role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        """True when this connector loads KV (role ``kv_consumer`` or ``kv_both``)."""
        return self.role in ("kv_consumer", "kv_both")

    def engine_fields(self) -> dict[str, Any]:
        """This config's :attr:`ENGINE_FIELDS`, by name."""
        return {field: getattr(self, field) for field in self.ENGINE_FIELDS}

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
        return _convert(data, repr(data))

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
        data = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        msg = f"invalid connector config in {os.fspath(path)!r}: {exc}"
        raise ConfigError(msg) from exc
    return _convert(data, f"in {os.fspath(path)!r}")


def _convert(data: Any, where: str) -> KVConnectorConfig:
    """``data`` as a config; msgspec's error becomes a ConfigError naming ``where``."""
    try:
        return msgspec.convert(data, type=KVConnectorConfig)
    except msgspec.ValidationError as exc:
        msg = f"invalid connector config {where}: {_explain(exc, data)}"
        raise ConfigError(msg) from exc


def _explain(exc: msgspec.ValidationError, data: Any) -> str:
    """The project's message for a config msgspec refused."""
    if isinstance(exc.__cause__, ConfigError):  # raised by __post_init__: already worded
        return str(exc.__cause__)
    problem = find_field_problem(KVConnectorConfig, data)
    if problem is None:
        return str(exc)
    fields = KVConnectorConfig.__struct_fields__
    if problem.kind == "unknown":
        return (f"unknown field {problem.field!r}{did_you_mean(problem.field, fields)}; "
                f"valid fields: {', '.join(fields)}")
    if problem.kind == "missing":
        return f"missing required field {problem.field!r}; valid fields: {', '.join(fields)}"
    return _field_error(problem.field, data[problem.field], data.get("world_size", 1),
                        problem.reason)


_CHOICES: dict[str, tuple[str, ...]] = {"role": KV_ROLES,
                                        "load_failure_policy": LOAD_FAILURE_POLICIES}


def _requirement(field: str, world_size: Any) -> str | None:
    """What a valid value of ``field`` is, in words (None: say msgspec's reason)."""
    return {
        "name": "a non-empty connector name",
        "role": f"one of {list(KV_ROLES)}",
        "module_path": "a module import path or None",
        "load_failure_policy": f"one of {list(LOAD_FAILURE_POLICIES)}",
        "world_size": "a number of workers >= 1",
        "rank": f"a worker rank in [0, {world_size}) (world_size={world_size})",
        "pipeline_parallel_size": f">= 1 and divide world_size={world_size}",
        "quarantine_after_raises": "a number of raises >= 1 or None (never)",
    }.get(field)


def _field_error(field: str, value: Any, world_size: Any, reason: str) -> str:
    """The message for a bad value: the field, what it must be, the value and, for a
    closed choice, the nearest valid one."""
    requirement = _requirement(field, world_size)
    if requirement is None:
        return f"KVConnectorConfig.{field}={value!r} is not valid: {reason}"
    choices = _CHOICES.get(field, ())
    hint = did_you_mean(value, choices) if choices and isinstance(value, str) else ""
    return f"KVConnectorConfig.{field} must be {requirement}, got {value!r}{hint}"
