"""The secondary tiers' small records: keys, events, loads in flight, settings parsing.

Primitives: :class:`TierKey`, :class:`Shard`, :class:`TierLoad`, :class:`TierEvent`,
:func:`settings`, and the key conversions :func:`tier_key` / :func:`offload_key`.
"""

from __future__ import annotations

import re
from concurrent.futures import Future
from typing import Any, NamedTuple, TypeVar

import msgspec

from connectors.offload.manager.policy import OffloadKey
from kvconnector_core.errors import ConfigError
from kvconnector_core.kv_cache.hashing import BlockHash

__all__ = ["Shard", "TierEvent", "TierKey", "TierLoad", "offload_key", "settings", "tier_key"]

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


class Shard(NamedTuple):
    """Which part of every KV block one worker holds under tensor / pipeline parallelism.

    Each of ``world_size`` workers holds a different shard of a block (its KV heads, its
    pipeline stage's layers). A shard of TP=2 is not a shard of TP=4, nor is a rank of
    TP=4 the same rank of TP=2 x PP=2, so the shard names all three numbers.

    Attributes:
        rank: the worker's global rank, ``pp_rank * tp_size + tp_rank`` (vLLM's numbering).
        world_size: workers of the engine (tensor x pipeline parallel size).
        pipeline_parallel_size: pipeline stages among them.
    """

    rank: int
    world_size: int
    pipeline_parallel_size: int = 1

    @property
    def tag(self) -> str:
        """The shard in a key name: ``-r<rank>of<tp size>x<pp size>``."""
        tp = self.world_size // self.pipeline_parallel_size
        return f"-r{self.rank}of{tp}x{self.pipeline_parallel_size}"

    @classmethod
    def all_of(cls, world_size: int, pipeline_parallel_size: int = 1) -> list[Shard | None]:
        """Every worker's shard, rank order; ``[None]`` for one worker (its keys carry none)."""
        if world_size == 1:
            return [None]
        return [cls(r, world_size, pipeline_parallel_size) for r in range(world_size)]


_NAME = re.compile(r"([0-9a-f]*)-g(\d+)(?:-r(\d+)of(\d+)x(\d+))?")


class TierKey(NamedTuple):
    """Key of one block value in a secondary tier.

    Attributes:
        block_hash: the chained block hash (it identifies the whole prefix).
        group: the KV cache group the block belongs to (hybrid models store per group).
        shard: the worker's shard of the block under tensor / pipeline parallelism; None
            with one worker (its key names and checksums are those of a key without it).
    """

    block_hash: BlockHash
    group: int = 0
    shard: Shard | None = None

    @property
    def name(self) -> str:
        """The key as text: ``<hash hex>-g<group>``, then the shard's tag if it has one
        (file and Redis key names use it)."""
        base = f"{self.block_hash.hex()}-g{self.group}"
        return base if self.shard is None else base + self.shard.tag

    @classmethod
    def from_name(cls, name: str) -> TierKey:
        """The key whose :attr:`name` is ``name``.

        Raises:
            ValueError: ``name`` is not a key name.
        """
        match = _NAME.fullmatch(name)
        if match is None:
            msg = f"{name!r} is not a tier key name (<hash hex>-g<group>[-r<rank>of<tp>x<pp>])"
            raise ValueError(msg)
        block_hex, group, rank, tp, pp = match.groups()
        shard = None if rank is None else Shard(int(rank), int(tp) * int(pp), int(pp))
        return cls(BlockHash(bytes.fromhex(block_hex)), int(group), shard)


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


def tier_key(key: OffloadKey, shard: Shard | None = None) -> TierKey:
    """The tier key of an offload key: its chained hash and its KV cache group (the key's
    last 4 bytes), and the shard of the worker that holds the value (None: one worker)."""
    return TierKey(BlockHash(key[:-4]), int.from_bytes(key[-4:], "big"), shard)


def offload_key(key: TierKey) -> OffloadKey:
    """The offload key of a tier key (its shard dropped): the inverse of :func:`tier_key`."""
    return OffloadKey(key.block_hash + key.group.to_bytes(4, "big"))
