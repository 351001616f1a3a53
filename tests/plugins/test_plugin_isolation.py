"""Plugins and isolation: module_path vs allow/deny, contained import-time exits,
names claimed twice."""

from __future__ import annotations

import argparse
import sys
import types

import pytest
from _plugin_helpers import ep, plugin

from kvconnector_core.cli import list_cmd
from kvconnector_core.cli import main as cli_main
from kvconnector_core.connector import ConnectorRegistry, KVConnectorConfig, hookimpl
from kvconnector_core.errors import DuplicateConnectorError, PluginDeniedError, PluginLoadError
from kvconnector_core.plugins import registry as registry_module
from kvconnector_core.plugins.registry import get_connector_class
from kvconnector_core.testing import RecordingConnector


class Second(RecordingConnector):
    """A valid connector of another plugin."""

    name = "Second"


def list_output(reg: ConnectorRegistry, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    list_cmd.add_arguments(parser)
    code = list_cmd.main(parser.parse_args([]), registry=reg)
    return code, capsys.readouterr().out


# -- module_path is checked before anything is imported --------------------------------------------


@pytest.fixture
def tripwire_package(tmp_path, monkeypatch):
    """A package ``tripwire_pkg.conn`` whose import (of either module) leaves a marker file."""
    pkg = tmp_path / "tripwire_pkg"
    pkg.mkdir()
    marker = tmp_path / "imported"
    (pkg / "__init__.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('pkg ')\n"
    )
    (pkg / "conn.py").write_text(
        f"import pathlib\np = pathlib.Path({str(marker)!r})\n"
        "p.write_text(p.read_text() + 'conn ')\n"
        "from kvconnector_core.testing import RecordingConnector as Tripwire\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield marker
    for name in ("tripwire_pkg.conn", "tripwire_pkg"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize(
    ("allow", "deny", "match"),
    [
        (None, ["tripwire-pkg"], r"denied by KVCONNECTOR_PLUGINS_DENY \(matches tripwire-pkg\)"),
        (
            None,
            ["tripwire_pkg.conn"],
            r"denied by KVCONNECTOR_PLUGINS_DENY \(matches tripwire-pkg-conn\)",
        ),
        (
            ["something-else"],
            None,
            r"not in KVCONNECTOR_PLUGINS_ALLOW \(something-else\).*add 'tripwire_pkg'",
        ),
    ],
    ids=["deny-package", "deny-module", "not-allowed"],
)
def test_excluded_module_path_is_never_imported(tripwire_package, allow, deny, match):
    """A module_path the lists exclude raises PluginDeniedError naming the list; neither the module
    nor its package was imported."""
    reg = ConnectorRegistry()
    reg.load_plugins([], allow=allow, deny=deny, builtin_fallback=False)
    config = KVConnectorConfig(name="Tripwire", module_path="tripwire_pkg.conn")
    with pytest.raises(PluginDeniedError, match=match) as info:
        get_connector_class(config, registry=reg)
    assert "'tripwire_pkg.conn'" in str(info.value) and "not imported" in str(info.value)
    assert isinstance(info.value, PluginLoadError)
    assert not tripwire_package.exists()
    assert "tripwire_pkg" not in sys.modules


def test_allowed_module_path_loads(tripwire_package):
    """The same module loads when the allow-list names it."""
    reg = ConnectorRegistry()
    reg.load_plugins([], allow=["tripwire_pkg"], builtin_fallback=False)
    cls = get_connector_class(
        KVConnectorConfig(name="Tripwire", module_path="tripwire_pkg.conn"), registry=reg
    )
    assert cls is RecordingConnector and tripwire_package.read_text() == "pkg conn "


def test_module_path_uses_environment_lists_without_a_registry(tripwire_package, monkeypatch):
    """With no registry, the environment's deny-list applies."""
    monkeypatch.setenv("KVCONNECTOR_PLUGINS_DENY", "tripwire_pkg")
    with pytest.raises(PluginDeniedError):
        get_connector_class(KVConnectorConfig(name="Tripwire", module_path="tripwire_pkg.conn"))
    assert not tripwire_package.exists()


def test_builtin_module_path_ignores_allow_list_but_not_a_builtin_deny():
    """kvconnector's own modules count as the built-in plugin."""
    config = KVConnectorConfig(
        name="RecordingConnector", module_path="kvconnector_core.testing.recording"
    )
    reg = ConnectorRegistry()
    reg.load_plugins([], allow=["only-this"], builtin_fallback=False)
    assert get_connector_class(config, registry=reg) is RecordingConnector
    reg = ConnectorRegistry()
    reg.load_plugins([], deny=["builtin"], builtin_fallback=False)
    with pytest.raises(PluginDeniedError, match="matches builtin"):
        get_connector_class(config, registry=reg)


# -- whatever a plugin raises at import is contained -----------------------------------------------


def _exit() -> None:
    sys.exit(3)


class PluginBaseError(BaseException):
    """A plugin's own BaseException."""


def _raise_base() -> None:
    raise PluginBaseError("not an Exception")


@pytest.mark.parametrize(
    ("target", "kind"),
    [(_exit, "SystemExit: 3"), (_raise_base, "PluginBaseError")],
    ids=["sys-exit", "base-exception"],
)
def test_import_time_exit_is_contained_and_the_cli_keeps_working(capsys, target, kind):
    """An entry point calling sys.exit() or raising a BaseException at import is a recorded failure:
    the other plugins load and `kvconnector list` lists them and the failure."""
    reg = ConnectorRegistry()
    reg.load_plugins(
        [ep("bad", target, "dist-bad"), ep("good", plugin(Second), "dist-good")],
        builtin_fallback=False,
    )
    assert reg.names() == ["Second"]
    (failure,) = reg.errors
    assert (
        isinstance(failure.error, PluginLoadError)
        and kind in failure.message
        and "dist-bad" in failure.message
    )
    code, out = list_output(reg, capsys)
    assert code == 2 and "Second" in out and "failed to load" in out and kind in out


def test_hook_calling_sys_exit_is_contained():
    """sys.exit() inside the registration hook is contained too."""
    mod = types.ModuleType("exiter")

    @hookimpl
    def kvconnector_register_connectors(registry):
        sys.exit("bye")

    mod.kvconnector_register_connectors = kvconnector_register_connectors
    reg = ConnectorRegistry()
    reg.load_plugins(
        [ep("exiter", mod, "dist-x"), ep("good", plugin(Second), "dist-good")],
        builtin_fallback=False,
    )
    assert reg.names() == ["Second"] and "SystemExit: bye" in reg.errors[0].message


def test_keyboard_interrupt_is_not_swallowed():
    """Ctrl-C while a plugin imports is the user's: it propagates."""

    def interrupt() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ConnectorRegistry().load_plugins(
            [ep("slow", interrupt, "dist-slow")], builtin_fallback=False
        )


def test_module_path_calling_sys_exit_is_a_plugin_load_error(tmp_path, monkeypatch):
    """A module_path whose import exits becomes a PluginLoadError, not the end of the process."""
    (tmp_path / "exiting_conn.py").write_text("import sys\nsys.exit(5)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.raises(PluginLoadError, match=r"'exiting_conn'.*SystemExit: 5"):
            get_connector_class(
                KVConnectorConfig(name="X", module_path="exiting_conn"),
                registry=ConnectorRegistry(),
            )
    finally:
        sys.modules.pop("exiting_conn", None)


# -- a name or alias claimed twice -----------------------------------------------------------------


class Impostor(RecordingConnector):
    """A third-party class claiming the built-in alias cpu_offload."""

    name = "Impostor"


@pytest.fixture
def impostor_registry(monkeypatch):
    """The default registry: the built-ins plus a plugin whose class claims ``cpu_offload``."""
    reg = ConnectorRegistry()
    reg.load_plugins([ep("impostor", plugin(Impostor, aliases=("cpu_offload",)), "kv-impostor")])
    monkeypatch.setattr(registry_module, "_default", reg)
    return reg


def test_claiming_a_taken_alias_is_an_error_naming_both_plugins(impostor_registry):
    """The clash is recorded for the claimant and using the name raises, naming both plugins."""
    (failure,) = impostor_registry.errors
    assert failure.plugin.entry_point == "impostor"
    with pytest.raises(DuplicateConnectorError) as info:
        impostor_registry.get("cpu_offload")
    msg = str(info.value)
    assert "OffloadingConnector from entry point 'builtin'" in msg
    assert "Impostor from entry point 'impostor' (distribution kv-impostor 1.0)" in msg
    assert impostor_registry.conflict("cpu_offload") is info.value
    assert impostor_registry.conflict("OffloadingConnector") is None


def test_default_run_with_a_claimed_default_name_fails_naming_both(impostor_registry, capsys):
    """`kvconnector run` with no --connector, when the default name is claimed twice, is a
    usage error naming both plugins (not a silent run with no connector)."""
    assert cli_main(["run", "--workload", "chat", "--no-baseline"]) == 2
    err = capsys.readouterr().err
    assert "'cpu_offload' is claimed by two classes" in err
    assert "entry point 'builtin'" in err and "entry point 'impostor'" in err
    assert "Traceback" not in err


def test_installed_plugin_calling_sys_exit_leaves_kvconnector_list_working(tmp_path):
    """End to end: an installed distribution whose plugin calls sys.exit() at import; the real
    `kvconnector list` still exits 0, lists the built-ins and names the broken plugin."""
    import os
    import subprocess

    dist = tmp_path / "kv_evil-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kv-evil\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[kvconnector]\nevil = evil_plugin\n")
    (tmp_path / "evil_plugin.py").write_text("import sys\nsys.exit('evil plugin says bye')\n")
    code = "import sys; from kvconnector_core.cli import main; sys.exit(main(['list']))"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 2, proc.stderr  # 2: a plugin failed (listed below)
    assert "OffloadingConnector" in proc.stdout and "MultiConnector" in proc.stdout
    failed = proc.stdout.split("failed to load:")[1]
    assert "evil (kv-evil)" in failed and "SystemExit: evil plugin says bye" in failed
