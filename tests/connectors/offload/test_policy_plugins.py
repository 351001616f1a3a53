"""Cache policies are plugins: built-ins register through the hook, a broken policy plugin
is isolated and listed by ``kvconnector list``, an unknown name names the nearest one."""

from __future__ import annotations

import importlib.metadata
import sys
import types
from collections.abc import Iterator

import pytest

from connectors.offload.manager import ARCCachePolicy, LRUCachePolicy
from connectors.offload.manager import registry as policies
from kvconnector_core.cli import list_cmd
from kvconnector_core.plugins.hookspecs import hookimpl
from kvconnector_core.errors import ConfigError

GROUP = "kvconnector.cache_policies"


@pytest.fixture
def plugin_modules() -> Iterator[dict[str, types.ModuleType]]:
    """Fake plugin modules: one good, one raising, one registering a non-policy."""

    class Fifo(LRUCachePolicy):
        """A stand-in third-party policy."""

    good = types.ModuleType("fake_good_policy")
    good.kvconnector_register_cache_policies = hookimpl(  # type: ignore[attr-defined]
        lambda registry: registry.add("fifo-test", Fifo))
    raising = types.ModuleType("fake_raising_policy")

    def boom(registry: object) -> None:
        raise RuntimeError("policy plugin exploded")

    raising.kvconnector_register_cache_policies = hookimpl(boom)  # type: ignore[attr-defined]
    bad = types.ModuleType("fake_bad_policy")
    bad.kvconnector_register_cache_policies = hookimpl(  # type: ignore[attr-defined]
        lambda registry: (registry.add("half-test", Fifo), registry.add("junk-test", dict)))
    mods = {m.__name__: m for m in (good, raising, bad)}
    sys.modules.update(mods)
    saved = (dict(policies._POLICIES), dict(policies._SOURCES), list(policies._ERRORS))
    yield mods
    for name in mods:
        sys.modules.pop(name, None)
    policies._POLICIES.clear()
    policies._POLICIES.update(saved[0])
    policies._SOURCES.clear()
    policies._SOURCES.update(saved[1])
    policies._ERRORS[:] = saved[2]


def _eps(*pairs: tuple[str, str]) -> list[importlib.metadata.EntryPoint]:
    return [importlib.metadata.EntryPoint(n, v, GROUP) for n, v in pairs]


def test_the_built_in_policies_register_through_the_plugin_hook() -> None:
    assert policies.get_cache_policy("lru") is LRUCachePolicy
    assert policies.get_cache_policy("arc") is ARCCachePolicy
    assert policies.policy_sources()["lru"] == "builtin"


def test_a_broken_policy_plugin_is_isolated_and_the_others_load(
        plugin_modules: dict[str, types.ModuleType]) -> None:
    policies.load_policy_plugins(_eps(("good", "fake_good_policy"),
                                      ("raising", "fake_raising_policy"),
                                      ("bad", "fake_bad_policy"),
                                      ("missing", "no_such_policy_module")))
    assert policies.get_cache_policy("fifo-test").__name__ == "Fifo"
    names = policies.available_cache_policies()
    assert "half-test" not in names and "junk-test" not in names  # nothing of a bad plugin
    errors = {e.plugin: e.error for e in policies.policy_plugin_errors()}
    assert errors["raising"] == "RuntimeError: policy plugin exploded"
    assert "is not a subclass of CachePolicy" in errors["bad"]
    assert errors["missing"].startswith("ModuleNotFoundError")


def test_kvconnector_list_shows_policies_and_the_broken_policy_plugins(
        plugin_modules: dict[str, types.ModuleType], capsys: pytest.CaptureFixture[str]) -> None:
    policies.load_policy_plugins(_eps(("good", "fake_good_policy"),
                                      ("raising", "fake_raising_policy")))
    data = list_cmd.collect()
    assert {"name": "fifo-test", "class": f"{__name__}.plugin_modules.<locals>.Fifo",
            "plugin": "good"} in data["cache_policies"]
    assert any("raising (cache policy plugin" in e["entry_point"] for e in data["errors"])
    assert list_cmd.main(type("A", (), {"json": False})()) == 2
    out = capsys.readouterr().out
    assert "cache policies (offload cache_policy):" in out and "fifo-test" in out
    assert "policy plugin exploded" in out


def test_an_unknown_policy_name_names_the_nearest_valid_one() -> None:
    with pytest.raises(ConfigError, match=r"unknown cache policy 'lur' \(did you mean 'lru'\?\)"):
        policies.get_cache_policy("lur")
