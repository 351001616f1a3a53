"""``kvconnector list``: table, JSON, failed plugins, --strict."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from kvconnector_core.cli import list_cmd
from kvconnector_core.connector import ConnectorRegistry
from kvconnector_core.testing import RecordingConnector


@dataclass
class FakeDist:
    name: str
    version: str


@dataclass
class FakeEntryPoint:
    name: str
    value: str
    target: Any
    dist: FakeDist

    def load(self) -> Any:
        if isinstance(self.target, Exception):
            raise self.target
        return self.target


def registry_with_failure() -> ConnectorRegistry:
    reg = ConnectorRegistry()
    reg.load_plugins(
        [
            FakeEntryPoint(
                "rec", "x:RecordingConnector", RecordingConnector, FakeDist("kv-rec", "2.0")
            ),
            FakeEntryPoint(
                "broken", "broken_mod", ImportError("missing dep zzz"), FakeDist("kv-broken", "0.3")
            ),
        ],
        builtin_fallback=False,
    )
    return reg


def run(argv: list[str], capsys, registry=None) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    list_cmd.add_arguments(parser)
    code = list_cmd.main(parser.parse_args(argv), registry=registry)
    return code, capsys.readouterr().out


def test_table_lists_connectors_and_failures(capsys):
    """The table names each connector's class, distribution and version, then the failures."""
    code, out = run([], capsys, registry_with_failure())
    assert code == 2
    header, row = out.splitlines()[:2]
    assert header.split() == ["NAME", "ALIASES", "CLASS", "DISTRIBUTION", "VERSION", "STATUS"]
    assert row.split() == [
        "RecordingConnector",
        "-",
        "kvconnector_core.testing.recording.RecordingConnector",
        "kv-rec",
        "2.0",
        "ok",
    ]
    failed = out.split("failed to load:")[1]
    assert "broken (kv-broken)" in failed and "zzz" in failed


def test_failed_plugin_exit_code(capsys):
    """A failed plugin exits 2 (with or without the old --strict) and says so on stderr;
    a healthy registry exits 0."""
    for argv in ([], ["--strict"], ["--json"]):
        parser = argparse.ArgumentParser()
        list_cmd.add_arguments(parser)
        assert list_cmd.main(parser.parse_args(argv), registry=registry_with_failure()) == 2
        assert "1 plugin(s) failed to load" in capsys.readouterr().err
    reg = ConnectorRegistry()
    reg.add(RecordingConnector)
    assert run([], capsys, reg)[0] == 0
    assert run(["--strict"], capsys, reg)[0] == 0


def test_json_output(capsys):
    """--json prints connectors and errors as data."""
    code, out = run(["--json"], capsys, registry_with_failure())
    data = json.loads(out)
    assert code == 2
    assert data["connectors"][0]["distribution"] == "kv-rec"
    assert (
        data["errors"][0]["entry_point"] == "broken"
        and data["errors"][0]["distribution"] == "kv-broken"
    )


def test_installed_console_script_lists_builtins_and_ttl():
    """The real command finds the built-in connectors and the installed example plugin."""
    code = "import sys; from kvconnector_core.cli import main; sys.exit(main(['list', '--json']))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    names = {c["name"]: c for c in json.loads(proc.stdout)["connectors"]}
    assert names["MultiConnector"]["distribution"] == "kvconnector"
    assert names["TTLPinConnector"]["distribution"] == "kvconnector-ttl"
    assert names["TTLPinConnector"]["aliases"] == ["ttl"]


class ClashingRecording(RecordingConnector):
    """Another class claiming RecordingConnector's name."""


def registry_with_conflict() -> ConnectorRegistry:
    reg = ConnectorRegistry()
    reg.load_plugins(
        [
            FakeEntryPoint(
                "legit", "x:RecordingConnector", RecordingConnector, FakeDist("kv-legit", "1.0")
            ),
            FakeEntryPoint("squatter", "y:Clash", ClashingRecording, FakeDist("kv-squat", "0.1")),
        ],
        builtin_fallback=False,
    )
    return reg


def test_conflicted_name_is_shown_unusable_naming_both_claimants(capsys):
    """A name two classes claim is a CONFLICT row, and the conflict names both plugins, not one."""
    code, out = run([], capsys, registry_with_conflict())
    assert code == 2
    row = out.splitlines()[1]
    assert row.startswith("RecordingConnector") and row.endswith("CONFLICT (unusable)")
    conflicts = out.split("conflicts")[1]
    assert "kv-legit" in conflicts and "kv-squat" in conflicts
    assert "test_cli_list.ClashingRecording" in conflicts
    assert "failed to load" not in out  # not filed as one plugin's load failure
    assert run(["--strict"], capsys, registry_with_conflict())[0] == 2


def test_conflict_json(capsys):
    """--json: the connector is unusable; the conflict has the holder and the claimant."""
    data = json.loads(run(["--json"], capsys, registry_with_conflict())[1])
    (conn,) = data["connectors"]
    assert conn["usable"] is False and conn["conflicted_names"] == ["RecordingConnector"]
    (conflict,) = data["conflicts"]
    assert conflict["name"] == "RecordingConnector"
    assert conflict["holder"]["distribution"] == "kv-legit"
    assert conflict["claimant"]["distribution"] == "kv-squat"
    assert data["errors"] == []
