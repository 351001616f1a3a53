"""What ``kvconnector run`` shows and exports while it runs: :class:`RunWatch`.

- the progress bar, with an ETA, on stderr; log records are written above it, never glued
  onto its line (tqdm's ``logging_redirect_tqdm``);
- before a run estimated to take over :data:`LONG_RUN_S` seconds, a note saying so;
- ``--metrics-port PORT``: the connector run's Prometheus series served on ``/metrics``
  while it runs; ``--metrics FILE``: the exposition text written at the end
  (:class:`~kvconnector_core.metrics.EngineMetrics`; ``docs/metrics.md``).

Primitives: :data:`LONG_RUN_S`, :func:`add_arguments`, :class:`RunWatch`.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from kvconnector_core.errors import ConfigError

if TYPE_CHECKING:
    from kvconnector_core.engine.engine import Engine
    from kvconnector_core.engine.workloads import Trace
    from kvconnector_core.metrics import EngineMetrics

__all__ = ["LONG_RUN_S", "RunWatch", "add_arguments"]

LONG_RUN_S = 60.0
"""A run estimated to take longer is announced before it starts."""

_BAR_FORMAT = ("{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} req "
               "[{elapsed}, ETA {remaining}]")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``--metrics``, ``--metrics-port`` and ``--metrics-host``."""
    parser.add_argument("--metrics", metavar="FILE",
                        help="write the connector run's Prometheus metrics to FILE at the end "
                             "(text exposition format; see docs/metrics.md); turns on KV "
                             "events, which the eviction series count")
    parser.add_argument("--metrics-port", type=int, metavar="PORT",
                        help="serve the connector run's Prometheus metrics on "
                             "http://HOST:PORT/metrics while it runs (as --metrics)")
    parser.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                        help="address --metrics-port binds (default 127.0.0.1; 0.0.0.0 for "
                             "every interface)")


class RunWatch:
    """Progress, announcements and metrics of one ``kvconnector run``.

    Args:
        metrics_file: where to write the exposition text at the end, or None.
        metrics_port: the port to serve ``/metrics`` on during the run, or None.
        metrics_host: the address to serve on.
    """

    def __init__(self, metrics_file: str | None = None, metrics_port: int | None = None,
                 metrics_host: str = "127.0.0.1") -> None:
        if metrics_port is not None and not 0 <= metrics_port <= 65535:
            msg = f"--metrics-port {metrics_port} is out of range; valid: 0 to 65535"
            raise ConfigError(msg)
        self.metrics_file = metrics_file
        self.metrics_port = metrics_port
        self.metrics_host = metrics_host
        self.metrics: EngineMetrics | None = None
        """The watched run's series (the first run; None without a metrics option)."""
        self._engine: Engine | None = None
        self._server: Any = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RunWatch:
        """The watch the ``kvconnector run`` flags ask for."""
        return cls(args.metrics, args.metrics_port, args.metrics_host)

    @property
    def wants_metrics(self) -> bool:
        """Whether ``--metrics`` or ``--metrics-port`` was given."""
        return self.metrics_file is not None or self.metrics_port is not None

    def kv_events(self, asked: bool) -> bool | None:
        """``EngineConfig.enable_kv_cache_events`` of the watched run: on when ``asked``
        (``--kv-events``) or with metrics (the eviction series count ``BlockRemoved``
        events); None otherwise (the engine's default: on only with a publisher)."""
        return True if asked or self.wants_metrics else None

    def announce(self, trace: Trace, device: str, runs: int) -> None:
        """Say on stderr when ``runs`` runs of ``trace`` should take over a minute."""
        from kvconnector_core.engine.workload_sizes import estimate_seconds, size_of

        size = size_of(trace.requests)
        seconds = estimate_seconds(size, device, runs)
        if seconds > LONG_RUN_S:
            print(f"kvconnector run: note: {trace.name!r} has {size.requests:,} requests, "
                  f"{size.prompt_tokens:,} prompt and up to {size.output_tokens:,} output "
                  f"tokens; {runs} run(s) on {device} should take about "
                  f"{seconds / 60:.0f} min (the default workload takes seconds)",
                  file=sys.stderr)

    @contextlib.contextmanager
    def progress(self, engine: Engine, trace: Trace, label: str) -> Iterator[Callable[[int], Any]]:
        """The ``progress`` callback of one :meth:`Engine.run`.

        The first engine given is the watched one: its series are updated after every
        step (and served, with ``--metrics-port``).
        """
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        watched = self._watch(engine)
        with logging_redirect_tqdm(), tqdm(total=len(trace), desc=f"{trace.name} ({label})",
                                           unit="req", file=sys.stderr, leave=False,
                                           bar_format=_BAR_FORMAT) as bar:
            if not watched or self.metrics is None:
                yield bar.update
                return
            metrics = self.metrics

            def step_done(finished: int) -> None:
                bar.update(finished)
                metrics.update(engine)

            try:
                yield step_done
            except BaseException:
                self._stop_server()
                raise

    def _watch(self, engine: Engine) -> bool:
        """Watch ``engine`` if no engine is watched yet; whether it is the watched one."""
        if self._engine is not None:
            return engine is self._engine
        self._engine = engine
        if not self.wants_metrics:
            return True
        from kvconnector_core.metrics import EngineMetrics

        self.metrics = EngineMetrics()
        if self.metrics_port is not None:
            try:
                self._server = self.metrics.serve(self.metrics_port, self.metrics_host)
            except OSError as exc:
                msg = (f"--metrics-port {self.metrics_port}: cannot serve on "
                       f"{self.metrics_host}:{self.metrics_port}: {exc.strerror or exc}")
                raise ConfigError(msg) from exc
        return True

    def finish(self) -> None:
        """After the runs: count what the watched engine did last (its shutdown sent the
        queued event batches), write ``--metrics FILE`` and stop serving.

        Raises:
            ConfigError: the metrics file cannot be written.
        """
        self._stop_server()
        if self.metrics is None or self._engine is None:
            return
        self.metrics.update(self._engine)
        if self.metrics_file is not None:
            try:
                self.metrics.write(self.metrics_file)
            except OSError as exc:
                msg = f"--metrics {self.metrics_file}: {exc.strerror or exc}"
                raise ConfigError(msg) from exc

    def _stop_server(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
