"""``kvconnector vllm-check``: the docs' JSON passes, a corrupting connector fails, and bad
input is one line with exit 2."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("vllm", reason="vLLM 0.33 is not installed (make test-vllm)")

from kvconnector_core.cli import main

DOCS_OFFLOAD = """{
  "kv_connector": "KVConnectorAdapter",
  "kv_connector_module_path": "kvconnector_core.integrations.vllm",
  "kv_role": "kv_both",
  "kv_load_failure_policy": "recompute",
  "kv_connector_extra_config": {"kvconnector": {
    "name": "cpu_offload", "extra_config": {"cpu_bytes": 8000000000}}}}"""
"""The cpu_offload example of docs/vllm.md, verbatim."""

CORRUPTING = json.dumps({
    "kv_connector": "KVConnectorAdapter",
    "kv_connector_module_path": "kvconnector_core.integrations.vllm", "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
    "kv_connector_extra_config": {"kvconnector": {"name": "CorruptingConnector",
                                                  "module_path": "_corrupting_connector"}}})


def test_the_docs_cpu_offload_config_passes(capsys):
    """Hits come from the connector, every loaded layer-block is checked, nothing leaks."""
    assert main(["vllm-check", "--kv-transfer-config", DOCS_OFFLOAD]) == 0
    out = capsys.readouterr().out
    assert "result: PASS" in out
    assert re.search(r"served by connector\s+[1-9]\d* tokens", out), out
    assert re.search(r"layer-blocks checked\s+\d+ \([1-9]\d* loaded", out), out


def test_a_connector_that_corrupts_loaded_blocks_fails_and_names_the_first(tmp_path, capsys):
    """Exit 1; the report names the first bad block, as a loaded block; also as JSON."""
    config = tmp_path / "corrupting.json"
    config.write_text(CORRUPTING)
    assert main(["vllm-check", "--kv-transfer-config", str(config)]) == 1
    out = capsys.readouterr().out
    assert "result: FAIL" in out
    assert re.search(r"first bad block\s+request r\d+ block #\d+ \(id \d+, hash [0-9a-f]{16}\) "
                     r"layer model\.layers\.0\.attn worker 0: 1 byte differs .*\(loaded block\)",
                     out), out
    assert main(["vllm-check", "--kv-transfer-config", CORRUPTING, "--json"]) == 1
    (report,) = json.loads(capsys.readouterr().out)
    assert report["wrong_bytes_loaded"] > 0 and not report["ok"]
    assert report["first_bad_block"].startswith("request ")


BAD_INPUT = {
    "malformed JSON": (["--kv-transfer-config", '{"kv_connector": '], "not valid JSON"),
    "no such file": (["--kv-transfer-config", "nowhere.json"], "neither JSON"),
    "unknown kvconnector connector": (
        ["--kv-transfer-config", DOCS_OFFLOAD.replace("cpu_offload", "cpu_ofload")],
        "cpu_ofload"),
    "unknown vLLM connector": (["--kv-transfer-config",
                                '{"kv_connector": "NoSuchConnector", "kv_role": "kv_both"}'],
                               "NoSuchConnector"),
    "config vLLM rejects": (["--kv-transfer-config", DOCS_OFFLOAD.replace("kv_both", "kv_all")],
                            "kv_all"),
    "unknown layout": (["--kv-transfer-config", DOCS_OFFLOAD, "--layouts", "LBHNC", "XYZ"],
                       "XYZ"),
    "fault spec naming no hook": (["--kv-transfer-config", DOCS_OFFLOAD, "--faults",
                                   "start_load=0.1"], "start_load"),
    "fault rate not a number": (["--kv-transfer-config", DOCS_OFFLOAD, "--faults",
                                 "start_load_kv=often"], "often"),
    "unknown workload": (["--kv-transfer-config", DOCS_OFFLOAD, "--workload", "chatty"],
                         "chatty"),
    "adapter class misspelled": (
        ["--kv-transfer-config", DOCS_OFFLOAD.replace("KVConnectorAdapter", "KVConnectorAdaptor")],
        "KVConnectorAdaptor"),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_one_line_naming_the_value_and_exit_2(case, capsys):
    argv, bad = BAD_INPUT[case]
    assert main(["vllm-check", *argv]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("kvconnector vllm-check: error: ") and bad in lines[0]
    assert "Traceback" not in captured.err and captured.out == ""


def test_faults_on_a_vllm_connector_that_is_not_the_adapter_are_a_usage_error(capsys):
    config = '{"kv_connector": "ExampleConnector", "kv_role": "kv_both"}'
    assert main(["vllm-check", "--kv-transfer-config", config, "--faults", "start_load_kv"]) == 2
    assert "ExampleConnector" in capsys.readouterr().err


@pytest.mark.parametrize(("config", "valid"), [
    (DOCS_OFFLOAD.replace("KVConnectorAdapter", "KVConnectorAdaptor"), "KVConnectorAdapterHMA"),
    ('{"kv_connector": "NoSuchConnector", "kv_role": "kv_both"}', "OffloadingConnector"),
], ids=["adapter", "vllm"])
def test_an_unknown_connector_class_lists_the_valid_ones(config, valid, capsys):
    assert main(["vllm-check", "--kv-transfer-config", config]) == 2
    assert valid in capsys.readouterr().err
