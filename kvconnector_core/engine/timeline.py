"""Per-step time series of a run: where prompt tokens came from and bytes moved per tier.

:class:`Timeline` is fed once per engine step; :attr:`RunResult.timeline
<kvconnector_core.engine.engine.RunResult>` holds its :class:`StepRecord` list, the JSON
report carries it, and ``kvconnector run --plot FILE.png`` draws it
(:func:`plot_timeline`, needs the optional ``plot`` extra: matplotlib).

Primitives: :class:`StepRecord`, :class:`Timeline`, :func:`plot_timeline`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from kvconnector_core.engine.engine import RunResult
    from kvconnector_core.scheduler.stats import SchedulerStats

__all__ = ["StepRecord", "Timeline", "plot_timeline"]

_DIRECTIONS = {"bytes_loaded": "loaded", "bytes_stored": "stored"}


class StepRecord(msgspec.Struct):
    """One engine step.

    Attributes:
        step: the engine step (as counted by the engine, 1-based).
        computed_tokens: prompt tokens the model computed for the first time in this step.
        gpu_hit_tokens: prompt tokens first served from the GPU prefix cache in this step.
        connector_hit_tokens: prompt tokens first served by the connector in this step.
        hit_rate: ``(gpu + connector) / (gpu + connector + computed)`` of this step, or
            None when the step placed no new prompt token.
        bytes_moved: ``"<tier>.loaded"`` / ``"<tier>.stored"`` -> bytes in this step; the
            tier is the connector, or each MultiConnector child.
    """

    step: int
    computed_tokens: int
    gpu_hit_tokens: int
    connector_hit_tokens: int
    hit_rate: float | None
    bytes_moved: dict[str, float] = msgspec.field(default_factory=dict)


def _bytes_per_tier(stats: Mapping[str, float], connector: str) -> dict[str, float]:
    """Per tier and direction, from one step's flattened connector stats."""
    has_children = any(k.startswith("children.") for k in stats)
    out: dict[str, float] = {}
    for key, value in stats.items():
        for suffix, direction in _DIRECTIONS.items():
            if not key.endswith(suffix) or not value:
                continue
            prefix = key[: -len(suffix)].rstrip(".")
            if has_children and not prefix.startswith("children."):
                continue  # the wrapper's sum of its children's numbers
            tier = prefix.removeprefix("children.") or connector
            out[f"{tier}.{direction}"] = out.get(f"{tier}.{direction}", 0) + value
    return out


class Timeline:
    """Collects one :class:`StepRecord` per engine step.

    Args:
        connector: the name used for the tier of a connector without children.
    """

    def __init__(self, connector: str) -> None:
        self.connector = connector
        self.records: list[StepRecord] = []
        self._seen = (0, 0, 0)

    def record(self, step: int, stats: SchedulerStats,
               step_connector_stats: Mapping[str, float]) -> None:
        """Append the step: token counters are the deltas of the scheduler's cumulative stats."""
        now = (stats.num_prefill_tokens_computed, stats.num_gpu_cache_hit_tokens,
               stats.num_connector_hit_tokens)
        computed, gpu, conn = (a - b for a, b in zip(now, self._seen, strict=True))
        self._seen = now
        placed = computed + gpu + conn
        self.records.append(StepRecord(
            step=step, computed_tokens=computed, gpu_hit_tokens=gpu, connector_hit_tokens=conn,
            hit_rate=(gpu + conn) / placed if placed else None,
            bytes_moved=_bytes_per_tier(step_connector_stats, self.connector)))


def plot_timeline(result: RunResult, path: str) -> None:
    """Draw per-step hit rate and bytes moved per tier to ``path`` (PNG).

    Raises:
        ImportError: matplotlib is not installed (the message gives the install command).
    """
    try:
        import matplotlib  # type: ignore[import-not-found,unused-ignore]  # the optional "plot" extra

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt  # type: ignore[import-not-found,unused-ignore]  # optional extra
    except ImportError:
        msg = ("--plot needs matplotlib, an optional dependency: pip install 'kvconnector[plot]' "
               "(or pip install matplotlib)")
        raise ImportError(msg) from None
    records = result.timeline
    steps = [r.step for r in records]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(9, 6))
    top.plot(steps, [r.hit_rate if r.hit_rate is not None else float("nan") for r in records],
             marker=".", linestyle="none")
    top.set_ylabel("prompt hit rate per step")
    top.set_ylim(-0.05, 1.05)
    top.set_title(f"{result.workload}: connector {result.connector or 'none'}")
    series = sorted({k for r in records for k in r.bytes_moved})
    for key in series:
        bottom.plot(steps, [r.bytes_moved.get(key, 0) / 2**20 for r in records], label=key)
    bottom.set_ylabel("MiB moved per step")
    bottom.set_xlabel("engine step")
    if series:
        bottom.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
