"""``kvconnector run`` on the console: workloads sized in ``--help``, a note before a long
run, a progress bar with an ETA, and log lines that never share the bar's line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvconnector_core.cli import main
from kvconnector_core.cli.run_watch import RunWatch
from kvconnector_core.engine.workload_sizes import WORKLOAD_SIZES, size_of
from kvconnector_core.engine.workloads import WORKLOADS, get_workload
from kvconnector_core.testing.fault_settings import FaultSettings, HookFault
from kvconnector_core.testing.faults import fault_injection_config


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_workload_sizes_match_the_generated_traces(name):
    """The sizes ``--help`` shows are those of the traces the names build."""
    assert WORKLOAD_SIZES[name] == size_of(get_workload(name).requests)


def test_help_gives_each_workloads_requests_and_tokens(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the help text
    assert "chat_large (1,000 requests, 1,296,000 prompt + 96,000 output tokens)" in out
    assert "mixed (38 requests, 9,632 prompt + 408 output tokens)" in out


def test_a_long_run_is_announced_before_it_starts(capsys):
    """``chat_large`` with a baseline (two runs) is estimated over a minute; the note says
    so and gives the sizes; the default workload gets no note."""
    watch = RunWatch()
    watch.announce(get_workload("chat_large"), "cpu", runs=2)
    err = capsys.readouterr().err
    assert "note: 'chat_large' has 1,000 requests" in err and "should take about" in err
    watch.announce(get_workload("mixed"), "cpu", runs=2)
    assert capsys.readouterr().err == ""


def test_huge_max_new_tokens_is_announced(capsys):
    """A trace asking for 100,000 new tokens is announced (it runs for many minutes)."""
    trace = get_workload("private")
    trace.requests[0].max_new_tokens = 100_000
    RunWatch().announce(trace, "cpu", runs=1)
    assert "should take about" in capsys.readouterr().err


def test_log_lines_never_share_the_progress_bars_line(tmp_path):
    """A connector whose hook raises logs errors during the run; each log line starts on a
    line of its own (the bar is cleared first), and the bar shows an ETA."""
    faults = FaultSettings(raise_in=(HookFault(hook="get_kv_connector_stats", at_step=3),))
    config = fault_injection_config({"name": "cpu_offload",
                                     "extra_config": {"num_cpu_blocks": 256}}, faults)
    path = tmp_path / "faulty.json"
    path.write_text(json.dumps(config.to_dict()))
    proc = subprocess.run(
        [sys.executable, "-c",
         "import sys; from kvconnector_core.cli import main; sys.exit(main())",
         "run", "--workload", "private", "--config", str(path), "--no-baseline"],
        capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr
    logged = [line for line in proc.stderr.split("\n")
              if "raised in get_kv_connector_stats" in line]
    assert logged, proc.stderr
    for line in logged:
        assert line.rsplit("\r", 1)[-1].startswith("connector "), repr(line)
    assert "ETA" in proc.stderr


def test_readme_gives_each_workloads_size():
    """The README's workload table states the sizes the named workloads have."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    for name, size in WORKLOAD_SIZES.items():
        row = f"| `{name}`"
        line = next(line for line in readme.splitlines() if line.startswith(row))
        cells = [c.strip().replace(",", "") for c in line.split("|")[2:5]]
        assert cells == [str(size.requests), str(size.prompt_tokens), str(size.output_tokens)]
