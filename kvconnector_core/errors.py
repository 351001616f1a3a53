"""The kvconnector error hierarchy.

Every error the framework raises on purpose derives from :class:`KVConnectorError`,
and also from the builtin that fits, so ``except ValueError`` keeps working::

    KVConnectorError (Exception)
    ├── ConfigError (ValueError)               bad configuration value
    │   └── BlockSizeError                      scheduler/hash/group block sizes disagree
    ├── NoFreeBlocksError (RuntimeError)        the block pool cannot hand out the blocks asked for
    ├── InvariantError (RuntimeError)           internal state broke a documented invariant
    ├── RegistryError (LookupError)             connector registry problems
    │   ├── UnknownConnectorError (also ValueError)   no connector of that name
    │   ├── DuplicateConnectorError             two classes claim one name
    │   ├── InvalidConnectorError (also TypeError)    a registered object is not a connector
    │   └── PluginLoadError                     an entry point failed to import
    │       └── PluginDeniedError               the allow/deny lists exclude a connector module
    ├── ConnectorHookError (RuntimeError)       a connector hook raised; carries connector and hook
    ├── TransferError (RuntimeError)            a KV transfer failed
    └── ShutdownError (RuntimeError)            one or more connectors failed to shut down

Messages name the bad value and what would be valid; the offending values are
also kept as attributes so callers can act on them without parsing text.
"""

from __future__ import annotations

__all__ = [
    "BlockSizeError",
    "ConfigError",
    "ConnectorHookError",
    "DuplicateConnectorError",
    "InvalidConnectorError",
    "InvariantError",
    "KVConnectorError",
    "NoFreeBlocksError",
    "PluginDeniedError",
    "PluginLoadError",
    "RegistryError",
    "ShutdownError",
    "TransferError",
    "UnknownConnectorError",
]


class KVConnectorError(Exception):
    """Base class of every error raised on purpose by kvconnector."""


class ConfigError(KVConnectorError, ValueError):
    """A configuration value is invalid; the message names it and the valid choices."""


class BlockSizeError(ConfigError):
    """Scheduler, hash and KV-cache-group block sizes are inconsistent.

    Attributes:
        scheduler_block_size: the scheduler block size that was given.
        hash_block_size: the hash block size that was given.
        group_block_sizes: the block size of every KV cache group.
    """

    def __init__(self, msg: str, scheduler_block_size: int, hash_block_size: int,
                 group_block_sizes: tuple[int, ...]) -> None:
        super().__init__(msg)
        self.scheduler_block_size = scheduler_block_size
        self.hash_block_size = hash_block_size
        self.group_block_sizes = group_block_sizes


class NoFreeBlocksError(KVConnectorError, RuntimeError):
    """The block pool has fewer free blocks than requested.

    Attributes:
        requested: number of blocks asked for.
        available: number of free blocks at the time.
    """

    def __init__(self, requested: int, available: int) -> None:
        super().__init__(
            f"cannot allocate {requested} blocks: only {available} free blocks in the pool"
        )
        self.requested = requested
        self.available = available


class InvariantError(KVConnectorError, RuntimeError):
    """Internal state broke a documented invariant (a bug, here or in a caller)."""


class RegistryError(KVConnectorError, LookupError):
    """Base class of connector-registry errors."""


class UnknownConnectorError(RegistryError, ValueError):
    """No connector is registered under the requested name."""


class DuplicateConnectorError(RegistryError):
    """Two different classes claim the same connector name."""


class InvalidConnectorError(RegistryError, TypeError):
    """A registered object is not a connector class."""


class PluginLoadError(RegistryError):
    """An entry point in group ``kvconnector`` (or a connector ``module_path``) failed to load."""


class PluginDeniedError(PluginLoadError):
    """The allow/deny lists exclude a connector ``module_path``; it was not imported."""


class ConnectorHookError(KVConnectorError, RuntimeError):
    """A connector hook raised; the engine contained it.

    Attributes:
        connector: name of the connector.
        hook: name of the hook that raised.
    """

    def __init__(self, msg: str, connector: str, hook: str) -> None:
        super().__init__(msg)
        self.connector = connector
        self.hook = hook


class TransferError(KVConnectorError, RuntimeError):
    """Moving KV blocks between tiers failed."""


class ShutdownError(KVConnectorError, RuntimeError):
    """One or more connectors failed to shut down.

    Attributes:
        failures: ``(connector name, exception)`` for every failure.
    """

    def __init__(self, failures: list[tuple[str, BaseException]]) -> None:
        lines = "\n".join(f"  - {name}: {type(exc).__name__}: {exc}" for name, exc in failures)
        super().__init__(f"{len(failures)} connector(s) failed to shut down:\n{lines}")
        self.failures = failures
