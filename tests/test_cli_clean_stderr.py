"""A normal ``kvconnector run`` writes no traceback and no warning to stderr (issue 9, item 8).

Run in a fresh interpreter, so that everything the process writes is seen (logging's
last-resort handler, ``warnings``, tracebacks). Regression: every ``cpu_offload`` run used
to print an AttributeError traceback, because the engine asked the scheduler-side
connector for stats that only the worker side kept.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

MULTI = {"name": "MultiConnector", "extra_config": {"connectors": [
    {"name": "ttl"}, {"name": "cpu_offload", "extra_config": {"num_cpu_blocks": 64}}]}}


@pytest.mark.parametrize("connector", ["none", "cpu_offload", "multi"])
def test_run_writes_no_traceback_and_no_warning(tmp_path, connector):
    args = ["--connector", connector]
    if connector == "multi":
        path = tmp_path / "multi.json"
        path.write_text(json.dumps(MULTI))
        args = ["--config", str(path)]
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from kvconnector_core.cli import main; sys.exit(main())",
         "run", "--workload", "private", *args],
        capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "identical" in proc.stdout or connector == "none"
    for needle in ("Traceback", "Warning", "WARNING", "Error", "ERROR"):
        assert needle not in proc.stderr, proc.stderr
