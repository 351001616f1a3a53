"""The kit's ``DataCheck`` and ``ConnectorContract`` with ``engine = "vllm"``: the same test
classes an author writes for kvconnector's engine, run under vLLM's own scheduler; and
the vLLM data check still catches a connector that corrupts what it loads."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM 0.33 is not installed (make test-vllm)")

from kvconnector_core.connector import KVConnectorConfig
from kvconnector_core.testing import ConnectorContract, DataCheck
from kvconnector_core.testing.vllm.kit import (
    run_vllm_data_check,
    run_vllm_failed_load_check,
)

OFFLOAD = KVConnectorConfig(name="cpu_offload", extra_config={"num_cpu_blocks": 64})


class TestOffloadDataUnderVllm(DataCheck):
    connector_config = OFFLOAD
    engine = "vllm"


class TestOffloadContractUnderVllm(ConnectorContract):
    connector_config = OFFLOAD
    engine = "vllm"


class TestTTLContractUnderVllm(ConnectorContract):
    connector_config = KVConnectorConfig(name="ttl", extra_config={"ttl_seconds": 1000})
    engine = "vllm"


CORRUPTING = KVConnectorConfig(name="CorruptingConnector", module_path="_corrupting_connector")
PLAIN = KVConnectorConfig(name="PlainSyncConnector", module_path="_plain_sync_connector")


def test_the_vllm_data_check_catches_a_connector_that_corrupts_its_loads():
    report = run_vllm_data_check(CORRUPTING, "block_aligned")
    assert not report.ok
    assert "wrong bytes" in report.problems[0] and "(loaded block)" in report.problems[0]


def test_a_connector_without_failure_handling_passes_the_failed_load_check_under_vllm():
    """The framework drops the stores of a step whose synchronous load failed (issue 21,
    item 2), so the docs' simplest synchronous shape passes under vLLM too."""
    report = run_vllm_failed_load_check(PLAIN)
    assert report.ok, str(report)
