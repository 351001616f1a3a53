"""A per-test timeout for every test under ``tests/`` (the vLLM suite included).

pytest has no per-test timeout of its own and the project takes no dependency for
one, so a test that blocks forever (a guard that never releases a wait, a worker
that never reports) would hang the whole run instead of failing. Here each test
arms ``SIGALRM`` in the main thread: when it fires, the handler raises
``Failed: test exceeded N s`` wherever the main thread is, including inside a
blocking ``threading.Event.wait()``, ``Lock.acquire()`` or ``queue.get()``
(POSIX lock waits are interrupted by signals and run the handler). If the
``Failed`` is swallowed, the alarm repeats every few seconds; if the main thread is
stuck where Python never gets to run a handler (inside C code), ``faulthandler``
dumps every thread's stack and ends the process ``GRACE_S`` later, as a last resort.

The limit is :data:`DEFAULT_TIMEOUT_S` seconds; ``KVCONNECTOR_TEST_TIMEOUT=<seconds>``
changes it for a run (``0`` turns it off, e.g. under a debugger), and
``@pytest.mark.timeout(seconds)`` changes it for one test.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType

import pytest

DEFAULT_TIMEOUT_S = 600.0
"""Per-test limit. Generous on purpose: the slowest test takes ~40 s on an idle 2-core
machine and was seen past 120 s on one loaded ~7x (a false failure is worse than a slow
one); a hang still fails within minutes instead of running into CI's limit."""

ENV_VAR = "KVCONNECTOR_TEST_TIMEOUT"
GRACE_S = 30.0
"""After the alarm, how long the interrupted test may take to unwind before faulthandler
dumps every thread and exits."""
REPEAT_S = 5.0
"""The alarm repeats this often while a raised ``Failed`` is swallowed."""


_dump_fd: list[int] = []
"""A copy of the terminal's stderr, taken before any test runs: pytest captures fd 2
during a test, and a dump written there would be lost when faulthandler exits."""


def pytest_configure(config: pytest.Config) -> None:
    if sys.__stderr__ is not None:
        _dump_fd.append(os.dup(sys.__stderr__.fileno()))
    config.addinivalue_line(
        "markers", f"timeout(seconds): this test's time limit (default {DEFAULT_TIMEOUT_S:g} s, "
                   f"or ${ENV_VAR}; 0 turns it off)")


def pytest_unconfigure(config: pytest.Config) -> None:
    while _dump_fd:
        os.close(_dump_fd.pop())


def _limit(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None:
        return float(marker.args[0])
    raw = os.environ.get(ENV_VAR)
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        return float(raw)
    except ValueError:
        msg = f"{ENV_VAR}={raw!r} is not a number of seconds (use e.g. 300, or 0 for no limit)"
        raise pytest.UsageError(msg) from None


@pytest.fixture(autouse=True)
def _per_test_timeout(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail the test once it has run :func:`_limit` seconds (see the module)."""
    seconds = _limit(request.node)
    # Signals reach the main thread only; an alarm cannot be armed elsewhere.
    usable = hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread()
    if seconds <= 0 or not usable:
        yield
        return

    def on_alarm(signum: int, frame: FrameType | None) -> None:
        pytest.fail(f"test exceeded {seconds:g} s (the per-test timeout in tests/conftest.py; "
                    f"set {ENV_VAR} or @pytest.mark.timeout to change it)")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds, REPEAT_S)
    if _dump_fd:
        faulthandler.dump_traceback_later(seconds + GRACE_S, exit=True, file=_dump_fd[0])
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, previous)
