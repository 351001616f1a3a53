"""The connector registry: plugins through entry points, validation, allow/deny,
create_connector."""

from __future__ import annotations

import importlib.metadata
import sys
import types
from typing import Any

import pytest
from _plugin_helpers import FakeEntryPoint, ep, plugin

from kvconnector_core.connector import (
    ConnectorRegistry,
    KVConnectorConfig,
    KVConnectorRole,
    create_connector,
    get_registry,
    hookimpl,
    reset_registry,
)
from kvconnector_core.errors import (
    ConfigError,
    DuplicateConnectorError,
    InvalidConnectorError,
    PluginLoadError,
    UnknownConnectorError,
)
from kvconnector_core.plugins.registry import get_connector_class
from kvconnector_core.testing import RecordingConnector


class OtherRecording(RecordingConnector):
    """A different class claiming RecordingConnector's name."""


class Second(RecordingConnector):
    """A second valid connector."""

    name = "Second"
    aliases = ("second",)


def load(*eps: FakeEntryPoint, **kwargs: Any) -> ConnectorRegistry:
    reg = ConnectorRegistry()
    reg.load_plugins(list(eps), builtin_fallback=False, **kwargs)
    return reg


def test_plugin_registers_through_hook_with_distribution():
    """A plugin's hook adds a class; the entry records the distribution and version."""
    reg = load(ep("rec", plugin(RecordingConnector), "kv-rec"))
    entry = reg.get_entry("RecordingConnector")
    assert entry.cls is RecordingConnector
    assert (entry.distribution, entry.version, entry.source) == ("kv-rec", "1.0", "rec")
    assert reg.errors == []


def test_aliases_from_class_and_add():
    """Aliases come from the class attribute and from add(aliases=...)."""
    reg = ConnectorRegistry()
    reg.add(Second, aliases=("two",))
    assert reg.get("second") is Second and reg.get("two") is Second
    assert reg.names() == ["Second"]


def test_unknown_name_lists_available():
    """An unknown name raises UnknownConnectorError listing the registered names."""
    reg = ConnectorRegistry()
    reg.add(Second)
    with pytest.raises(UnknownConnectorError, match=r"'nope'.*Second") as info:
        reg.get("nope")
    assert isinstance(info.value, ValueError)


def test_duplicate_names_both_classes_and_distributions():
    """Two classes claiming one name: recorded, and get() raises naming both and their dists."""
    reg = load(
        ep("a", plugin(RecordingConnector), "dist-a"),
        ep("b", plugin(OtherRecording, Second), "dist-b"),
    )
    with pytest.raises(DuplicateConnectorError) as info:
        reg.get("RecordingConnector")
    msg = str(info.value)
    assert "testing.recording.RecordingConnector" in msg and "OtherRecording" in msg
    assert "dist-a" in msg and "dist-b" in msg
    assert reg.get("Second") is Second  # the plugin's other class still registered
    assert [f.plugin.entry_point for f in reg.errors] == ["b"]


def test_same_class_twice_is_not_an_error():
    """Registering one class twice (two plugins) is a no-op."""
    reg = load(ep("a", plugin(RecordingConnector)), ep("b", plugin(RecordingConnector), "dist-b"))
    assert reg.errors == [] and reg.get("RecordingConnector") is RecordingConnector


def test_direct_duplicate_raises():
    """Outside plugin loading, a clash raises at once."""
    reg = ConnectorRegistry()
    reg.add(RecordingConnector)
    with pytest.raises(DuplicateConnectorError):
        reg.add(OtherRecording)


@pytest.mark.parametrize(
    "bad",
    [object, 42, type("Abstract", (RecordingConnector.__mro__[1],), {"name": "x"})],
    ids=["not-subclass", "not-class", "abstract"],
)
def test_not_a_connector_is_rejected(bad):
    """Registering something that is not a concrete connector raises InvalidConnectorError."""
    with pytest.raises(InvalidConnectorError):
        ConnectorRegistry().add(bad)


def test_nameless_connector_is_rejected():
    """A connector class without a name is rejected, naming the class."""
    nameless = type("Nameless", (RecordingConnector,), {"name": ""})
    with pytest.raises(InvalidConnectorError, match="Nameless"):
        ConnectorRegistry().add(nameless)


def test_invalid_class_from_plugin_is_recorded_with_plugin():
    """A plugin registering a non-connector is recorded naming its entry point and distribution."""
    reg = load(ep("bad", plugin(dict), "dist-bad"), ep("good", plugin(Second), "dist-good"))
    assert reg.names() == ["Second"]
    (failure,) = reg.errors
    assert isinstance(failure.error, InvalidConnectorError)
    assert "'bad'" in failure.message and "dist-bad" in failure.message


def test_broken_entry_point_does_not_stop_others():
    """An entry point that fails to import is recorded; the other plugins still load."""
    reg = load(
        ep("broken", ImportError("no module named zzz"), "dist-broken"), ep("ok", plugin(Second))
    )
    assert reg.get("Second") is Second
    (failure,) = reg.errors
    assert isinstance(failure.error, PluginLoadError)
    assert (
        "broken" in failure.message
        and "dist-broken" in failure.message
        and "zzz" in failure.message
    )
    assert isinstance(failure.error.__cause__, ImportError)


def test_hook_that_raises_is_contained():
    """A plugin hook raising an arbitrary exception is recorded as PluginLoadError."""
    mod = types.ModuleType("raiser")

    @hookimpl
    def kvconnector_register_connectors(registry):
        raise RuntimeError("boom")

    mod.kvconnector_register_connectors = kvconnector_register_connectors
    reg = load(ep("raiser", mod), ep("ok", plugin(Second)))
    assert reg.names() == ["Second"] and "boom" in reg.errors[0].message


def test_plugin_with_misspelled_hook_is_rejected():
    """A @hookimpl that matches no hookspec is reported, not silently ignored."""
    mod = types.ModuleType("typo")

    @hookimpl
    def kvconnector_register_conectors(registry):  # typo
        registry.add(Second)

    mod.kvconnector_register_conectors = kvconnector_register_conectors
    reg = load(ep("typo", mod), ep("ok", plugin(RecordingConnector)))
    assert reg.names() == ["RecordingConnector"]
    assert "typo" in reg.errors[0].message


def test_entry_point_may_name_a_connector_class():
    """An entry point may point straight at a connector class."""
    reg = load(ep("direct", Second))
    assert reg.get("second") is Second


@pytest.mark.parametrize(
    ("allow", "deny", "expected"),
    [
        (None, None, ["RecordingConnector", "Second"]),
        (["dist-a"], None, ["RecordingConnector"]),
        (["b"], None, ["Second"]),
        (None, ["a"], ["Second"]),
        (None, ["dist-b"], ["RecordingConnector"]),
    ],
    ids=["all", "allow-dist", "allow-ep", "deny-ep", "deny-dist"],
)
def test_allow_and_deny_lists(allow, deny, expected):
    """Allow/deny lists match entry-point or distribution names; skipped plugins are recorded."""
    reg = load(
        ep("a", plugin(RecordingConnector), "dist-a"),
        ep("b", plugin(Second), "dist-b"),
        allow=allow,
        deny=deny,
    )
    assert reg.names() == expected
    assert len(reg.skipped) == 2 - len(expected)


def test_env_deny_can_remove_builtin(monkeypatch):
    """KVCONNECTOR_PLUGINS_DENY=builtin removes the built-in connectors."""
    monkeypatch.setenv("KVCONNECTOR_PLUGINS_DENY", "builtin")
    reg = ConnectorRegistry()
    reg.load_plugins([])
    assert "MultiConnector" not in reg


def test_allow_list_does_not_drop_builtin(monkeypatch):
    """The allow-list applies to third-party plugins only."""
    monkeypatch.setenv("KVCONNECTOR_PLUGINS_ALLOW", "nothing-else")
    reg = ConnectorRegistry()
    reg.load_plugins([ep("a", plugin(Second))])
    assert "MultiConnector" in reg and "Second" not in reg


def test_default_registry_is_lazy_and_loaded_once(monkeypatch):
    """get_registry() reads entry points on first use only, through importlib.metadata."""
    calls = []

    def fake_entry_points(*, group):
        calls.append(group)
        return [ep("a", plugin(Second))]

    monkeypatch.setattr(importlib.metadata, "entry_points", fake_entry_points)
    reset_registry()
    try:
        assert calls == []
        reg = get_registry()
        assert get_registry() is reg and calls == ["kvconnector"]
        assert "Second" in reg and "MultiConnector" in reg  # built-ins via fallback
    finally:
        reset_registry()


def test_importing_the_package_loads_nothing():
    """Importing kvconnector_core.connector loads no plugin and no torch (fresh interpreter)."""
    import subprocess

    code = (
        "import sys, kvconnector_core.connector, connectors; "
        "import kvconnector_core.plugins.registry as r; "
        "assert r._default is None; assert 'torch' not in sys.modules; "
        "assert 'ttl_connector' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_create_connector_from_dict_and_module_path():
    """create_connector accepts a dict; module_path wins over the registry."""
    reg = ConnectorRegistry()
    conn = create_connector(
        {"name": "RecordingConnector", "module_path": "kvconnector_core.testing.recording"},
        KVConnectorRole.WORKER,
        None,
        registry=reg,
    )
    assert isinstance(conn, RecordingConnector) and conn.role is KVConnectorRole.WORKER
    with pytest.raises(UnknownConnectorError, match="RecordingConnector"):
        get_connector_class(
            KVConnectorConfig(name="Nope", module_path="kvconnector_core.testing.recording")
        )
    with pytest.raises(InvalidConnectorError):
        get_connector_class(
            KVConnectorConfig(
                name="RecordingMetadata", module_path="kvconnector_core.testing.recording"
            )
        )
    with pytest.raises(PluginLoadError, match="no_such_module"):
        get_connector_class(KVConnectorConfig(name="X", module_path="no_such_module"))


@pytest.mark.parametrize(
    "data",
    [
        {"name": ""},
        {"name": "x", "role": "sender"},
        {"name": "x", "load_failure_policy": "retry"},
        {"role": "kv_both"},
        {"name": 3},
    ],
    ids=["empty", "role", "policy", "missing", "type"],
)
def test_bad_config_is_a_config_error(data):
    """Invalid configs raise ConfigError (a ValueError) naming the problem."""
    with pytest.raises(ConfigError):
        KVConnectorConfig.from_dict(data)


def test_load_connector_config_file(tmp_path):
    """load_connector_config reads JSON; a bad file names the path."""
    good = tmp_path / "c.json"
    good.write_text('{"name": "ttl", "extra_config": {"ttl_seconds": 5}}')
    assert KVConnectorConfig.from_dict(load_connector_config_dict(good)) == KVConnectorConfig(
        name="ttl", extra_config={"ttl_seconds": 5}
    )
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "x", "role": "nope"}')
    from kvconnector_core.connector import load_connector_config

    with pytest.raises(ConfigError, match="bad.json"):
        load_connector_config(bad)


def load_connector_config_dict(path):
    from kvconnector_core.connector import load_connector_config

    return load_connector_config(path).to_dict()


def test_module_path_with_a_registry_name_names_the_attribute_to_use():
    """Stranger log (docs16): {"name": "cpu_offload", "module_path": ...} said only "has no
    attribute 'cpu_offload'" and listed the imported abstract base among the connector
    classes; it now says that name is the attribute name and which one to use."""
    with pytest.raises(UnknownConnectorError) as info:
        get_connector_class(
            KVConnectorConfig(name="cpu_offload", module_path="connectors.offload.connector")
        )
    message = str(info.value)
    assert "not its registry name or alias: use 'OffloadingConnector'" in message, message
    assert "KVConnectorBase_V1" not in message, message


def test_an_empty_alias_is_rejected():
    with pytest.raises(InvalidConnectorError, match="invalid alias ''"):
        ConnectorRegistry().add(Second, aliases=("",))


def test_registering_a_class_again_keeps_its_aliases_and_origin():
    """A second add of the same class only adds aliases: the first ones and the plugin
    it came from stay."""
    reg = load(ep("a", plugin(Second), "dist-a"))
    reg.add(Second, aliases=("one",))
    reg.add(Second, aliases=("two",))
    entry = reg.get_entry("two")
    assert entry.aliases == ("second", "one", "two")
    assert (entry.distribution, entry.source) == ("dist-a", "a")


def test_names_are_sorted_whatever_the_registration_order():
    reg = ConnectorRegistry()
    reg.add(Second)
    reg.add(RecordingConnector)
    assert reg.names() == ["RecordingConnector", "Second"]
    assert [e.name for e in reg] == ["RecordingConnector", "Second"]


def test_unknown_name_names_the_plugins_that_failed():
    """The connector asked for may live in a plugin that failed to load: say which."""
    reg = load(
        ep("broken", ImportError("no module named zzz"), "dist-broken"), ep("ok", plugin(Second))
    )
    with pytest.raises(UnknownConnectorError, match=r"plugins with errors.*broken"):
        reg.get("Missing")


def test_module_path_naming_an_abstract_class_is_rejected():
    cfg = KVConnectorConfig(
        name="KVConnectorBase_V1", module_path="kvconnector_core.connector.base"
    )
    with pytest.raises(InvalidConnectorError, match="not a concrete connector class"):
        get_connector_class(cfg, registry=ConnectorRegistry())


def test_reset_registry_makes_the_next_get_registry_load_again():
    first = get_registry()
    reset_registry()
    second = get_registry()
    assert second is not first and second.names() == first.names()
