"""``kvconnector run``: default run, JSON report, errors that list valid choices, exit codes."""

from __future__ import annotations

import json

import pytest
import torch

from kvconnector_core.cli import main
from kvconnector_core.engine.engine import RunMetrics, RunResult
from kvconnector_core.engine.report import compare_outputs, format_report
from kvconnector_core.engine.workloads import dump_trace_jsonl, private_prefixes


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)  # run_cmd sets one thread on CPU


def test_json_run_with_baseline(capsys):
    """The JSON report has metrics for both runs and says the outputs are identical."""
    assert main(["run", "--workload", "documents", "--json", "--num-gpu-blocks", "48"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["workload"] == "documents"
    assert report["metrics"]["num_finished"] == report["metrics"]["num_requests"] > 0
    if report["connector"] is not None:
        assert report["comparison"]["identical"] is True
        assert report["baseline_metrics"]["num_requests"] == report["metrics"]["num_requests"]


def test_trace_file_without_connector(tmp_path, capsys):
    """--trace runs a JSONL file; --connector none runs no connector and no baseline."""
    path = tmp_path / "t.jsonl"
    dump_trace_jsonl(private_prefixes(1, num_users=2, prefix_len=40, requests_per_user=2), path)
    assert main(["run", "--trace", str(path), "--connector", "none", "--no-baseline"]) == 0
    out = capsys.readouterr().out
    assert "workload 't'" in out and "connector: none" in out and "4 finished / 4" in out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--workload", "nope"], "valid workloads: chat, chat_large, documents, mixed, private"),
        (["--connector", "nope"], "nope"),
        (["--device", "tpu"], "valid devices: cpu, cuda"),
        (["--trace", "/no/such/file.jsonl"], "no/such/file.jsonl"),
    ],
    ids=["workload", "connector", "device", "trace"],
)
def test_usage_errors_name_valid_choices(capsys, argv, needle):
    """Bad names exit 2 with a message listing what is valid."""
    assert main(["run", *argv, "--no-baseline"]) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error shown without CUDA")
def test_cuda_without_cuda_is_a_clear_error(capsys):
    """--device cuda on a machine without CUDA exits 2 and says so."""
    assert main(["run", "--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_comparison_reports_first_difference():
    """A differing run names the first differing request and token."""
    def result(outputs):
        return RunResult("w", "c", "cpu", outputs, {k: "FINISHED_LENGTH_CAPPED" for k in outputs},
                         RunMetrics())
    base = result({"a": [1, 2, 3], "b": [4, 5]})
    bad = result({"a": [1, 2, 3], "b": [4, 6]})
    cmp = compare_outputs(bad, base)
    assert (
        not cmp.identical and cmp.first_differing_request == "b" and cmp.first_differing_token == 1
    )
    assert "outputs identical to baseline: NO" in format_report(bad, base)
    assert compare_outputs(base, base).identical


@pytest.mark.parametrize("content", ["", "\n  \n\n"], ids=["empty", "blank"])
def test_empty_trace_is_a_usage_error(tmp_path, capsys, content):
    """An empty or blank trace file exits 2 naming the file, without a traceback."""
    path = tmp_path / "nothing.jsonl"
    path.write_text(content)
    assert main(["run", "--trace", str(path), "--connector", "none"]) == 2
    err = capsys.readouterr().err
    assert f"trace {path} has no requests" in err and "Traceback" not in err


def test_out_of_vocab_token_names_file_line_and_range(tmp_path, capsys):
    path = tmp_path / "vocab.jsonl"
    path.write_text(
        '{"arrival": 0, "prompt_token_ids": [1, 2], "max_new_tokens": 1}\n'
        '{"arrival": 0, "prompt_token_ids": [3, 99999], "max_new_tokens": 1}\n'
    )
    assert main(["run", "--trace", str(path), "--connector", "none"]) == 2
    err = capsys.readouterr().err
    assert f"{path}:2:" in err and "99999" in err and "0..31999" in err


def test_unknown_connector_lists_aliases(capsys):
    assert main(["run", "--connector", "nope", "--no-baseline"]) == 2
    err = capsys.readouterr().err
    assert "unknown connector 'nope'" in err
    assert "aliases: cpu_offload" in err or "OffloadingConnector" not in err


def _capture_configs(monkeypatch) -> list:
    """Make Engine.run return at once, recording each engine's config."""
    from kvconnector_core.engine.engine import Engine

    seen = []

    def fake_run(self, trace, progress=None):
        seen.append(self.config)
        return RunResult(trace.name, None, "cpu", {}, {}, RunMetrics())

    monkeypatch.setattr(Engine, "run", fake_run)
    return seen


def test_gpu_pool_is_sized_for_the_longest_request(monkeypatch, capsys):
    """chat_large's requests need more than the default 64 blocks: the default grows to fit."""
    seen = _capture_configs(monkeypatch)
    assert main(["run", "--workload", "chat_large", "--connector", "none"]) == 0
    (config,) = seen
    assert config.num_gpu_blocks > 64
    config.kv_cache_config()  # does not raise: one longest request fits
    capsys.readouterr()
    assert (
        main(["run", "--workload", "chat_large", "--connector", "none", "--num-gpu-blocks", "64"])
        == 2
    )
    err = capsys.readouterr().err
    assert f"--num-gpu-blocks {config.min_num_gpu_blocks} or more" in err
    assert main(["run", "--workload", "mixed", "--connector", "none"]) == 0
    assert seen[-1].num_gpu_blocks == 64  # the default stays when it suffices


def test_demo_options_reach_a_connector_in_either_form():
    """``kvconnector run`` hands every connector the same DemoOptions: a connector taking
    them uses what it honours and refuses the rest; one written before DemoOptions gets
    ``num_gpu_blocks`` and the options it names as keywords."""
    from typing import Any

    from kvconnector_core.connector.demo import DemoOptions, demo_extra_config
    from kvconnector_core.errors import ConfigError
    from kvconnector_core.testing import RecordingConnector

    class Typed(RecordingConnector):
        @classmethod
        def demo_extra_config(cls, options: DemoOptions) -> dict[str, Any]:
            options.refuse("cpu_blocks")
            return {"size": options.cpu_blocks or 2 * options.num_gpu_blocks}

    class Legacy(RecordingConnector):
        @classmethod
        def demo_extra_config(cls, num_gpu_blocks: int, *, tiers=()) -> dict[str, Any]:
            return {"size": num_gpu_blocks, "tiers": list(tiers)}

    assert demo_extra_config(Typed, DemoOptions(connector="t", num_gpu_blocks=8)) == {"size": 16}
    assert demo_extra_config(Typed, DemoOptions(connector="t", num_gpu_blocks=8, cpu_blocks=3)) == {
        "size": 3
    }
    with pytest.raises(
        ConfigError,
        match="--tier does not apply to the 't' connector; options valid for it: --cpu-blocks",
    ):
        demo_extra_config(Typed, DemoOptions(connector="t", num_gpu_blocks=8, tiers=("disk:x",)))
    legacy = DemoOptions(connector="l", num_gpu_blocks=8, tiers=("disk:x",))
    assert demo_extra_config(Legacy, legacy) == {"size": 8, "tiers": ["disk:x"]}
    with pytest.raises(
        ConfigError,
        match="--cpu-blocks does not apply to the 'l' connector; options valid for it: --tier",
    ):
        demo_extra_config(Legacy, DemoOptions(connector="l", num_gpu_blocks=8, cpu_blocks=3))
    assert demo_extra_config(RecordingConnector, DemoOptions(connector="r", num_gpu_blocks=8)) == {}
