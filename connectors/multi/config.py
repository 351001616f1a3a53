"""Settings of :class:`~connectors.multi.MultiConnector`: its typed ``extra_config``.

``extra_config`` lists the children in priority order, each a connector config whose
``role``, ``engine_id``, ``load_failure_policy``, ``enable_kv_cache_events``,
``world_size``, ``rank`` and ``pipeline_parallel_size`` default to the multi's own::

    {"connectors": [{"name": "TTLPinConnector", "extra_config": {...}},
                    {"name": "cpu_offload", "extra_config": {...}}],
     "loader_policy": "longest"}          # or "first"; default "longest"

Primitives: :class:`ChildConfig`, :class:`MultiSettings`.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import UNSET, UnsetType

from connectors.multi.policy import LOADER_POLICIES, LoaderSelectionPolicy
from kvconnector_core._suggest import did_you_mean
from kvconnector_core.connector.config import DEFAULT_QUARANTINE_AFTER_RAISES, KVConnectorConfig
from kvconnector_core.connector.settings import ConnectorSettings
from kvconnector_core.errors import ConfigError

__all__ = ["ChildConfig", "MultiSettings"]

_WHERE = "MultiConnector extra_config['connectors']"
# A child inherits the parent's KVConnectorConfig.ENGINE_FIELDS unless it sets them. Every
# child runs on every worker: a store is complete only once all report it (world_size),
# and on each worker a child holds that worker's shard of every block (rank,
# pipeline_parallel_size). Those three only the engine knows: a child cannot set others.
_TOPOLOGY = ("world_size", "rank", "pipeline_parallel_size")


class ChildConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """One child's connector config, as written: the fields of
    :class:`~kvconnector_core.connector.config.KVConnectorConfig`, those a child inherits
    left unset until :meth:`resolve`.

    Attributes:
        name: the child's registered name (or class name with ``module_path``).
        role: ``"kv_producer"``, ``"kv_consumer"`` or ``"kv_both"``; default: the multi's.
        extra_config: the child's own settings.
        module_path: import path of the module holding class ``name``.
        engine_id: default: the multi's.
        load_failure_policy: default: the multi's.
        world_size: default: the multi's.
        rank: default: the multi's.
        pipeline_parallel_size: default: the multi's.
        quarantine_after_raises: see ``KVConnectorConfig``.
        enable_kv_cache_events: default: the multi's.
    """

    name: str
    role: str | UnsetType = UNSET
    extra_config: dict[str, Any] = msgspec.field(default_factory=dict)
    module_path: str | None = None
    engine_id: str | UnsetType | None = UNSET
    load_failure_policy: str | UnsetType = UNSET
    world_size: int | UnsetType = UNSET
    rank: int | UnsetType = UNSET
    pipeline_parallel_size: int | UnsetType = UNSET
    quarantine_after_raises: int | None = DEFAULT_QUARANTINE_AFTER_RAISES
    enable_kv_cache_events: bool | UnsetType = UNSET

    @classmethod
    def parse(cls, index: int, raw: Any, parent: KVConnectorConfig) -> ChildConfig:
        """Convert entry ``index`` of ``extra_config['connectors']``.

        Args:
            index: the entry's position, for messages.
            raw: a dict, or a ready :class:`KVConnectorConfig` (taken whole, but for the
                worker it runs as: ``world_size``, ``rank`` and
                ``pipeline_parallel_size`` are always the multi's).
            parent: the multi's config, to explain a bad entry as the child's config.

        Raises:
            ConfigError: the entry is not a dict, or not a valid connector config (the
                message is the one a top-level config gets, prefixed with where it is).
        """
        if isinstance(raw, KVConnectorConfig):
            child = msgspec.convert(raw, cls, from_attributes=True)
            return msgspec.structs.replace(child, **dict.fromkeys(_TOPOLOGY, UNSET))
        if not isinstance(raw, dict):
            msg = f"{_WHERE}[{index}] must be a dict, got {raw!r}"
            raise ConfigError(msg)
        try:
            return msgspec.convert(raw, cls)
        except msgspec.ValidationError as exc:
            # The child's own config type explains the error as for a top-level connector.
            try:
                KVConnectorConfig.from_dict({**parent.engine_fields(), **raw})
            except ConfigError as explained:
                msg = f"{_WHERE}[{index}]: {explained}"
                raise ConfigError(msg) from exc
            msg = f"{_WHERE}[{index}]: invalid connector config {raw!r}: {exc}"
            raise ConfigError(msg) from exc

    def resolve(self, index: int, parent: KVConnectorConfig) -> KVConnectorConfig:
        """The child's full config: the fields it sets, the rest inherited from ``parent``.

        Raises:
            ConfigError: a field's value is invalid, or a worker field differs from the
                multi's (prefixed with where the child is).
        """
        given = msgspec.to_builtins(self)  # unset fields are left out
        for key in _TOPOLOGY:
            if key in given and given[key] != getattr(parent, key):
                msg = (f"{_WHERE}[{index}]: {key}={given[key]}, but a child runs on every "
                       f"worker of the MultiConnector: {key} is the engine's "
                       f"({getattr(parent, key)}); leave it out")
                raise ConfigError(msg)
        try:
            return KVConnectorConfig.from_dict({**parent.engine_fields(), **given})
        except ConfigError as exc:
            msg = f"{_WHERE}[{index}]: {exc}"
            raise ConfigError(msg) from exc



class MultiSettings(ConnectorSettings):
    """MultiConnector's ``extra_config``.

    Attributes:
        connectors: the children's configs, in priority order (at least one).
        loader_policy: a key of :data:`~connectors.multi.policy.LOADER_POLICIES`.

    Raises:
        ConfigError: ``loader_policy`` is not a known policy (the message lists them).
    """

    connectors: Annotated[list[ChildConfig], msgspec.Meta(min_length=1)]
    loader_policy: str = "longest"

    def __post_init__(self) -> None:
        if self.loader_policy not in LOADER_POLICIES:
            msg = (f"MultiConnector loader_policy {self.loader_policy!r} is unknown; "
                   f"known policies: {sorted(LOADER_POLICIES)}")
            raise ConfigError(msg)

    @classmethod
    def from_config(cls, config: KVConnectorConfig) -> MultiSettings:
        """Convert ``config.extra_config``.

        Children may be given as dicts or as ready :class:`KVConnectorConfig` objects (as
        :func:`~kvconnector_core.testing.faults.fault_injection_config` makes them).

        Raises:
            ConfigError: ``config`` is not a KVConnectorConfig; an unknown key (with the
                nearest valid one); ``connectors`` missing, empty or holding an entry that
                is not a connector config; an unknown loader policy.
        """
        if not isinstance(config, KVConnectorConfig):
            msg = (f"MultiConnector needs a KVConnectorConfig, got "
                   f"{type(config).__qualname__}: {config!r}")
            raise ConfigError(msg)
        extra = config.extra_config
        valid = cls.__struct_fields__
        unknown = sorted(set(extra) - set(valid))
        if unknown:
            # A misspelt 'connectors' would otherwise read as "got None" below.
            msg = (f"MultiConnector: unknown extra_config key {unknown[0]!r}"
                   f"{did_you_mean(unknown[0], valid)}; valid keys: {', '.join(sorted(valid))}")
            raise ConfigError(msg)
        raw = extra.get("connectors")
        if not isinstance(raw, list) or not raw:
            msg = (f"MultiConnector needs extra_config['connectors'], a non-empty list of "
                   f"connector configs (dicts with at least 'name'), got {raw!r}")
            raise ConfigError(msg)
        children = [ChildConfig.parse(i, child, config) for i, child in enumerate(raw)]
        return cls(connectors=children, loader_policy=extra.get("loader_policy", "longest"))

    def child_configs(self, parent: KVConnectorConfig) -> list[KVConnectorConfig]:
        """The children's full configs (see :meth:`ChildConfig.resolve`).

        Raises:
            ConfigError: a child's field is invalid, or a child repeats an earlier one.
        """
        configs = [child.resolve(i, parent) for i, child in enumerate(self.connectors)]
        for i, cfg in enumerate(configs):
            first = configs.index(cfg)
            if first < i:  # every child stores every block: a repeated child stores it twice
                msg = (f"{_WHERE}[{i}] repeats child {first} "
                       f"({cfg.name!r} with the same settings); remove one of them")
                raise ConfigError(msg)
        return configs

    def make_policy(self) -> LoaderSelectionPolicy:
        """A new instance of the policy named by :attr:`loader_policy`."""
        return LOADER_POLICIES[self.loader_policy]()
