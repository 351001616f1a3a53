"""``kvconnector run --metrics FILE`` / ``--metrics-port``: Prometheus series that add up to
the run's report, labelled per MultiConnector child, parsed with prometheus_client's parser."""

from __future__ import annotations

import contextlib
import io
import json
import socket
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvconnector_core.cli import main
from kvconnector_core.metrics import SERIES, EngineMetrics
from kvconnector_core.testing.fault_settings import FaultSettings, HookFault
from kvconnector_core.testing.faults import fault_injection_config


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)  # run_cmd sets one thread on CPU


def _samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, s.labels, s.value)
            for family in text_string_to_metric_families(text) for s in family.samples]


def _total(samples, name: str, **labels: str) -> float:
    return sum(v for n, lab, v in samples
               if n == name and all(lab.get(k) == want for k, want in labels.items()))


def _multi_config(tmp_path) -> str:
    """A MultiConnector of a plain CPU offload child with a disk tier and a faulty one."""
    plain = {"name": "cpu_offload", "extra_config": {
        "num_cpu_blocks": 256, "tiers": [{"type": "disk", "path": str(tmp_path / "disk"),
                                          "capacity_bytes": 2**30}]}}
    faults = FaultSettings(load_failure_rate=0.5, seed=3,
                           raise_in=(HookFault(hook="get_kv_connector_stats", at_step=5),))
    faulty = fault_injection_config({"name": "cpu_offload",
                                     "extra_config": {"num_cpu_blocks": 64}}, faults).to_dict()
    path = tmp_path / "multi.json"
    path.write_text(json.dumps({"name": "MultiConnector",
                                "extra_config": {"connectors": [faulty, plain]}}))
    return str(path)


def _run_json(argv: list[str]) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["run", *argv, "--json", "--no-baseline"])
    assert code == 0, out.getvalue()
    return json.loads(out.getvalue())


def test_metrics_file_parses_and_adds_up_to_the_report(tmp_path):
    """Every counter that has a report figure equals it: prompt tokens by source,
    recomputed tokens, preemptions, failed loads, bytes and seconds per direction (summed
    over the children), contained hook errors plus quarantines, KV events."""
    prom = tmp_path / "run.prom"
    report = _run_json(["--config", _multi_config(tmp_path), "--metrics", str(prom)])
    m = report["metrics"]
    s = _samples(prom.read_text())
    for source, key in (("computed", "prefill_tokens_computed"),
                        ("gpu_prefix_cache", "gpu_prefix_hit_tokens"),
                        ("connector", "connector_hit_tokens")):
        assert _total(s, "kvconnector_prompt_tokens_total", source=source) == m[key]
    assert _total(s, "kvconnector_recomputed_tokens_total") == m["recomputed_tokens"]
    assert _total(s, "kvconnector_preemptions_total") == m["num_preemptions"]
    assert _total(s, "kvconnector_failed_loads_total") == m["num_failed_loads_recovered"] > 0
    for direction, key in (("load", "bytes_loaded"), ("store", "bytes_stored")):
        assert _total(s, "kvconnector_transfer_bytes_total", direction=direction) == m[key] > 0
    for direction, key in (("load", "load_seconds"), ("store", "store_seconds")):
        assert _total(s, "kvconnector_transfer_seconds_sum", direction=direction) == (
            pytest.approx(m[key]))
    errors = (_total(s, "kvconnector_hook_errors_total")
              + _total(s, "kvconnector_quarantines_total"))
    assert errors == sum(m["connector_errors"].values()) > 0
    for key, count in m["events"].items():
        kind, _, medium = key.partition("[")
        if medium:
            assert _total(s, "kvconnector_kv_events_total", type=kind,
                          medium=medium.rstrip("]")) == count


def test_multiconnector_children_are_labelled(tmp_path):
    """Each child's bytes carry its own ``connector`` label; the wrapper's sums are not
    exported as well (the children add up to the report), and tier series name the tier."""
    prom = tmp_path / "run.prom"
    report = _run_json(["--config", _multi_config(tmp_path), "--metrics", str(prom)])
    s = _samples(prom.read_text())
    labels = {lab["connector"] for n, lab, v in s
              if n == "kvconnector_transfer_bytes_total" and v > 0}
    assert len(labels) == 2 and "MultiConnector" not in labels
    children = {k.split(".")[1] for k in report["metrics"]["connector_stats"]
                if k.startswith("children.")}
    assert labels <= children
    assert _total(s, "kvconnector_tier_stores_total", tier="disk") > 0
    assert {lab["hook"] for n, lab, v in s if n == "kvconnector_hook_errors_total"} == {
        "get_kv_connector_stats"}


def test_series_follow_prometheus_naming():
    """Counters end in ``_total``, histograms in ``_seconds``; names are kvconnector_..."""
    for spec in SERIES:
        assert spec.name.startswith("kvconnector_")
        assert spec.name.endswith("_total") == (spec.kind == "counter"), spec.name
        if spec.kind == "histogram":
            assert spec.name.endswith("_seconds")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_metrics_port_serves_while_the_run_runs(monkeypatch):
    """``--metrics-port`` serves /metrics on 127.0.0.1 during the run (scraped from the
    progress callback, so the scrape happens mid-run) and stops serving at the end."""
    port = _free_port()
    scraped: list[str] = []
    update = EngineMetrics.update

    def update_and_scrape(self, engine):
        update(self, engine)
        if not scraped:
            url = f"http://127.0.0.1:{port}/metrics"
            with urllib.request.urlopen(url, timeout=10) as resp:  # noqa: S310 - local URL
                scraped.append(resp.read().decode())

    monkeypatch.setattr(EngineMetrics, "update", update_and_scrape)
    _run_json(["--workload", "private", "--metrics-port", str(port)])
    assert scraped and "kvconnector_prompt_tokens_total" in scraped[0]
    with socket.socket() as sock, pytest.raises(ConnectionRefusedError):
        sock.connect(("127.0.0.1", port))  # the server is closed after the run


def test_taken_metrics_port_is_a_usage_error(capsys):
    """A port that cannot be bound exits 2 naming the flag and the address."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert main(["run", "--workload", "private", "--no-baseline",
                     "--metrics-port", str(port)]) == 2
    assert f"--metrics-port {port}: cannot serve on 127.0.0.1:{port}" in capsys.readouterr().err
