"""Timers of ``bench_connector_cost.py``: per-label thread CPU time with the timers' own
cost calibrated, and the mover threads' CPU time.

Primitives: :class:`_Clock`, :func:`_mover_thread_ns`.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

__all__ = ["_Clock", "_mover_thread_ns"]

_now = time.thread_time_ns


class _Clock:
    """Accumulates the thread's CPU nanoseconds per label, and calls per label.

    ``inner`` (what a timed call adds to its own label) and ``outer`` (what it adds to
    an enclosing timed call) are the timers' own costs, calibrated on a no-op; labels
    listed in ``nested`` are timed inside calls of ``outer_label``.
    """

    inner = 0.0
    outer = 0.0

    def __init__(self) -> None:
        self.ns: dict[str, int] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, obj: Any, name: str, label: str) -> None:
        fn = getattr(obj, name, None)
        if not callable(fn):
            return
        ns, calls = self.ns, self.calls

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = _now()
            try:
                return fn(*args, **kwargs)
            finally:
                ns[label] = ns.get(label, 0) + _now() - t0
                calls[label] = calls.get(label, 0) + 1

        setattr(obj, name, timed)

    def corrected_us(self, label: str, nested: tuple[str, ...] = ()) -> float:
        """Microseconds of ``label`` less the timers' cost (its own and its nested calls')."""
        ns = self.ns.get(label, 0) - self.calls.get(label, 0) * self.inner
        ns -= sum(self.calls.get(n, 0) for n in nested) * self.outer
        return max(ns, 0.0) / 1e3

    @classmethod
    def calibrate(cls, n: int = 20000) -> None:
        """Measure the timers' cost on a no-op (median of 5)."""
        class _Noop:
            def f(self) -> None:
                pass

        inner, outer = [], []
        for _ in range(5):
            raw, clock = _Noop(), cls()
            clock.wrap(raw, "f", "x")
            t0 = _now()
            for _ in range(n):
                raw.f()
            wrapped = _now() - t0
            plain = _Noop().f
            t0 = _now()
            for _ in range(n):
                plain()
            inner.append(clock.ns["x"] / n)
            outer.append((wrapped - (_now() - t0)) / n)
        cls.inner, cls.outer = statistics.median(inner), statistics.median(outer)


def _mover_thread_ns() -> int:
    """CPU nanoseconds of the live mover issue threads (named ``kv-transfer-issue-*``)."""
    total = 0
    for thread in threading.enumerate():
        if thread.name.startswith("kv-transfer-issue-") and thread.ident is not None:
            try:
                total += time.clock_gettime_ns(time.pthread_getcpuclockid(thread.ident))
            except OSError:  # ended meanwhile
                pass
    return total
