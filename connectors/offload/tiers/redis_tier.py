"""Redis secondary tier (redis-py): a store several engine instances share.

Works against a single Redis and against Redis Cluster (``cluster=True``; any node's URL
bootstraps the slot map). Keys are ``kvc:<model>:<layout>:<tenant>:<hash hex>-g<group>``
where ``<tenant>`` is a digest of the tenant salt: engines of different models, KV
layouts or tenants never read each other's values. Values carry the checksum frame of
:mod:`connectors.offload.tiers.base`; a corrupted value is a failed load.

I/O is batched and pipelined on the tier's threads, never on the engine thread: a
chain lookup is one pipeline of ``EXISTS`` (one round trip on a single node; one per
node holding part of the chain on a cluster), loads are pipelined ``GET`` s and stores
pipelined ``SET`` s of at most ``batch_size`` keys.

Eviction is Redis's: each value is written with a TTL (``ttl_seconds``; None keeps it
until ``maxmemory-policy`` — e.g. ``allkeys-lru`` — evicts it). Redis evicts silently, so
this tier emits stored events but no removal events; a lookup is the truth.

Security: ``username`` plus a password read from the environment (``password_env``) or
a file (``password_file``) for AUTH/ACL; the password is never part of the config, the
URL or a log line. ``tls=True`` (or a ``rediss://`` URL) uses TLS, with optional CA and
client certificate files.

Primitives: RedisTierConfig, RedisTier.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit

import msgspec

from connectors.offload.tiers.base import SecondaryTier
from connectors.offload.tiers.records import Shard, TierKey, settings
from kvconnector_core.errors import ConfigError

__all__ = ["RedisTier", "RedisTierConfig"]

logger = logging.getLogger(__name__)


class RedisTierConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Settings of a :class:`RedisTier` (``{"type": "redis", ...}`` in a tier list).

    Attributes:
        url: ``redis://host:port[/db]`` or ``rediss://`` (TLS); no password in it.
        cluster: talk to a Redis Cluster (the URL names any of its nodes).
        model: model name, part of every key.
        layout: KV layout (block size, layers, dtype, ...), part of every key.
        tenant_salt: separates tenants sharing one Redis; only its digest is in the keys.
        ttl_seconds: lifetime of each value; None leaves eviction to ``maxmemory-policy``.
        username: ACL user (None: the default user).
        password_env: environment variable holding the password.
        password_file: file holding the password (trailing newline ignored).
        tls: use TLS (implied by a ``rediss://`` URL).
        tls_ca_file: CA bundle that signs the server certificate.
        tls_cert_file: client certificate, for servers that require one.
        tls_key_file: key of the client certificate.
        socket_timeout: seconds before a Redis operation counts as failed.
        batch_size: keys per pipeline.
        max_pending_stores: store batches that may wait; more are dropped (back-pressure).
        io_threads: threads doing Redis I/O.
    """

    model: str
    layout: str
    url: str = "redis://127.0.0.1:6379/0"
    cluster: bool = False
    tenant_salt: str = ""
    ttl_seconds: int | None = 3600
    username: str | None = None
    password_env: str | None = None
    password_file: str | None = None
    tls: bool = False
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    socket_timeout: float = 1.0
    batch_size: int = 64
    max_pending_stores: int = 64
    io_threads: int = 2

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("redis", "rediss"):
            msg = f"redis tier url={self.url!r} must start with redis:// or rediss://"
            raise ConfigError(msg)
        if parts.password is not None or "password=" in parts.query:
            # Never echo the URL here: it holds the secret.
            msg = ("redis tier url contains a password; give it through password_env "
                   "(an environment variable) or password_file instead")
            raise ConfigError(msg)
        if self.password_env is not None and self.password_file is not None:
            msg = "give either password_env or password_file for the redis tier, not both"
            raise ConfigError(msg)
        if not self.model or not self.layout:
            msg = (f"redis tier needs a non-empty model and layout for its key namespace "
                   f"(got model={self.model!r}, layout={self.layout!r})")
            raise ConfigError(msg)
        ttl = self.ttl_seconds
        if ttl is not None and (isinstance(ttl, bool) or ttl < 1):
            msg = f"redis tier ttl_seconds must be a positive int or null, got {self.ttl_seconds!r}"
            raise ConfigError(msg)
        if self.batch_size < 1 or self.socket_timeout <= 0:
            msg = (f"redis tier batch_size must be >= 1 and socket_timeout > 0 "
                   f"(got {self.batch_size!r}, {self.socket_timeout!r})")
            raise ConfigError(msg)

    @property
    def key_prefix(self) -> str:
        """``kvc:<model>:<layout>:<tenant digest>:`` — every key of this tier starts with it."""
        tenant = hashlib.sha256(self.tenant_salt.encode()).hexdigest()[:16]
        return f"kvc:{self.model}:{self.layout}:{tenant}:"

    def password(self) -> str | None:
        """The password from ``password_env`` or ``password_file`` (None if neither is set).

        Raises:
            ConfigError: the variable is unset or the file unreadable (named, never the value).
        """
        if self.password_env is not None:
            value = os.environ.get(self.password_env)
            if value is None:
                msg = f"redis tier password_env={self.password_env!r} is not set in the environment"
                raise ConfigError(msg)
            return value
        if self.password_file is not None:
            try:
                return Path(self.password_file).read_text().rstrip("\r\n")
            except OSError as exc:
                msg = (f"redis tier password_file={self.password_file!r} cannot be read: "
                       f"{exc.strerror}")
                raise ConfigError(msg) from None
        return None


def _client(config: RedisTierConfig) -> Any:
    try:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry
    except ModuleNotFoundError:
        msg = "the redis tier needs redis-py: pip install 'kvconnector[redis]'"
        raise ConfigError(msg) from None
    kwargs: dict[str, Any] = {
        "username": config.username,
        "password": config.password(),
        "socket_timeout": config.socket_timeout,
        "socket_connect_timeout": config.socket_timeout,
        # One quick retry, no backoff: a dead node must turn into failed loads fast
        # (the request is recomputed), not into seconds of waiting.
        "retry": Retry(NoBackoff(), 1),
    }
    url = config.url
    if config.tls or url.startswith("rediss://"):
        # The rediss:// scheme is what makes redis-py use TLS connections.
        url = "rediss://" + url.removeprefix("redis://").removeprefix("rediss://")
        kwargs.update(ssl_ca_certs=config.tls_ca_file, ssl_certfile=config.tls_cert_file,
                      ssl_keyfile=config.tls_key_file)
    if config.cluster:
        from redis.cluster import RedisCluster

        # Partial coverage: with one master down, keys on the others still work.
        return RedisCluster.from_url(url, require_full_coverage=False, **kwargs)
    return redis.Redis.from_url(url, **kwargs)


class RedisTier(SecondaryTier):
    """A :class:`SecondaryTier` in a single Redis or a Redis Cluster.

    Connecting is lazy (on the first I/O), so an engine starts even while Redis is down;
    redis-py reconnects on the next operation after a node comes back.
    """

    medium: ClassVar[str] = "REDIS"
    # Redis evicts without telling: remember a bounded number of announced keys.
    max_announced: ClassVar[int | None] = 100_000

    def __init__(self, config: RedisTierConfig | dict[str, Any], *, enable_events: bool = True,
                 shard: Shard | None = None) -> None:
        if isinstance(config, dict) and "password" in config:
            msg = ("the redis tier takes no 'password' setting: a config file is no place for a "
                   "secret; name an environment variable (password_env) or a file (password_file)")
            raise ConfigError(msg)
        config = settings(config, RedisTierConfig, "redis tier")
        super().__init__(max_pending_stores=config.max_pending_stores,
                         io_threads=config.io_threads, enable_events=enable_events, shard=shard)
        self.config = config
        self._prefix = config.key_prefix
        self._redis: Any = None if config.cluster else _client(config)

    def _conn(self) -> Any:
        # A cluster client needs a live node to build its slot map, so it is made on
        # first use (and again after a failure left none).
        if self._redis is None:
            self._redis = _client(self.config)
        return self._redis

    def redis_key(self, key: TierKey) -> str:
        """The Redis key of ``key`` (namespaced by model, layout and tenant)."""
        return self._prefix + key.name

    def _by_node(self, names: Sequence[str]) -> list[tuple[Any, list[int]]]:
        """Split key positions by the client that serves them: one group on a single
        node, one per master on a cluster (so a dead master fails only its own keys)."""
        conn = self._conn()
        if not self.config.cluster:
            return [(conn, list(range(len(names))))]
        groups: dict[str, tuple[Any, list[int]]] = {}
        for i, name in enumerate(names):
            node = conn.get_node_from_key(name)
            groups.setdefault(node.name, (node, []))[1].append(i)
        return [(conn.get_redis_connection(node), idx) for node, idx in groups.values()]

    def _run(self, names: Sequence[str], add: Any, batch_size: int | None = None) -> list[Any]:
        """One pipeline per node (``add(pipe, position)`` queues a command); the result of a
        command whose node failed is the exception, so the other nodes' answers count."""
        results: list[Any] = [None] * len(names)
        for client, positions in self._by_node(names):
            n = batch_size or len(positions)
            for batch in (positions[i:i + n] for i in range(0, len(positions), n)):
                pipe = client.pipeline(transaction=False)
                for i in batch:
                    add(pipe, i)
                try:
                    answers = pipe.execute(raise_on_error=False)
                except Exception as exc:  # noqa: BLE001 - this node is down; others may not be
                    answers = [exc] * len(batch)
                for i, answer in zip(batch, answers, strict=True):
                    results[i] = answer
        return results

    def _held(self, keys: Sequence[TierKey]) -> list[bool]:
        names = [self.redis_key(k) for k in keys]
        # Unbatched: a chain's EXISTS go in one pipeline per node, one round trip each.
        found = self._run(names, lambda pipe, i: pipe.exists(names[i]))  # no batch limit
        errors = [a for a in found if isinstance(a, Exception)]
        if errors and len(errors) == len(found):
            raise errors[0]  # counted as a failed lookup: a miss
        if errors:  # a dead master: its keys are misses, the live masters' count
            logger.warning("REDIS tier: %d of %d lookups failed: %s", len(errors), len(found),
                           errors[0])
            self._count(lookup_failures=1)
        return [not isinstance(a, Exception) and bool(a) for a in found]

    def _put(self, items: Sequence[tuple[TierKey, Sequence[bytes | memoryview]]]) -> None:
        names = [self.redis_key(k) for k, _ in items]
        # redis-py sends a value as one buffer: join the frame header and the payload.
        values = [b"".join(parts) for _, parts in items]
        ttl = self.config.ttl_seconds
        results = self._run(names, lambda pipe, i: pipe.set(names[i], values[i], ex=ttl),
                            self.config.batch_size)
        errors = [r for r in results if isinstance(r, Exception)]
        if errors:
            raise errors[0]

    def _get(self, keys: Sequence[TierKey]) -> list[bytes | None]:
        names = [self.redis_key(k) for k in keys]
        values = self._run(names, lambda pipe, i: pipe.get(names[i]), self.config.batch_size)
        errors = [v for v in values if isinstance(v, Exception)]
        if errors:
            logger.warning("REDIS tier: %d of %d loads failed: %s", len(errors), len(values),
                           errors[0])
        return [None if isinstance(v, Exception) else v for v in values]

    def _on_bad_values(self, keys: list[TierKey]) -> None:
        # One DELETE per key: on a cluster, keys of one call must share a hash slot.
        for key in keys:
            try:
                self._conn().delete(self.redis_key(key))
            except Exception:  # noqa: BLE001 - best effort; the value fails its checksum anyway
                return

    def _close(self) -> None:
        if self._redis is not None:
            self._redis.close()
