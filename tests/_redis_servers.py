"""Real redis-server processes on loopback ports for the Redis tier tests.

Processes are started by pytest-redis's :class:`RedisExecutor` (mirakuru underneath:
it waits for the port, stops and kills the process); this module only adds the
redis-server options pytest-redis does not know (cluster mode, ACL users, TLS) and
builds a 3-master cluster with ``redis-cli --cluster create``.

Without ``redis-server`` on PATH the tests skip with the install command, except where
``KVCONNECTOR_REQUIRE_REDIS=1`` (set by ``.ci/run``): CI must run them.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

INSTALL_HINT = "redis-server is not installed: apt-get install -y redis-server (Debian/Ubuntu)"


def _missing(reason: str) -> None:
    """Skip the test for ``reason``; under CI (KVCONNECTOR_REQUIRE_REDIS=1) fail it instead."""
    if os.environ.get("KVCONNECTOR_REQUIRE_REDIS") == "1":
        pytest.fail(reason + " (KVCONNECTOR_REQUIRE_REDIS=1: CI must run these tests)")
    pytest.skip(reason)


def require_redis_server() -> str:
    """The redis-server path; skips the test (fails it under CI) when it is missing."""
    path = shutil.which("redis-server")
    if path is None:
        _missing(INSTALL_HINT)
    pytest.importorskip("pytest_redis", reason="pytest-redis is missing: pip install -e '.[test]'")
    pytest.importorskip("redis", reason="redis-py is missing: pip install -e '.[test]'")
    return path


def free_port() -> int:
    """A free loopback port whose cluster bus port (+10000) is free too.

    Ports come from 20000-22700, so the bus ports (30000-32700) stay below Linux's
    ephemeral range (32768 up): a client connection's local port cannot take one between
    this check and the server's start (a cluster node then fails to bind and exits).
    """
    from port_for import get_port

    for _ in range(100):
        port = get_port((20000, 22700))
        if _can_bind(port + 10000):
            return port
    msg = "no free loopback port pair (port, port + 10000) in 20000-22700"
    raise RuntimeError(msg)


def _can_bind(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class RedisNode:
    """One redis-server process; :meth:`kill` and :meth:`start` again to restart it."""

    def __init__(self, datadir: Path, *, port: int | None = None, cluster: bool = False,
                 extra: list[str] | None = None) -> None:
        from pytest_redis.executor.process import RedisExecutor

        self.port = port or free_port()
        self.datadir = datadir / f"node-{self.port}"
        self.datadir.mkdir(parents=True, exist_ok=True)
        self.executor = RedisExecutor(
            shutil.which("redis-server") or "redis-server", databases=1, redis_timeout=30,
            loglevel="warning", host="127.0.0.1", port=self.port, datadir=self.datadir,
            startup_timeout=30)
        args = ["--save", "", "--protected-mode", "no"]
        if cluster:
            args += ["--cluster-enabled", "yes", "--cluster-node-timeout", "2000",
                     "--cluster-config-file", str(self.datadir / "nodes.conf"),
                     "--cluster-require-full-coverage", "no"]
        # pytest-redis builds the command line; the options it has no parameter for go last.
        self.executor.command_parts = [*self.executor.command_parts, *args, *(extra or [])]
        self.executor.command = " ".join(self.executor.command_parts)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisNode:
        self.executor.start()
        return self

    def kill(self) -> None:
        """SIGKILL, the way a crashed node goes (no clean shutdown)."""
        self.executor.kill()

    def cli(self, *args: str, password: str | None = None) -> str:
        cmd = ["redis-cli", "-h", "127.0.0.1", "-p", str(self.port)]
        if password:
            cmd += ["--no-auth-warning", "-a", password]
        return subprocess.run([*cmd, *args], check=True, capture_output=True, text=True,
                              timeout=60).stdout


class RedisCluster:
    """Three masters, no replicas, slots split evenly."""

    def __init__(self, datadir: Path) -> None:
        self.nodes = [RedisNode(datadir, cluster=True) for _ in range(3)]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self) -> RedisCluster:
        for node in self.nodes:
            node.start()
        subprocess.run(
            ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
             "--cluster-replicas", "0", "--cluster-yes"],
            check=True, capture_output=True, timeout=60)
        deadline = time.monotonic() + 60
        while not all("cluster_state:ok" in n.cli("cluster", "info") for n in self.nodes):
            assert time.monotonic() < deadline, "the test cluster never reached cluster_state:ok"
            time.sleep(0.1)
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.executor.stop()


def require_tls_support() -> None:
    """Skip (fail under CI) unless redis-server was built with TLS and openssl is there.

    A build without TLS rejects ``--tls-port`` while parsing its options; one with TLS
    gets past them and exits because it was told to listen nowhere.
    """
    require_redis_server()
    if shutil.which("openssl") is None:
        _missing("the TLS tests need the openssl command to make certificates: "
                 "apt-get install -y openssl")
    probe = subprocess.run(["redis-server", "--port", "0", "--tls-port", "0", "--save", ""],
                           capture_output=True, text=True, timeout=60, check=False)
    if "not listen anywhere" not in probe.stdout + probe.stderr:
        _missing("this redis-server has no TLS support (Debian's redis-server has it)")


def make_tls_files(directory: Path) -> dict[str, Path]:
    """Throw-away certificates made with the openssl command: a CA (``ca``), a server
    certificate for 127.0.0.1 and a client certificate signed by it, and a second,
    unrelated CA (``other-ca``)."""
    require_tls_support()
    directory.mkdir(parents=True, exist_ok=True)
    files = {name: directory / name for name in (
        "ca.key", "ca.crt", "other-ca.key", "other-ca.crt", "server.key", "server.csr",
        "server.crt", "client.key", "client.csr", "client.crt", "ext.cnf")}
    files["ext.cnf"].write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    for ca in ("ca", "other-ca"):
        run(
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            f"/CN=test-{ca}",
            "-keyout",
            str(files[f"{ca}.key"]),
            "-out",
            str(files[f"{ca}.crt"]),
        )
    for leaf in ("server", "client"):
        run(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            f"/CN=127.0.0.1-{leaf}",
            "-keyout",
            str(files[f"{leaf}.key"]),
            "-out",
            str(files[f"{leaf}.csr"]),
        )
        run(
            "x509",
            "-req",
            "-in",
            str(files[f"{leaf}.csr"]),
            "-CA",
            str(files["ca.crt"]),
            "-CAkey",
            str(files["ca.key"]),
            "-CAcreateserial",
            "-days",
            "1",
            "-extfile",
            str(files["ext.cnf"]),
            "-out",
            str(files[f"{leaf}.crt"]),
        )
    return files


@pytest.fixture(scope="module")
def redis_single(tmp_path_factory):
    """One redis-server for a test module (import this fixture into the module)."""
    require_redis_server()
    node = RedisNode(tmp_path_factory.mktemp("redis-single")).start()
    yield node
    node.executor.stop()
