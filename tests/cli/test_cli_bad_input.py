"""Bad input to the command line: a clear message naming the option, exit code 2, no traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvconnector_core.cli import main
from kvconnector_core.engine.engine import RunMetrics, RunResult
from kvconnector_core.engine.workloads import WORKLOADS

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)  # run_cmd sets one thread on CPU


@pytest.fixture
def no_engine_runs(monkeypatch):
    """Make Engine.run return at once (these tests are about argument handling)."""
    from kvconnector_core.engine.engine import Engine

    monkeypatch.setattr(Engine, "run", lambda self, trace, progress=None:
                        RunResult(trace.name, None, "cpu", {}, {}, RunMetrics()))


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    code = main(["run", *argv])
    return code, capsys.readouterr().err


def test_no_numpy_warning_on_any_command(tmp_path):
    """torch's 'Failed to initialize NumPy' warning is not printed by `kvconnector` commands."""
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        json.dumps({"arrival": 0, "prompt_token_ids": [1, 2, 3], "max_new_tokens": 2}) + "\n"
    )
    code = "import sys; from kvconnector_core.cli import main; sys.exit(main(sys.argv[1:]))"
    for argv in (["list"], ["run", "--trace", str(trace), "--connector", "none"]):
        proc = subprocess.run(
            [sys.executable, "-c", code, *argv],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
        assert "NumPy" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr


def test_readme_says_make_run_uses_cpu_offload():
    """The README's quick start says which connector `make run` uses."""
    readme = (ROOT / "README.md").read_text()
    quick_start = readme[readme.index("make run") : readme.index("make test")]
    assert "cpu_offload" in quick_start


def test_help_lists_workloads_and_trace_format(capsys):
    """`run --help` lists every workload and the trace fields with units and ranges."""
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for name in WORKLOADS:
        assert name in out
    assert "arrival (engine steps)" in out and "[0, vocab)" in out


def test_trace_format_docs_give_arrival_unit_and_token_range():
    """The README's trace format names the unit of `arrival` and the token-id range."""
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "`arrival` (the engine step at which the request is added" in readme
    assert "`[0, 32000)`" in readme


def test_num_gpu_blocks_error_gives_the_true_reason(tmp_path, capsys, no_engine_runs):
    """A 68-token trace needs room for 68 + 16 tokens, not 512: the message says so."""
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        json.dumps({"arrival": 0, "prompt_token_ids": list(range(60)), "max_new_tokens": 8}) + "\n"
    )
    code, err = run_cli(
        capsys, "--trace", str(trace), "--connector", "none", "--num-gpu-blocks", "3"
    )
    assert code == 2
    assert "has 68 tokens" in err and "84 tokens" in err and "--num-gpu-blocks 7 or more" in err
    assert "512" not in err
    assert (
        run_cli(capsys, "--trace", str(trace), "--connector", "none", "--num-gpu-blocks", "7")[0]
        == 0
    )


def test_unknown_connector_same_message_in_cli_and_multiconnector_child(tmp_path, capsys):
    """The CLI and a MultiConnector child give the registry's message, with the nearest name."""
    code, cli_err = run_cli(capsys, "--connector", "cpu_ofload", "--no-baseline")
    assert code == 2
    config = tmp_path / "multi.json"
    config.write_text(
        json.dumps(
            {"name": "MultiConnector", "extra_config": {"connectors": [{"name": "cpu_ofload"}]}}
        )
    )
    code, multi_err = run_cli(capsys, "--config", str(config), "--no-baseline")
    assert code == 2
    core = "unknown connector 'cpu_ofload' (did you mean 'cpu_offload'?); available connectors:"
    assert core in cli_err and core in multi_err
    assert "--connector:" in cli_err
    assert "MultiConnector extra_config['connectors'][0]:" in multi_err


@pytest.mark.parametrize(
    ("kind", "needle"),
    [
        ("missing", "--trace {path}: no such file"),
        ("directory", "--trace {path} is not a file"),
    ],
)
def test_bad_trace_path_names_the_option(tmp_path, capsys, kind, needle):
    """A missing --trace file or a directory: a message naming --trace, exit 2, no traceback."""
    path = tmp_path / "nope.jsonl" if kind == "missing" else tmp_path
    code, err = run_cli(capsys, "--trace", str(path), "--connector", "none")
    assert code == 2
    assert needle.format(path=path) in err
    assert "Traceback" not in err


def test_empty_workload_is_an_error(capsys):
    """`--workload ''` no longer runs the default workload silently."""
    code, err = run_cli(capsys, "--workload", "", "--connector", "none")
    assert code == 2
    assert "--workload needs a name; valid workloads:" in err


def test_unknown_workload_suggests_nearest(capsys):
    code, err = run_cli(capsys, "--workload", "chatt", "--connector", "none")
    assert code == 2
    assert "did you mean 'chat'?" in err


@pytest.mark.parametrize("blocks", ["0", "-5", str(2**40)])
def test_out_of_range_pool_size_is_a_bound_error(capsys, blocks):
    """Huge (or non-positive) --num-gpu-blocks: a bound error, not an allocator traceback."""
    code, err = run_cli(capsys, "--num-gpu-blocks", blocks, "--connector", "none")
    assert code == 2
    assert f"--num-gpu-blocks {blocks} is out of range; valid: 1 to 16777216" in err


def test_unallocatable_pool_is_a_config_error():
    """A pool the allocator refuses is a ConfigError that gives the size, not a torch traceback."""
    from kvconnector_core.errors import ConfigError
    from kvconnector_core.testing import make_kv_cache_config
    from kvconnector_core.worker.kv_cache import allocate_kv_caches

    config = make_kv_cache_config(num_blocks=2**50)
    with pytest.raises(
        ConfigError, match=r"cannot allocate the KV cache of group 0 on cpu: .* GiB"
    ):
        allocate_kv_caches(config)


def test_duplicate_multiconnector_children_are_rejected(tmp_path, capsys):
    """Two identical children would store everything twice: a config error naming both."""
    child = {"name": "cpu_offload", "extra_config": {"num_cpu_blocks": 64}}
    config = tmp_path / "multi.json"
    config.write_text(
        json.dumps({"name": "MultiConnector", "extra_config": {"connectors": [child, dict(child)]}})
    )
    code, err = run_cli(capsys, "--config", str(config), "--no-baseline")
    assert code == 2
    assert (
        "extra_config['connectors'][1] repeats child 0 ('cpu_offload' with the same settings)"
        in err
    )


def test_huge_max_new_tokens_is_a_bound_error(tmp_path, capsys):
    """A trace request longer than the engine supports: a bound error naming the request size."""
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        json.dumps({"arrival": 0, "prompt_token_ids": [1, 2], "max_new_tokens": 10**9}) + "\n"
    )
    code, err = run_cli(capsys, "--trace", str(trace), "--connector", "none")
    assert code == 2
    assert (
        "has 1000000002 tokens (prompt + max_new_tokens); the engine supports at most 1048560"
        in err
    )


@pytest.mark.parametrize("blocks", ["0", "-3", str(2**40)])
def test_out_of_range_cpu_blocks_is_a_bound_error(capsys, blocks):
    """--cpu-blocks 0 (falsy, so easily taken for the default size) and a huge value (which
    would reach the allocator) are both a bound error naming the option."""
    code, err = run_cli(capsys, "--cpu-blocks", blocks, "--no-baseline")
    assert code == 2
    assert f"--cpu-blocks {blocks} is out of range; valid: 1 to 67108864" in err
    assert "Traceback" not in err and "allocate" not in err


def test_cpu_blocks_with_another_connector_is_refused(capsys):
    """--cpu-blocks belongs to cpu_offload (the check now tests for None, not for a true value)."""
    code, err = run_cli(capsys, "--cpu-blocks", "1", "--connector", "none")
    assert code == 2
    assert "--tier and --cpu-blocks need the cpu_offload connector, not 'none'" in err


@pytest.mark.parametrize("name", ["ttl", "disk"])
def test_an_option_the_connector_cannot_honour_is_refused_by_the_connector(capsys, name):
    """The CLI passes the same DemoOptions to every connector; one without a CPU tier or
    secondary tiers refuses them, naming the option, the connector and what is valid
    (ttl: the base class's demo_extra_config; disk: its own)."""
    code, err = run_cli(capsys, "--cpu-blocks", "4", "--tier", "disk:/tmp/x", "--connector", name)
    assert code == 2
    assert (
        f"--cpu-blocks and --tier do not apply to the {name!r} connector; options valid "
        "for it: none"
    ) in err
    assert "Traceback" not in err
