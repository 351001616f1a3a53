"""The per-step timeline: it adds up to the run's totals, reaches the JSON report, and
`kvconnector run --plot` draws it (or says how to install matplotlib)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from kvconnector_core.cli import main
from kvconnector_core.connector.config import KVConnectorConfig
from kvconnector_core.engine.engine import Engine
from kvconnector_core.engine.workloads import Trace, dump_trace_jsonl
from kvconnector_core.testing import data_check_workloads

WORKLOAD = data_check_workloads()["block_aligned"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)  # run_cmd sets one thread on CPU


def run(connector: KVConnectorConfig):
    with Engine(WORKLOAD.engine_config(connector)) as engine:
        return engine.run(Trace(WORKLOAD.name, list(WORKLOAD.requests)))


def test_timeline_adds_up_to_the_totals():
    result = run(KVConnectorConfig(name="cpu_offload", extra_config={"num_cpu_blocks": 64}))
    m, records = result.metrics, result.timeline
    # One record per executed step (idle gaps between arrivals are skipped, not stepped).
    assert 0 < len(records) <= m.steps
    assert [r.step for r in records] == sorted({r.step for r in records})
    assert sum(r.computed_tokens for r in records) == m.prefill_tokens_computed
    assert sum(r.gpu_hit_tokens for r in records) == m.gpu_prefix_hit_tokens
    assert sum(r.connector_hit_tokens for r in records) == m.connector_hit_tokens > 0
    assert sum(r.bytes_moved.get("cpu_offload.loaded", 0) for r in records) == m.bytes_loaded > 0
    assert sum(r.bytes_moved.get("cpu_offload.stored", 0) for r in records) == m.bytes_stored > 0
    assert all(r.hit_rate is None or 0 <= r.hit_rate <= 1 for r in records)


def test_multiconnector_timeline_has_one_tier_per_child():
    child = {"name": "ReferenceConnector", "module_path": "_reference_connector"}
    offload = {"name": "cpu_offload", "extra_config": {"num_cpu_blocks": 64}}
    result = run(
        KVConnectorConfig(name="MultiConnector", extra_config={"connectors": [child, offload]})
    )
    tiers = {k for r in result.timeline for k in r.bytes_moved}
    assert {"ReferenceConnector.stored", "OffloadingConnector.stored"} <= tiers
    assert not any(k.startswith("MultiConnector") for k in tiers)


@pytest.fixture
def trace_file(tmp_path):
    path = tmp_path / "t.jsonl"
    dump_trace_jsonl(Trace("t", list(WORKLOAD.requests)), path)
    return path


def test_json_report_carries_the_timeline(trace_file, capsys):
    assert main(["run", "--trace", str(trace_file), "--json", "--no-baseline"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert 0 < len(report["timeline"]) <= report["metrics"]["steps"]
    assert {"step", "hit_rate", "bytes_moved"} <= set(report["timeline"][0])


def test_plot_without_matplotlib_says_how_to_install_it(trace_file, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    code = main(
        ["run", "--trace", str(trace_file), "--no-baseline", "--plot", str(tmp_path / "p.png")]
    )
    assert code == 2
    assert "pip install 'kvconnector[plot]'" in capsys.readouterr().err


def test_plot_draws_a_png(trace_file, tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="needs matplotlib (pip install 'kvconnector[plot]')")
    out = tmp_path / "p.png"
    assert main(["run", "--trace", str(trace_file), "--no-baseline", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
