"""How big the named workloads are, and how long a run of a trace should take.

``kvconnector run --help`` and the README list each workload's requests and tokens from
:data:`WORKLOAD_SIZES` (a test keeps it equal to the generated traces, so ``--help`` needs
not build the 1,000-request ``chat_large``); ``kvconnector run`` says so before a run
that :func:`estimate_seconds` puts above a minute.

Primitives: :class:`WorkloadSize`, :data:`WORKLOAD_SIZES`, :func:`size_of`,
:func:`estimate_seconds`, :func:`describe_workloads`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from kvconnector_core.engine._trace import TraceRequest

__all__ = ["WORKLOAD_SIZES", "WorkloadSize", "describe_workloads", "estimate_seconds",
           "size_of"]


class WorkloadSize(NamedTuple):
    """A trace's size.

    Attributes:
        requests: requests in the trace.
        prompt_tokens: their prompt tokens.
        output_tokens: their ``max_new_tokens``, summed.
    """

    requests: int
    prompt_tokens: int
    output_tokens: int


WORKLOAD_SIZES: dict[str, WorkloadSize] = {
    "chat": WorkloadSize(32, 11_520, 512),
    "chat_large": WorkloadSize(1_000, 1_296_000, 96_000),
    "documents": WorkloadSize(24, 9_792, 384),
    "mixed": WorkloadSize(38, 9_632, 408),
    "private": WorkloadSize(18, 5_184, 288),
}
"""Sizes of the named workloads with seed 0 (other seeds give the same counts)."""

# Seconds per prompt token and per output token of the tiny model with a connector, measured
# with `kvconnector run` on a busy 2-core CPU (mixed: 3.7 s; chat: 4.8 s), rounded up. A
# generated token costs more: it is one token of a step whose batch holds a few requests.
_SECONDS_PER_TOKEN = {"cpu": (0.0003, 0.002), "cuda": (0.0001, 0.001)}


def size_of(requests: Iterable[TraceRequest]) -> WorkloadSize:
    """The size of a trace (or any list of its requests)."""
    items = list(requests)
    return WorkloadSize(len(items), sum(len(r.prompt_token_ids) for r in items),
                        sum(r.max_new_tokens for r in items))


def estimate_seconds(size: WorkloadSize, device: str, runs: int = 1) -> float:
    """A rough wall time of ``runs`` runs of a trace of ``size`` on ``device``.

    Args:
        size: the trace's size.
        device: ``"cpu"`` or ``"cuda"`` (others are taken as CPU).
        runs: runs of the trace (2 with the baseline).

    Returns:
        Seconds; within a factor of two on an idle machine, more on a busy one.
    """
    per_prompt, per_output = _SECONDS_PER_TOKEN.get(device, _SECONDS_PER_TOKEN["cpu"])
    return runs * (size.prompt_tokens * per_prompt + size.output_tokens * per_output)


def describe_workloads() -> str:
    """``name (N requests, P prompt + O output tokens)`` for each named workload."""
    return "; ".join(f"{name} ({s.requests:,} requests, {s.prompt_tokens:,} prompt + "
                     f"{s.output_tokens:,} output tokens)"
                     for name, s in sorted(WORKLOAD_SIZES.items()))
