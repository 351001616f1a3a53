"""A normal ``kvconnector run`` writes no traceback and no warning to stderr.

Run in a fresh interpreter, so that everything the process writes is seen (logging's
last-resort handler, ``warnings``, tracebacks): e.g. an AttributeError traceback on every
``cpu_offload`` run if the engine asked the scheduler-side connector for stats that only
the worker side keeps.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

MULTI = {"name": "MultiConnector", "extra_config": {"connectors": [
    {"name": "ttl"}, {"name": "cpu_offload", "extra_config": {"num_cpu_blocks": 64}}]}}


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from kvconnector_core.cli import main; sys.exit(main())",
            "run",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def _assert_clean(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stderr
    for needle in ("Traceback", "Warning", "WARNING", "Error", "ERROR"):
        assert needle not in proc.stderr, proc.stderr


@pytest.mark.parametrize("connector", ["none", "cpu_offload", "multi"])
def test_run_writes_no_traceback_and_no_warning(tmp_path, connector):
    args = ["--connector", connector]
    if connector == "multi":
        path = tmp_path / "multi.json"
        path.write_text(json.dumps(MULTI))
        args = ["--config", str(path)]
    proc = _run_cli("--workload", "private", *args)
    _assert_clean(proc)
    assert "identical" in proc.stdout or connector == "none"


def test_runs_with_a_disk_tier_behind_a_tiny_cpu_tier_write_nothing_to_stderr(tmp_path):
    """With ``--tier`` and a CPU tier of a few chunks, promoting chunks whose CPU store is
    still in flight must not raise in admission (a contained traceback). Two runs share
    the tier: the second one loads the first one's files."""
    tier = f"disk:{tmp_path / 'kv'}"
    for cpu_blocks in ("6", "32"):
        proc = _run_cli("--workload", "documents", "--tier", tier, "--cpu-blocks", cpu_blocks)
        _assert_clean(proc)
        assert "outputs identical to baseline: yes" in proc.stdout
