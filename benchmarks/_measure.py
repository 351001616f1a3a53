"""Timing and recording of the benchmark drivers (re-exported by ``_drivers``)."""

from __future__ import annotations

import datetime as _dt
import gc
import os
import platform
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

__all__ = ["emit_table", "machine_info", "record_section", "stopwatch"]


class _Stopwatch:
    __slots__ = ("ns",)

    def __init__(self) -> None:
        self.ns = 0


@contextmanager
def stopwatch() -> Iterator[_Stopwatch]:
    """Time the ``with`` body in CPU time of this thread (``thread_time_ns``), the garbage
    collector disabled.

    CPU time, not wall time: on a machine shared with other jobs, wall time mostly
    measures the neighbours (the same block-pool row read 0.69x-2.42x between paired
    repeats in one run); every timed body is single-threaded on both sides. A full
    collection runs first, outside the timed region, so neither side pays for garbage
    the other (or the setup) left behind.

    Yields:
        An object whose ``ns`` attribute holds the elapsed nanoseconds after the block.
    """
    sw = _Stopwatch()
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    t0 = time.thread_time_ns()
    try:
        yield sw
    finally:
        sw.ns = time.thread_time_ns() - t0
        if was_enabled:
            gc.enable()


def machine_info() -> dict[str, str]:
    """CPU model, cores, Python, torch, vLLM and msgspec versions of this run."""
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        cpu = platform.processor() or "unknown"
    from importlib.metadata import PackageNotFoundError, version

    def ver(pkg: str) -> str:
        try:
            return version(pkg)
        except PackageNotFoundError:
            return "not installed"

    return {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu": cpu, "cores": str(os.cpu_count()),
        "python": platform.python_version(), "torch": ver("torch"), "vllm": ver("vllm"),
        "msgspec": ver("msgspec"), "platform": platform.platform(),
    }


def record_section(path: Path, section: str, text: str) -> None:
    """Append ``text`` at the end of ``section`` in the markdown file ``path``.

    The section (a ``## `` heading) is created at the end of the file if absent; other
    sections are left untouched.
    """
    content = path.read_text() if path.exists() else "# Benchmark results\n"
    lines = content.splitlines(keepends=True)
    try:
        start = next(i for i, line in enumerate(lines) if line.rstrip() == section)
    except StopIteration:
        if not content.endswith("\n"):
            content += "\n"
        path.write_text(content + "\n" + section + "\n\n" + text)
        return
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    block = text if text.endswith("\n") else text + "\n"
    before = "".join(lines[:end]).rstrip("\n") + "\n\n"
    after = "".join(lines[end:])
    path.write_text(before + block + ("\n" + after if after else ""))


def emit_table(lines: Sequence[str], record: Path | None, section: str) -> int:
    """Print a Markdown table (one line per entry) and append it to ``record``'s section.

    Returns:
        0, the exit code of a benchmark's ``main``.
    """
    table = "\n".join(lines) + "\n"
    print(table)
    if record is not None:
        record_section(record, section, table)
    return 0
