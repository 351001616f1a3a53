"""The disk connector passes the kit, survives restarts, writes atomically, reports bad files."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from disk_connector import DiskConnector

from kvconnector_core.connector import KVConnectorConfig
from kvconnector_core.plugins.registry import get_registry
from kvconnector_core.testing import (
    ConnectorContract,
    DataCheck,
    data_check_workloads,
    run_data_check,
)

# The kit's classes take their config at class creation: one directory for this module.
DIRECTORY = tempfile.mkdtemp(prefix="kvconnector-disk-test-")
WORKLOADS = data_check_workloads()


@pytest.fixture(autouse=True, scope="module")
def _remove_directory():
    yield
    shutil.rmtree(DIRECTORY, ignore_errors=True)


def disk(path: str | Path, **extra: object) -> KVConnectorConfig:
    return KVConnectorConfig(name="disk", extra_config={"path": str(path), **extra})


class TestDiskContract(ConnectorContract):
    connector_config = disk(DIRECTORY)


class TestDiskData(DataCheck):
    connector_config = disk(DIRECTORY)


def test_entry_point_registers_the_connector():
    assert get_registry().get("disk") is DiskConnector


def test_survives_a_restart(tmp_path):
    """A second engine on the same directory hits what the first one stored, from its first
    request on, with identical outputs."""
    workload = WORKLOADS["block_aligned"]
    first = run_data_check(disk(tmp_path), workload)
    second = run_data_check(disk(tmp_path), workload)
    assert first.ok and second.ok, (str(first), str(second))
    hits = [r.checked.metrics.connector_hit_tokens for r in (first, second)]
    assert hits[1] > hits[0]
    assert second.checked.metrics.bytes_stored == 0  # everything was already on disk


def test_writes_are_atomic_and_leave_no_temporary_files(tmp_path):
    report = run_data_check(disk(tmp_path, fsync=True), WORKLOADS["repeated_prefixes"])
    assert report.ok, str(report)
    files = list(tmp_path.rglob("*"))
    assert any(f.is_file() for f in files)
    assert not [f for f in files if f.name.endswith(".tmp")]


def test_a_damaged_file_is_a_reported_failed_load(tmp_path):
    """A file cut short (e.g. written by something else) is reported; outputs stay right."""
    workload = WORKLOADS["full_prompt_hit"]
    assert run_data_check(disk(tmp_path), workload).ok
    for path in tmp_path.rglob("*"):
        if path.is_file():
            path.write_bytes(path.read_bytes()[:7])
    report = run_data_check(disk(tmp_path), workload)
    assert report.ok, str(report)
    assert report.checked.metrics.num_failed_loads_recovered > 0


def test_typo_in_settings_names_the_key(tmp_path):
    from kvconnector_core.connector.base import KVConnectorRole
    from kvconnector_core.errors import ConfigError
    from kvconnector_core.testing import make_kv_cache_config

    with pytest.raises(
        ConfigError, match=r"unknown extra_config key 'fsnyc' \(did you mean 'fsync'\?\)"
    ):
        DiskConnector(disk(tmp_path, fsnyc=True), KVConnectorRole.SCHEDULER, make_kv_cache_config())


@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
def test_refuses_more_than_one_worker(tmp_path, role):
    """Its files carry no rank, so two TP ranks would write (and read) each other's shard:
    it refuses world_size > 1 on both sides and names the value."""
    import msgspec

    from kvconnector_core.connector.base import KVConnectorRole
    from kvconnector_core.errors import ConfigError
    from kvconnector_core.testing import make_kv_cache_config

    config = msgspec.structs.replace(disk(tmp_path), world_size=2, rank=1)
    with pytest.raises(ConfigError, match=r"world_size=2"):
        DiskConnector(config, KVConnectorRole[role], make_kv_cache_config())
    assert not any(tmp_path.iterdir())  # refused before it created anything
