"""A connector that handles one KV cache group is refused on a hybrid model.

Created on ``tiny-hybrid``, such a connector would load group 0 only: the other groups'
blocks would keep stale data and outputs would differ silently.
"""

from __future__ import annotations

from typing import ClassVar

import pytest

from kvconnector_core.connector.base import (
    KVConnectorRole,
    KVConnectorSchedulerSide,
    KVConnectorWorkerSide,
    RoleSplitConnector,
)
from kvconnector_core.connector.config import KVConnectorConfig
from kvconnector_core.engine.engine import Engine, EngineConfig
from kvconnector_core.engine.models import get_model
from kvconnector_core.errors import ConfigError
from kvconnector_core.plugins.registry import create_connector
from kvconnector_core.testing import fault_injection_config

REFERENCE = KVConnectorConfig(name="ReferenceConnector", module_path="_reference_connector")
OFFLOAD = KVConnectorConfig(name="cpu_offload", extra_config={"num_cpu_blocks": 64})


def _kv_cache_config(model: str):
    return EngineConfig(
        model=get_model(model), num_gpu_blocks=64, block_size=16, max_model_len=256
    ).kv_cache_config()


def _multi(*children: KVConnectorConfig) -> KVConnectorConfig:
    return KVConnectorConfig(
        name="MultiConnector", extra_config={"connectors": [c.to_dict() for c in children]}
    )


@pytest.mark.parametrize("model", ["tiny-hybrid", "tiny-chunked", "tiny-two-windows"])
def test_one_group_connector_is_refused_naming_it_and_the_groups(model: str) -> None:
    kvc = _kv_cache_config(model)
    with pytest.raises(ConfigError) as info:
        create_connector(REFERENCE, KVConnectorRole.SCHEDULER, kvc)
    msg = str(info.value)
    assert "'ReferenceConnector'" in msg
    assert f"has {len(kvc.kv_cache_groups)} (" in msg
    assert "supports_multiple_kv_cache_groups" in msg


def test_one_group_connector_still_runs_on_a_one_group_model() -> None:
    conn = create_connector(REFERENCE, KVConnectorRole.WORKER, _kv_cache_config("tiny"))
    assert conn.kv_cache_config is not None


def test_engine_refuses_before_running() -> None:
    config = EngineConfig(
        model=get_model("tiny-hybrid"),
        num_gpu_blocks=64,
        block_size=16,
        max_model_len=256,
        connector=REFERENCE,
    )
    with pytest.raises(ConfigError, match="handles one KV cache group only"):
        Engine(config)


@pytest.mark.parametrize("role", list(KVConnectorRole))
def test_multi_connector_declares_support_only_when_every_child_does(role: KVConnectorRole) -> None:
    hybrid, one = _kv_cache_config("tiny-hybrid"), _kv_cache_config("tiny")
    assert create_connector(_multi(OFFLOAD), role, hybrid).supports_multiple_kv_cache_groups
    mixed = create_connector(_multi(OFFLOAD, REFERENCE), role, one)
    assert not mixed.supports_multiple_kv_cache_groups  # what the vLLM adapter reads
    with pytest.raises(ConfigError, match=r"connectors'\]\[1\].*'ReferenceConnector'"):
        create_connector(_multi(OFFLOAD, REFERENCE), role, hybrid)


def test_fault_injection_wrapper_follows_its_inner_connector() -> None:
    hybrid = _kv_cache_config("tiny-hybrid")
    wrapped = create_connector(fault_injection_config(OFFLOAD), KVConnectorRole.WORKER, hybrid)
    assert wrapped.supports_multiple_kv_cache_groups
    with pytest.raises(ConfigError, match="'ReferenceConnector'"):
        create_connector(fault_injection_config(REFERENCE), KVConnectorRole.WORKER, hybrid)


class OneGroupFacade(RoleSplitConnector):
    """A role-split connector that does not declare hybrid support."""

    name: ClassVar[str] = "OneGroupFacade"

    def make_scheduler_side(self) -> KVConnectorSchedulerSide:
        raise AssertionError("refused before the role object is made")

    def make_worker_side(self) -> KVConnectorWorkerSide:
        raise AssertionError("refused before the role object is made")


def test_role_split_facade_is_refused_before_making_its_role_object() -> None:
    with pytest.raises(ConfigError, match="'OneGroupFacade'"):
        OneGroupFacade(
            KVConnectorConfig(name="OneGroupFacade"),
            KVConnectorRole.SCHEDULER,
            _kv_cache_config("tiny-hybrid"),
        )


def test_cli_refuses_a_one_group_connector_on_a_hybrid_model(tmp_path, capsys) -> None:
    """`kvconnector run --model tiny-hybrid` with a one-group connector: exit 2 and the
    reason, not wrong outputs (the stranger saw 23 of 32 requests differ, exit 1)."""
    import torch

    from kvconnector_core.cli import main

    config = tmp_path / "ref.json"
    config.write_text('{"name": "ReferenceConnector", "module_path": "_reference_connector"}')
    threads = torch.get_num_threads()
    try:
        code = main(["run", "--model", "tiny-hybrid", "--config", str(config)])
    finally:
        torch.set_num_threads(threads)  # run_cmd sets one thread on CPU
    err = capsys.readouterr().err
    assert code == 2
    assert "'ReferenceConnector' handles one KV cache group only" in err
    assert "Traceback" not in err


def test_request_finished_runs_for_a_request_aborted_before_admission() -> None:
    """What writing-a-connector.md promises (the lookup contract's cleanup): a request that
    never left the waiting queue still gets request_finished once, with no block ids."""
    from kvconnector_core.request import RequestStatus

    config = EngineConfig(
        model=get_model("tiny"),
        num_gpu_blocks=64,
        block_size=16,
        max_model_len=256,
        connector=KVConnectorConfig(
            name="RecordingConnector", module_path="kvconnector_core.testing.recording"
        ),
    )
    with Engine(config) as engine:
        rid = engine.add_request(list(range(40)), 4)
        engine.scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        finished = [
            args for hook, args in engine.scheduler_connector.calls if hook == "request_finished"
        ]
    assert len(finished) == 1
    recorded_id, block_ids = finished[0]  # RecordingConnector records the request's id
    assert recorded_id == rid and list(block_ids) == []
