"""The per-test timeout of tests/conftest.py fires, with a clear message, even in a
main thread blocked on a lock, an event or a queue (run in a pytest subprocess)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

CONFTEST = Path(__file__).with_name("conftest.py")

BLOCKERS = {
    "sleep": "time.sleep(60)",
    "event": "threading.Event().wait()",
    "lock": "lock = threading.Lock(); lock.acquire(); lock.acquire()",
    "queue": "queue.Queue().get()",
}


def _run(tmp_path: Path, body: str, *, env_timeout: str | None = "1", marker: str = "",
         grace_s: float | None = None) -> subprocess.CompletedProcess[str]:
    conftest = CONFTEST.read_text()
    if grace_s is not None:
        conftest = conftest.replace("GRACE_S = 30.0", f"GRACE_S = {grace_s}")
    (tmp_path / "conftest.py").write_text(conftest)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not the project's settings
    (tmp_path / "test_blocked.py").write_text(textwrap.dedent(f"""
        import queue, threading, time
        import pytest

        {marker}
        def test_blocked():
            {body}
    """))
    env = {"PATH": "/usr/bin:/bin"}
    if env_timeout is not None:
        env["KVCONNECTOR_TEST_TIMEOUT"] = env_timeout
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )


@pytest.mark.parametrize("blocker", sorted(BLOCKERS))
def test_a_blocked_test_fails_with_the_timeout_message(tmp_path, blocker):
    run = _run(tmp_path, BLOCKERS[blocker])
    assert run.returncode == 1, run.stdout + run.stderr
    assert "Failed: test exceeded 1 s" in run.stdout
    assert "1 failed" in run.stdout


def test_the_marker_overrides_the_environment(tmp_path):
    run = _run(tmp_path, BLOCKERS["event"], env_timeout="600", marker="@pytest.mark.timeout(1)")
    assert "Failed: test exceeded 1 s" in run.stdout, run.stdout + run.stderr


def test_a_swallowed_timeout_ends_the_process_with_every_threads_stack(tmp_path):
    # The test catches the handler's Failed every time: the alarm repeats, then
    # faulthandler dumps the stacks and exits (after a grace shortened to 1 s here).
    body = (
        "while True:\n                try:\n                    time.sleep(60)\n"
        "                except BaseException:\n                    pass"
    )
    run = _run(tmp_path, body, grace_s=1.0)
    assert run.returncode != 0
    assert "Timeout" in run.stderr and "test_blocked.py" in run.stderr, run.stderr


def test_zero_turns_it_off(tmp_path):
    run = _run(tmp_path, "time.sleep(2)", env_timeout="0")
    assert run.returncode == 0, run.stdout + run.stderr


def test_a_bad_setting_names_the_value(tmp_path):
    run = _run(tmp_path, "pass", env_timeout="soon")
    assert run.returncode != 0
    assert "KVCONNECTOR_TEST_TIMEOUT='soon'" in run.stdout + run.stderr
