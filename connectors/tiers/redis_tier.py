"""Redis secondary tier (redis-py): a store several engine instances share.

Works against a single Redis and against Redis Cluster (``cluster=True``; any node's URL
bootstraps the slot map). Keys are ``kvc:<model>:<layout>:<tenant>:<hash hex>-g<group>``
where ``<tenant>`` is a digest of the tenant salt: engines of different models, KV
layouts or tenants never read each other's values. Values carry the checksum frame of
:mod:`connectors.tiers._base`; a corrupted value is a failed load.

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
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit

import msgspec

from connectors.tiers._base import SecondaryTier, TierKey, settings
from kvconnector_core.errors import ConfigError

__all__ = ["RedisTier", "RedisTierConfig"]


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
        if self.ttl_seconds is not None and (isinstance(self.ttl_seconds, bool) or self.ttl_seconds < 1):
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
                msg = f"redis tier password_file={self.password_file!r} cannot be read: {exc.strerror}"
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
    if config.tls or config.url.startswith("rediss://"):
        kwargs.update(ssl=True, ssl_ca_certs=config.tls_ca_file, ssl_certfile=config.tls_cert_file,
                      ssl_keyfile=config.tls_key_file)
    if config.cluster:
        from redis.cluster import RedisCluster

        # Partial coverage: with one master down, keys on the others still work.
        return RedisCluster.from_url(config.url, require_full_coverage=False,
                                     cluster_error_retry_attempts=1, **kwargs)
    return redis.Redis.from_url(config.url, **kwargs)


class RedisTier(SecondaryTier):
    """A :class:`SecondaryTier` in a single Redis or a Redis Cluster.

    Connecting is lazy (on the first I/O), so an engine starts even while Redis is down;
    redis-py reconnects on the next operation after a node comes back.
    """

    medium: ClassVar[str] = "REDIS"

    def __init__(self, config: RedisTierConfig | dict[str, Any], *, enable_events: bool = True) -> None:
        config = settings(config, RedisTierConfig, "redis tier")
        super().__init__(max_pending_stores=config.max_pending_stores,
                         io_threads=config.io_threads, enable_events=enable_events)
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

    def _batches(self, seq: Sequence[Any]) -> list[Sequence[Any]]:
        n = self.config.batch_size
        return [seq[i:i + n] for i in range(0, len(seq), n)]

    def _held_prefix(self, keys: Sequence[TierKey]) -> int:
        pipe = self._conn().pipeline(transaction=False)
        for key in keys:
            pipe.exists(self.redis_key(key))
        for i, found in enumerate(pipe.execute()):
            if not found:
                return i
        return len(keys)

    def _put(self, items: Sequence[tuple[TierKey, bytes]]) -> None:
        for batch in self._batches(items):
            pipe = self._conn().pipeline(transaction=False)
            for key, value in batch:
                pipe.set(self.redis_key(key), value, ex=self.config.ttl_seconds)
            pipe.execute()

    def _get(self, keys: Sequence[TierKey]) -> list[bytes | None]:
        values: list[bytes | None] = []
        for batch in self._batches(keys):
            pipe = self._conn().pipeline(transaction=False)
            for key in batch:
                pipe.get(self.redis_key(key))
            values.extend(pipe.execute())
        return values

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
