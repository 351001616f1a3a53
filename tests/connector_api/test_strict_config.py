"""Strict configs: unknown fields and extra_config keys are errors naming the nearest valid
one; connectors declare typed settings; the CLI takes demo settings from the connector."""

from __future__ import annotations

import inspect
import json
from typing import Annotated, Any, ClassVar, Literal

import msgspec
import pytest

from kvconnector_core.cli import main, run_cmd
from kvconnector_core.connector.base import KVConnectorRole
from kvconnector_core.connector.config import load_connector_config
from kvconnector_core.connector.demo import DemoOptions
from kvconnector_core.connector.settings import ConnectorSettings, convert_settings
from kvconnector_core.engine.engine import RunMetrics, RunResult
from kvconnector_core.errors import ConfigError
from kvconnector_core.plugins.registry import ConnectorRegistry, create_connector
from kvconnector_core.testing import RecordingConnector, make_kv_cache_config


class DemoSettings(ConnectorSettings):
    path: str
    size: Annotated[int, msgspec.Meta(ge=1)] = 8
    mode: Literal["fast", "safe"] = "safe"
    fsync: bool = False


def test_settings_convert_with_lax_numbers_and_booleans():
    settings = convert_settings("Demo", DemoSettings, {"path": "/x", "size": "16", "fsync": "true"})
    assert settings == DemoSettings(path="/x", size=16, fsync=True)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"path": "/x", "szie": 3},
            "Demo: unknown extra_config key 'szie' (did you mean 'size'?); "
            "valid keys: path, size, mode, fsync",
        ),
        ({"size": 3}, "Demo: extra_config needs 'path'; valid keys: path, size, mode, fsync"),
        ({"path": "/x", "size": 0}, "Demo: extra_config size=0 is not valid: Expected `int` >= 1"),
        (
            {"path": "/x", "mode": "quick"},
            "Demo: extra_config mode='quick' is not valid: Invalid enum value "
            "'quick'; valid: fast, safe",
        ),
    ],
    ids=["typo", "missing", "bound", "literal"],
)
def test_settings_errors_name_connector_and_key(extra, message):
    with pytest.raises(ConfigError) as info:
        convert_settings("Demo", DemoSettings, extra)
    assert str(info.value) == message


class DemoConnector(RecordingConnector):
    """A connector with typed settings and its own demo settings."""

    name: ClassVar[str] = "DemoConnector"
    settings_type: ClassVar[type[Any] | None] = DemoSettings

    @classmethod
    def demo_extra_config(cls, options: DemoOptions) -> dict[str, Any]:
        return {"path": "/tmp/demo", "size": options.num_gpu_blocks}


def test_connector_gets_its_settings_converted():
    """The base class converts extra_config to settings_type; a bad key fails creation."""
    registry = ConnectorRegistry()
    registry.add(DemoConnector)
    kvc = make_kv_cache_config()
    conn = create_connector(
        {"name": "DemoConnector", "extra_config": {"path": "/d", "size": "4"}},
        KVConnectorRole.SCHEDULER,
        kvc,
        registry=registry,
    )
    assert conn.settings == DemoSettings(path="/d", size=4)
    with pytest.raises(
        ConfigError,
        match="DemoConnector: unknown extra_config key 'fsnyc' "
        r"\(did you mean 'fsync'\?\)",
    ):
        create_connector(
            {"name": "DemoConnector", "extra_config": {"path": "/d", "fsnyc": True}},
            KVConnectorRole.SCHEDULER,
            kvc,
            registry=registry,
        )


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        ({"name": "cpu_offload", "rol": "kv_both"}, "unknown field 'rol' (did you mean 'role'?)"),
        (
            {"name": "cpu_offload", "extra_confg": {"num_cpu_blocks": 8}},
            "unknown field 'extra_confg' (did you mean 'extra_config'?)",
        ),
        (
            {"name": "cpu_offload", "extra_config": {"num_cpu_blocks": 8, "cache_polcy": "arc"}},
            (
                "OffloadingConnector: unknown extra_config key 'cache_polcy' "
                "(did you mean 'cache_policy'?)"
            ),
        ),
        (
            {"name": "cpu_offload", "extra_config": {"num_cpu_blocks": -1}},
            "OffloadingConnector: extra_config num_cpu_blocks=-1 is not valid: Expected `int` >= 1",
        ),
        (
            {
                "name": "MultiConnector",
                "extra_config": {
                    "connectors": [{"name": "ttl", "extra_config": {"ttl_secnds": 5}}]
                },
            },
            "MultiConnector extra_config['connectors'][0]: TTLPinConnector: "
            "unknown extra_config key 'ttl_secnds' "
            "(did you mean 'ttl_seconds'?)",
        ),
        (
            {
                "name": "MultiConnector",
                "extra_config": {"connectors": [{"name": "ttl"}], "loader_polcy": "first"},
            },
            (
                "MultiConnector: unknown extra_config key 'loader_polcy' "
                "(did you mean 'loader_policy'?)"
            ),
        ),
        (
            {
                "name": "MultiConnector",
                "extra_config": {"connectors": [{"name": "ttl", "rol": "kv_both"}]},
            },
            "MultiConnector extra_config['connectors'][0]: invalid connector config",
        ),
    ],
    ids=[
        "top-level",
        "extra-config-field",
        "offload-key",
        "offload-bound",
        "multi-child-key",
        "multi-key",
        "multi-child-field",
    ],
)
def test_config_file_typos_exit_2_naming_the_key(tmp_path, capsys, config, needle):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(config))
    assert main(["run", "--config", str(path), "--no-baseline", "--workload", "chat"]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


@pytest.mark.parametrize(
    "extra", [{"num_cpu_blocks": 2**40}, {"cpu_bytes": 2**62}], ids=["blocks", "bytes"]
)
def test_a_cpu_tier_larger_than_host_memory_is_a_bound_error(tmp_path, capsys, extra):
    """A huge CPU tier in a config file does not reach the allocator (whose message names no
    setting): it is refused before anything is allocated, naming the key, the bytes it needs
    and the largest valid size."""
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"name": "cpu_offload", "extra_config": extra}))
    assert main(["run", "--config", str(path), "--no-baseline", "--workload", "chat"]) == 2
    err = capsys.readouterr().err
    (key,) = extra
    assert (
        f"extra_config {key}=" in err and "more than this host's" in err and "valid: at most" in err
    )
    assert "Traceback" not in err and "register_kv_caches" not in err


def test_load_connector_config_rejects_unknown_fields(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"name": "x", "modul_path": "m"}')
    with pytest.raises(
        ConfigError, match=r"unknown field 'modul_path' \(did you mean 'module_path'\?\)"
    ):
        load_connector_config(path)


def test_cli_takes_demo_settings_from_the_connector(monkeypatch, capsys):
    """`run --connector NAME` asks the connector class for demo settings; the CLI itself
    knows no connector's keys."""
    assert "num_cpu_blocks" not in inspect.getsource(run_cmd)
    registry = ConnectorRegistry()
    registry.add(DemoConnector)
    monkeypatch.setattr("kvconnector_core.plugins.registry.get_registry", lambda: registry)
    from kvconnector_core.engine.engine import Engine

    seen = []
    monkeypatch.setattr(Engine, "__init__", lambda self, config: seen.append(config) or None)
    monkeypatch.setattr(
        Engine,
        "run",
        lambda self, trace, progress=None: RunResult(trace.name, None, "cpu", {}, {}, RunMetrics()),
    )
    monkeypatch.setattr(Engine, "shutdown", lambda self: None)
    assert (
        main(
            [
                "run",
                "--connector",
                "DemoConnector",
                "--no-baseline",
                "--num-gpu-blocks",
                "80",
                "--workload",
                "chat",
            ]
        )
        == 0
    )
    assert seen[0].connector.extra_config == {"path": "/tmp/demo", "size": 80}


def test_offload_demo_settings_size_the_cpu_tier():
    from connectors.offload.connector import OffloadingConnector

    options = DemoOptions(connector="cpu_offload", num_gpu_blocks=64)
    assert OffloadingConnector.demo_extra_config(options) == {"num_cpu_blocks": 256}


def test_a_bad_boolean_lists_the_valid_values():
    """Stranger log (docs16): fsync="maybe" said only "Expected `bool`, got `str`"; the
    message now lists true and false, as it lists a Literal's choices."""

    class Flags(ConnectorSettings):
        fsync: bool = False

    with pytest.raises(ConfigError, match=r"fsync='maybe' is not valid: .*; valid: true, false"):
        convert_settings("FileConnector", Flags, {"fsync": "maybe"})
    assert convert_settings("FileConnector", Flags, {"fsync": "true"}).fsync is True
