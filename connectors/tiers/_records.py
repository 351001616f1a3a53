"""The secondary tiers' small records: keys, events, loads in flight, settings parsing.

Split from :mod:`connectors.tiers._base` (which re-exports them) to keep that module
about the tier machinery.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, NamedTuple, TypeVar

import msgspec

from kvconnector_core.errors import ConfigError
from kvconnector_core.kv_cache.hashing import BlockHash

__all__ = ["TierEvent", "TierKey", "TierLoad", "settings"]

_S = TypeVar("_S")


def settings(config: _S | dict[str, Any], cls: type[_S], what: str) -> _S:
    """``config`` as a ``cls`` settings record; a dict is validated into one.

    Raises:
        ConfigError: a missing, unknown or invalid field (the message names it).
    """
    if isinstance(config, cls):
        return config
    try:
        return msgspec.convert(config, cls)
    except msgspec.ValidationError as exc:
        msg = f"{what} settings are invalid: {exc}"
        raise ConfigError(msg) from None


class TierKey(NamedTuple):
    """Key of one block value in a secondary tier.

    Attributes:
        block_hash: the chained block hash (it identifies the whole prefix).
        group: the KV cache group the block belongs to (hybrid models store per group).
    """

    block_hash: BlockHash
    group: int = 0

    @property
    def name(self) -> str:
        """The key as text: ``<hash hex>-g<group>`` (file and Redis key names use it)."""
        return f"{self.block_hash.hex()}-g{self.group}"


class TierEvent(NamedTuple):
    """Keys a tier stored or removed (the connector turns these into wire KV events).

    Consistent with what the tier holds: a key is announced once when it enters the
    tier (storing it again announces nothing) and removed once when it goes, so a
    replica that applies the events holds exactly the keys the tier holds (as far as
    this process knows; see :meth:`SecondaryTier.take_events`).
    """

    keys: tuple[TierKey, ...]
    medium: str
    removed: bool


class TierLoad:
    """A load in flight: :meth:`done` polls, :meth:`values` gives one result per key: the
    payload (``load``) or True (``load_into``: it is in its buffers), None where it failed."""

    def __init__(self, keys: tuple[TierKey, ...], futures: list[Future[list[Any]]]) -> None:
        self.keys = keys
        self._futures = futures  # consecutive parts of ``keys``, read in parallel

    def done(self) -> bool:
        """True once every value is read (or failed)."""
        return all(f.done() for f in self._futures)

    def values(self, timeout: float | None = None) -> list[Any]:
        """The results in key order; None for each key that failed. Waits up to ``timeout``."""
        return [v for f in self._futures for v in f.result(timeout)]
