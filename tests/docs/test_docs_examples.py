"""Every code block of docs/writing-a-connector.md runs, so the guide cannot rot.

Each fenced block in the guide is preceded by ``<!-- docs-test: NAME -->``; a block without
a marker, or a marker no test here handles, fails :func:`test_every_block_is_marked_and_handled`.
The two example connectors are written out as the package the guide describes
(``my_connectors/``), then the guide's own kit block runs: the contract and the data check
against the no-connector baseline, for both. Further tests show that the examples really
move data, that their failure reporting works (a tier that loses blocks is recomputed,
not served), and that the data check would catch the mistake the guide warns about.
"""

from __future__ import annotations

import inspect
import json
import re
import sys
import tomllib
from pathlib import Path

import pytest

from kvconnector_core.connector import KVConnectorBase_V1, KVConnectorConfig, KVConnectorRole
from kvconnector_core.errors import ConfigError
from kvconnector_core.testing import (
    ConnectorContract,
    DataCheck,
    data_check_workloads,
    run_data_check,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "writing-a-connector.md"
_MARKER = re.compile(r"^<!-- docs-test: ([\w-]+) -->$")
HANDLED = {
    "sync-connector",
    "async-connector",
    "settings",
    "plugin",
    "pyproject",
    "multi-config",
    "kit",
    "scheduler-signatures",
    "worker-signatures",
    "block-bytes",
    "run-by-module-path",
}
WORKLOADS = data_check_workloads()


def doc_blocks() -> tuple[dict[str, str], list[str]]:
    """``(marker name -> block text, problems)`` of every fenced block in the guide."""
    blocks: dict[str, str] = {}
    problems: list[str] = []
    lines = DOC.read_text().splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].startswith("```"):
            i += 1
            continue
        start = i
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        marker = _MARKER.match(lines[start - 1]) if start > 0 else None
        if marker is None:
            problems.append(
                f"line {start + 1}: a code block without <!-- docs-test: NAME --> before it"
            )
        elif marker[1] in blocks:
            problems.append(f"line {start + 1}: marker {marker[1]!r} used twice")
        else:
            blocks[marker[1]] = "\n".join(lines[start + 1 : end]) + "\n"
        i = end + 1
    return blocks, problems


BLOCKS, PROBLEMS = doc_blocks()
KIT_CLASSES = re.findall(
    r"^class (\w+)\((ConnectorContract|DataCheck)\):", BLOCKS.get("kit", ""), re.M
)
KIT_FUNCTIONS = re.findall(r"^def (test_\w+)\(", BLOCKS.get("kit", ""), re.M)
KIT_TESTS = [
    (cls, method)
    for cls, base in KIT_CLASSES
    for method in sorted(dir(ConnectorContract if base == "ConnectorContract" else DataCheck))
    if method.startswith("test_")
]

# A helper module for the failure tests: the examples over a tier that loses every
# other block it is given, so lookups claim blocks the worker cannot load.
_LOSSY = '''
from my_connectors.async_memory import AsyncMemoryConnector
from my_connectors.sync_memory import SyncMemoryConnector


class Lossy(dict):
    def __init__(self):
        super().__init__()
        self.puts = 0

    def __setitem__(self, key, value):
        self.puts += 1
        if self.puts % 2:
            super().__setitem__(key, value)


class LossySync(SyncMemoryConnector):
    name = "LossySync"

    def register_kv_caches(self, kv_caches):
        super().register_kv_caches(kv_caches)
        self.blocks = Lossy()


class UnhandledSync(SyncMemoryConnector):
    """The sync example with its failure handling taken out: it never learns that a
    step's load failed, and keeps claiming what that step planned to store."""

    name = "UnhandledSync"

    def update_connector_output(self, connector_output):
        pass

    def plan_failed(self, connector_metadata, *, loads_failed, stores_failed):
        pass


class LossyAsync(AsyncMemoryConnector):
    name = "LossyAsync"

    def make_worker_side(self):
        worker = super().make_worker_side()
        worker.blocks = Lossy()
        return worker
'''


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory):
    """The guide's ``my_connectors`` package, importable for the module's tests."""
    root = tmp_path_factory.mktemp("docs")
    pkg = root / "my_connectors"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "sync_memory.py").write_text(BLOCKS["sync-connector"])
    (pkg / "async_memory.py").write_text(BLOCKS["async-connector"])
    (pkg / "plugin.py").write_text(BLOCKS["plugin"])
    (pkg / "lossy.py").write_text(_LOSSY)
    # The mistake the guide warns about: load num_external_tokens // block_size blocks.
    cdiv = "end = -(-(start + num_external_tokens) // self.block_size)"
    assert BLOCKS["sync-connector"].count(cdiv) == 1
    (pkg / "sync_floor.py").write_text(
        BLOCKS["sync-connector"].replace(
            cdiv, "end = (start + num_external_tokens) // self.block_size"
        )
    )
    sys.path.insert(0, str(root))
    yield pkg
    sys.path.remove(str(root))
    for name in [m for m in sys.modules if m == "my_connectors" or m.startswith("my_connectors.")]:
        del sys.modules[name]


def config(module: str, name: str) -> KVConnectorConfig:
    return KVConnectorConfig(name=name, module_path=f"my_connectors.{module}")


def test_every_block_is_marked_and_handled():
    """Every fenced block has a marker, and every marker is one this module runs."""
    assert not PROBLEMS, PROBLEMS
    assert set(BLOCKS) == HANDLED


def test_kit_block_defines_contract_and_data_checks_for_both_examples():
    assert sorted(KIT_CLASSES) == sorted(
        [
            ("TestSyncMemoryContract", "ConnectorContract"),
            ("TestSyncMemoryData", "DataCheck"),
            ("TestAsyncMemoryContract", "ConnectorContract"),
            ("TestAsyncMemoryData", "DataCheck"),
        ]
    )


@pytest.mark.parametrize(("cls", "method"), KIT_TESTS, ids=[f"{c}.{m}" for c, m in KIT_TESTS])
def test_kit_block(package, cls: str, method: str):
    """The guide's own kit block, run: contract and data check of both example connectors."""
    namespace: dict[str, object] = {}
    exec(compile(BLOCKS["kit"], f"{DOC}:kit", "exec", dont_inherit=True), namespace)  # noqa: S102 - the doc's code
    getattr(namespace[cls](), method)()


def test_kit_block_functions(package):
    """The kit block's plain test functions (the hit check) run and pass."""
    assert KIT_FUNCTIONS == ["test_both_serve_hits"]
    namespace: dict[str, object] = {}
    exec(compile(BLOCKS["kit"], f"{DOC}:kit", "exec", dont_inherit=True), namespace)  # noqa: S102 - the doc's code
    for name in KIT_FUNCTIONS:
        namespace[name]()


@pytest.mark.parametrize(
    ("module", "name"),
    [("sync_memory", "SyncMemoryConnector"), ("async_memory", "AsyncMemoryConnector")],
)
def test_examples_serve_hits(package, module: str, name: str):
    """The examples really load: a data check that passes a connector that never hits
    would prove nothing, so each one serves tokens on every workload's kind of reuse."""
    for workload in ("block_aligned", "full_prompt_hit"):
        report = run_data_check(config(module, name), WORKLOADS[workload])
        assert report.ok, str(report)
        assert report.checked.metrics.connector_hit_tokens > 0, workload


@pytest.mark.parametrize("name", ["LossySync", "LossyAsync"])
def test_examples_report_lost_blocks_as_failed_loads(package, name: str):
    """A tier that loses blocks: the examples report the failed loads, the engine recomputes
    them, and outputs and KV still match the no-connector run."""
    for workload in ("block_aligned", "repeated_prefixes"):
        report = run_data_check(config("lossy", name), WORKLOADS[workload])
        assert report.ok, str(report)
        assert report.checked.metrics.num_failed_loads_recovered > 0, workload


def test_a_sync_connector_without_failure_handling_never_serves_a_failed_loads_stores(package):
    """The guard skips the saves of a step whose synchronous load failed (its forward ran
    on blocks never loaded), so the sync example passes the kit's failed-load check even
    with its own failure handling taken out."""
    from kvconnector_core.testing import run_failed_load_check

    report = run_failed_load_check(config("lossy", "UnhandledSync"))
    assert report.ok, str(report)
    assert report.injected_raises == 1


def test_data_check_catches_loading_whole_blocks_of_the_claim_only(package):
    """The full-prompt-hit rule matters: the sync example with ``//`` instead of ``cdiv``
    skips the block its claim ends in, and the data check fails it."""
    report = run_data_check(
        config("sync_floor", "SyncMemoryConnector"), WORKLOADS["full_prompt_hit"]
    )
    assert not report.ok
    assert "KV rows in [12, 16) differ from the no-connector run" in report.problems[0], str(report)


def test_settings_block(package):
    """The settings example converts, and typos and bad values are errors naming the key."""
    namespace: dict[str, object] = {}
    exec(compile(BLOCKS["settings"], f"{DOC}:settings", "exec", dont_inherit=True), namespace)  # noqa: S102
    cls = namespace["TierConnector"]
    from kvconnector_core.testing import make_kv_cache_config

    kvc = make_kv_cache_config()
    from kvconnector_core.connector.demo import DemoOptions

    extra = cls.demo_extra_config(DemoOptions(connector="TierConnector", num_gpu_blocks=64))
    connector = cls(
        KVConnectorConfig(name="TierConnector", extra_config=extra), KVConnectorRole.SCHEDULER, kvc
    )
    assert connector.settings.path == "/tmp/my-tier" and connector.settings.mode == "safe"
    for bad, needle in [
        ({"pth": "x"}, "unknown extra_config key 'pth' (did you mean 'path'?)"),
        ({"path": "x", "max_bytes": 0}, "max_bytes=0 is not valid"),
        ({"path": "x", "mode": "slow"}, "valid: fast, safe"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(needle)) as info:
            cls(
                KVConnectorConfig(name="TierConnector", extra_config=bad),
                KVConnectorRole.SCHEDULER,
                kvc,
            )
        assert "TierConnector" in str(info.value)


@pytest.mark.parametrize("dtype", ["int32", "int16", "bfloat16"])
def test_block_bytes_block_round_trips_a_block(dtype: str):
    """The guide's bytes helpers copy one block (every layer) out and into another block
    exactly, in the engine's cross-layer tensors and in vLLM-like 2-byte dtypes, without numpy."""
    import torch

    from kvconnector_core.testing import make_kv_cache_config, make_kv_caches

    namespace: dict[str, object] = {}
    exec(compile(BLOCKS["block-bytes"], f"{DOC}:block-bytes", "exec", dont_inherit=True), namespace)  # noqa: S102
    to_bytes, from_bytes = namespace["block_to_bytes"], namespace["bytes_to_block"]
    kvc = make_kv_cache_config()
    kv = [
        t.view(getattr(torch, dtype)) if dtype == "bfloat16" else t.to(getattr(torch, dtype))
        for t in make_kv_caches(kvc).values()
    ]
    for t in kv:
        t.view(torch.uint8).copy_(
            torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8)
        )
    data = to_bytes(kv, 3)
    assert len(data) == sum(t[3].numel() * t.element_size() for t in kv)
    from_bytes(kv, 5, bytes(data))
    for t in kv:
        assert torch.equal(t[5].view(torch.uint8), t[3].view(torch.uint8))
    with pytest.raises(ValueError, match="block data has"):
        from_bytes(kv, 5, bytes(data)[:-1])


def test_plugin_and_pyproject_blocks(package):
    """The entry point of the pyproject block names the plugin module, whose hook registers
    both examples."""
    import importlib

    from kvconnector_core.connector import ConnectorRegistry

    project = tomllib.loads(BLOCKS["pyproject"])
    entry_points = project["project"]["entry-points"]["kvconnector"]
    assert "kvconnector" in project["project"]["dependencies"]
    (module,) = entry_points.values()
    plugin = importlib.import_module(module)
    registry = ConnectorRegistry()
    plugin.kvconnector_register_connectors(registry)
    assert registry.get("SyncMemoryConnector").__module__ == "my_connectors.sync_memory"
    assert registry.get("AsyncMemoryConnector").__module__ == "my_connectors.async_memory"


def test_run_by_module_path_block(package, tmp_path, capsys, monkeypatch):
    """The block's config runs the unpackaged sync example with ``kvconnector run`` (the
    package fixture puts its parent on the import path, as the block's PYTHONPATH does)."""
    from kvconnector_core.cli import main

    block = BLOCKS["run-by-module-path"]
    text = block[block.index("'") + 1:block.rindex("'")]
    config = json.loads(text)
    assert config["module_path"] == "my_connectors.sync_memory"
    assert "PYTHONPATH=" in block and "kvconnector run --config sync.json" in block
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sync.json").write_text(text)
    assert main(["run", "--config", "sync.json", "--workload", "chat"]) == 0
    assert "outputs identical to baseline: yes" in capsys.readouterr().out


def test_multi_config_block():
    """The MultiConnector config of the guide creates in both roles."""
    from kvconnector_core.connector import create_connector
    from kvconnector_core.testing import make_kv_cache_config

    kvc = make_kv_cache_config()
    cfg = KVConnectorConfig.from_dict(json.loads(BLOCKS["multi-config"]))
    for role in KVConnectorRole:
        connector = create_connector(cfg, role, kvc)
        assert connector.name == "MultiConnector"
        connector.shutdown()


def _signature(method: str) -> str:
    sig = inspect.signature(getattr(KVConnectorBase_V1, method))
    params = [p for name, p in sig.parameters.items() if name != "self"]
    text = str(sig.replace(parameters=params)).replace("'", "")
    return f"{method}{text}"


@pytest.mark.parametrize("block", ["scheduler-signatures", "worker-signatures"])
def test_signature_blocks_match_the_base_class(block: str):
    """Each line of the guide's signature lists is the base class's signature, exactly."""
    lines = [line for line in BLOCKS[block].splitlines() if line.strip()]
    assert lines
    for line in lines:
        assert line == _signature(line.split("(")[0]), line


def test_readme_lists_every_doc_page_and_both_examples():
    """The README links every page in docs/ and both example packages, and its quick start
    stays the two commands `make run` and `make test`."""
    root = DOC.parent.parent
    readme = (root / "README.md").read_text()
    for page in sorted((root / "docs").glob("*.md")):
        assert f"](docs/{page.name})" in readme, page.name
    for example in sorted(
        p.name for p in (root / "examples").iterdir() if (p / "pyproject.toml").exists()
    ):
        assert f"`examples/{example}/`" in readme, example
    quick = readme.split("## Quick start")[1].split("```bash\n")[1].split("```")[0]
    assert [
        line.split("#")[0].strip() for line in quick.splitlines() if not line.startswith(" ")
    ] == ["make run", "make test"]


@pytest.mark.parametrize(
    ("module", "name"),
    [("sync_memory", "SyncMemoryConnector"), ("async_memory", "AsyncMemoryConnector")],
)
def test_examples_never_serve_saves_of_a_step_whose_load_failed(package, module: str, name: str):
    """With ``start_load_kv`` raising, the step's forward runs on bad blocks; the examples
    un-mark that step's saves after a failed load instead of serving them later (rows and
    outputs would differ)."""
    from kvconnector_core.testing import FaultSettings, HookFault, fault_injection_config

    faults = FaultSettings(raise_in=(HookFault(hook="start_load_kv", rate=0.2),))
    report = run_data_check(
        fault_injection_config(config(module, name), faults), "repeated_prefixes"
    )
    assert report.ok, str(report)
    assert report.injected_raises > 0
