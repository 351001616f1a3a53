"""The Redis tier against real redis-server processes: a single node and a 3-master cluster."""

from __future__ import annotations

import logging
import time

import pytest
from _redis_servers import (  # redis_single is a fixture
    RedisCluster,
    RedisNode,
    free_port,
    make_tls_files,
    redis_single,  # noqa: F401
    require_redis_server,
)

from connectors.offload.tiers import RedisTier, TierKey, make_tier
from kvconnector_core.errors import ConfigError

pytestmark = pytest.mark.redis

BASE = {"model": "tiny-llama", "layout": "bs16-l4-kv2x8x16-fp32", "socket_timeout": 0.5}


def _keys(n: int, start: int = 0, group: int = 0) -> list[TierKey]:
    return [TierKey(i.to_bytes(4, "big") * 8, group) for i in range(start, start + n)]


def _answer(tier, keys, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while (held := tier.lookup(keys)) is None:
        assert time.monotonic() < deadline, "lookup never answered"
        time.sleep(0.001)
    return held


@pytest.fixture(scope="module")
def single(redis_single):
    return redis_single


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    require_redis_server()
    c = RedisCluster(tmp_path_factory.mktemp("redis-cluster")).start()
    yield c
    c.stop()


@pytest.fixture(params=["single", "cluster"])
def server(request):
    """(url, cluster flag) of each topology."""
    if request.param == "single":
        return request.getfixturevalue("single").url, False
    return request.getfixturevalue("cluster").url, True


@pytest.fixture
def make(request):
    tiers = []

    def _make(url, cluster, **kw):
        tier = RedisTier({**BASE, "url": url, "cluster": cluster,
                          "tenant_salt": request.node.name, **kw})
        tiers.append(tier)
        return tier

    yield _make
    for tier in tiers:
        tier.close()


def test_round_trip_lookup_and_groups(server, make):
    tier = make(*server)
    keys = _keys(40)  # spread over every cluster node's slots
    payloads = [bytes([i]) * (1000 + i) for i in range(40)]
    assert tier.store(list(zip(keys[:30], payloads[:30], strict=True)))
    assert tier.flush(30)
    assert tier.lookup(keys) is None  # the first call starts the I/O: ask again
    assert _answer(tier, keys) == 30
    assert tier.load(keys).values(30) == payloads[:30] + [None] * 10
    other_group = [TierKey(k.block_hash, 1) for k in keys[:3]]
    assert tier.load(other_group).values(30) == [None] * 3
    stats = tier.stats()
    assert (stats["redis_stores"], stats["redis_loads"], stats["redis_store_failures"]) == (
        30,
        30,
        0,
    )


def test_chain_lookup_is_one_round_trip_on_a_single_node(single, make):
    tier = make(single.url, False)
    client = tier._conn()
    executes = []
    real_pipeline = client.pipeline

    def counting_pipeline(*args, **kwargs):
        pipe = real_pipeline(*args, **kwargs)
        real_execute = pipe.execute
        pipe.execute = lambda *a, **k: (executes.append(len(pipe)), real_execute(*a, **k))[1]
        return pipe

    client.pipeline = counting_pipeline
    assert _answer(tier, _keys(50)) == 0
    assert executes == [50]


def test_keys_are_namespaced_by_model_layout_and_tenant(single, make):
    key = _keys(1)[0]
    a = make(single.url, False, tenant_salt="tenant-a")
    b = make(single.url, False, tenant_salt="tenant-b")
    other_model = make(single.url, False, tenant_salt="tenant-a", model="other-model")
    other_layout = make(single.url, False, tenant_salt="tenant-a", layout="bs32")
    a.store([(key, b"secret prefix of tenant a")])
    a.flush(30)
    assert a.redis_key(key).startswith("kvc:tiny-llama:bs16-l4-kv2x8x16-fp32:")
    assert "tenant-a" not in a.redis_key(key)  # only a digest of the salt is visible
    for reader in (b, other_model, other_layout):
        assert _answer(reader, [key]) == 0
        assert reader.load([key]).values(30) == [None]
    assert a.load([key]).values(30) == [b"secret prefix of tenant a"]


def test_corrupted_value_is_a_failed_load(server, make):
    tier = make(*server)
    key = _keys(1)[0]
    tier.store([(key, b"x" * 4096)])
    tier.flush(30)
    client = tier._conn()
    raw = client.get(tier.redis_key(key))
    client.set(tier.redis_key(key), raw[:-1] + bytes([raw[-1] ^ 0xFF]))
    assert tier.load([key]).values(30) == [None]
    assert tier.stats()["redis_load_failures"] == 1
    assert client.exists(tier.redis_key(key)) == 0  # the damaged value is deleted


def test_eviction_is_left_to_redis_ttl(single, make):
    key = _keys(1)[0]
    with_ttl = make(single.url, False, ttl_seconds=120)
    without = make(single.url, False, ttl_seconds=None, tenant_salt="no-ttl")
    for tier in (with_ttl, without):
        tier.store([(key, b"v")])
        tier.flush(30)
    assert 0 < with_ttl._conn().ttl(with_ttl.redis_key(key)) <= 120
    assert without._conn().ttl(without.redis_key(key)) == -1  # maxmemory-policy decides


def test_killed_single_node_fails_fast_then_reconnects(tmp_path, make):
    require_redis_server()
    node = RedisNode(tmp_path).start()
    try:
        tier = make(node.url, False)
        keys = _keys(3)
        tier.store([(k, b"before") for k in keys])
        tier.flush(30)
        node.kill()
        assert _answer(tier, keys) == 0  # a failed lookup is a miss
        assert tier.load(keys).values(30) == [None] * 3  # failed loads: recomputed
        tier.store([(keys[0], b"during")])
        tier.flush(30)
        stats = tier.stats()
        assert stats["redis_store_failures"] == 1 and stats["redis_lookup_failures"] == 1
        node.start()  # same port, empty (no persistence): the tier reconnects by itself
        tier.store([(keys[0], b"after")])
        tier.flush(30)
        assert tier.load(keys[:1]).values(30) == [b"after"]
    finally:
        node.executor.stop()


def test_killed_cluster_master_fails_its_keys_only_then_reconnects(tmp_path, make):
    require_redis_server()
    c = RedisCluster(tmp_path).start()
    try:
        tier = make(c.url, True)
        keys = _keys(60)
        tier.store([(k, b"v" + k.block_hash) for k in keys])
        tier.flush(30)
        assert tier.load(keys).values(30) == [b"v" + k.block_hash for k in keys]
        victim = c.nodes[2]
        victim.kill()
        values = tier.load(keys).values(60)
        lost = [v is None for v in values]
        assert any(lost), "keys on the killed master must fail"
        assert not all(lost), "keys on the live masters must still load"
        victim.start()  # rejoins with its slots from nodes.conf, data gone
        deadline = time.monotonic() + 60
        while True:
            tier.store([(keys[0], b"again")])
            tier.flush(30)
            if tier.load(keys[:1]).values(30) == [b"again"]:
                break
            assert time.monotonic() < deadline, "the tier never reconnected to the cluster"
            time.sleep(0.2)
    finally:
        c.stop()


def test_acl_user_and_password_from_env_or_file_never_logged(tmp_path, monkeypatch, make, caplog):
    require_redis_server()
    secret = "s3cr3t-Pa55"
    node = RedisNode(
        tmp_path,
        extra=["--user", "default", "off", "--user", "kv", "on", f">{secret}", "~kvc:*", "+@all"],
    ).start()
    try:
        monkeypatch.setenv("KVC_REDIS_PASSWORD", secret)
        (tmp_path / "pw").write_text(secret + "\n")
        by_env = make(node.url, False, username="kv", password_env="KVC_REDIS_PASSWORD")
        by_file = make(node.url, False, username="kv", password_file=str(tmp_path / "pw"))
        key = _keys(1)[0]
        by_env.store([(key, b"authed")])
        by_env.flush(30)
        assert by_file.load([key]).values(30) == [b"authed"]
        caplog.set_level(logging.DEBUG)
        monkeypatch.setenv("KVC_WRONG", "wrong-password")
        wrong = make(node.url, False, username="kv", password_env="KVC_WRONG")
        wrong.store([(key, b"x")])
        wrong.flush(30)
        assert wrong.load([key]).values(30) == [None]
        assert wrong.stats()["redis_store_failures"] == 1
        assert secret not in caplog.text and "wrong-password" not in caplog.text
        assert secret not in repr(by_env.config) and secret not in repr(by_file.config)
    finally:
        node.executor.stop()


def _tls_node(tmp_path, files, *, auth_clients: str, extra: list[str] | None = None) -> RedisNode:
    port = free_port()
    return RedisNode(
        tmp_path,
        port=port,
        extra=[
            "--port",
            "0",
            "--tls-port",
            str(port),
            "--tls-cert-file",
            str(files["server.crt"]),
            "--tls-key-file",
            str(files["server.key"]),
            "--tls-ca-cert-file",
            str(files["ca.crt"]),
            "--tls-auth-clients",
            auth_clients,
            *(extra or []),
        ],
    ).start()


def test_tls_verifies_the_server_against_the_given_ca(tmp_path, make):
    """A real redis-server with TLS only (no plain port) and throw-away certificates."""
    files = make_tls_files(tmp_path / "tls")
    node = _tls_node(tmp_path, files, auth_clients="no")
    port = node.port
    try:
        tier = make(f"rediss://127.0.0.1:{port}/0", False, tls_ca_file=str(files["ca.crt"]))
        key = _keys(1)[0]
        tier.store([(key, b"over tls")])
        tier.flush(30)
        assert tier.load([key]).values(30) == [b"over tls"]
        # tls=True turns a redis:// URL into TLS too.
        flag = make(
            f"redis://127.0.0.1:{port}/0", False, tls=True, tls_ca_file=str(files["ca.crt"])
        )
        assert flag.load([key]).values(30) == [b"over tls"]
        # The server's certificate is checked: another CA, or the system's CAs, refuse it.
        for ca in (str(files["other-ca.crt"]), None):
            untrusting = make(f"rediss://127.0.0.1:{port}/0", False, tls_ca_file=ca)
            assert untrusting.load([key]).values(30) == [None]
            untrusting.store([(key, b"forged")])
            untrusting.flush(30)
            assert untrusting.stats()["redis_store_failures"] == 1
        plain = make(f"redis://127.0.0.1:{port}/0", False)
        assert plain.load([key]).values(30) == [None]  # plain text to a TLS port fails, safely
        assert tier.load([key]).values(30) == [b"over tls"]  # nothing was overwritten
    finally:
        node.executor.stop()


def test_tls_client_certificate_and_acl_user(tmp_path, make, monkeypatch, caplog):
    """Mutual TLS (the server requires a client certificate signed by its CA) with an ACL
    user whose password comes from a file; the secret never reaches a log line."""
    files = make_tls_files(tmp_path / "tls")
    secret = "tls-s3cr3t"
    node = _tls_node(
        tmp_path,
        files,
        auth_clients="yes",
        extra=["--user", "default", "off", "--user", "kv", "on", f">{secret}", "~kvc:*", "+@all"],
    )
    (tmp_path / "pw").write_text(secret + "\n")
    url = f"rediss://127.0.0.1:{node.port}/0"
    tls = {
        "tls_ca_file": str(files["ca.crt"]),
        "username": "kv",
        "password_file": str(tmp_path / "pw"),
    }
    try:
        caplog.set_level(logging.DEBUG)
        tier = make(
            url,
            False,
            tls_cert_file=str(files["client.crt"]),
            tls_key_file=str(files["client.key"]),
            **tls,
        )
        key = _keys(1)[0]
        tier.store([(key, b"mutual tls")])
        tier.flush(30)
        assert tier.load([key]).values(30) == [b"mutual tls"]
        no_cert = make(url, False, **tls)
        assert no_cert.load([key]).values(30) == [None]  # the server refuses the handshake
        assert no_cert.stats()["redis_load_failures"] == 1
        assert secret not in caplog.text
    finally:
        node.executor.stop()


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ({"url": "redis://user:hunter2@127.0.0.1:6379"}, "url contains a password"),
        ({"password": "hunter2"}, "password_env"),
        ({"password_env": "A", "password_file": "/x"}, "not both"),
        ({"url": "http://127.0.0.1"}, "must start with redis://"),
        ({"ttl_seconds": 0}, "ttl_seconds must be a positive int or null"),
    ],
)
def test_bad_settings_are_config_errors_that_never_echo_a_secret(extra, fragment):
    with pytest.raises(ConfigError, match=fragment) as info:
        make_tier({"type": "redis", **BASE, **extra})
    assert "hunter2" not in str(info.value)


def test_missing_password_env_names_the_variable(monkeypatch):
    monkeypatch.delenv("KVC_NOT_SET", raising=False)
    with pytest.raises(ConfigError, match="password_env='KVC_NOT_SET' is not set"):
        make_tier({"type": "redis", **BASE, "password_env": "KVC_NOT_SET"})
