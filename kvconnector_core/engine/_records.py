"""The records of a run (imported from ``engine``) and the folding of connector stats into them."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import msgspec

from kvconnector_core.engine.timeline import StepRecord

__all__ = ["RequestOutput", "RunMetrics", "RunResult"]


class RequestOutput(msgspec.Struct):
    """A finished request.

    Attributes:
        request_id: the request.
        output_token_ids: the generated tokens.
        status: final status name (``FINISHED_LENGTH_CAPPED``, ``FINISHED_ERROR``, ...).
        num_prompt_tokens: prompt length.
        kv_transfer_params: what the connector's ``request_finished`` returned, if anything.
    """

    request_id: str
    output_token_ids: list[int]
    status: str
    num_prompt_tokens: int
    kv_transfer_params: dict[str, Any] | None = None


class RunMetrics(msgspec.Struct):
    """What a run did. Token counts are prompt tokens unless named otherwise.

    Attributes:
        num_requests: requests in the trace.
        num_finished: requests finished normally (length-capped or stopped).
        num_failed: requests finished with an error (or aborted).
        num_prompt_tokens: prompt tokens of the requests the scheduler admitted (the
            trace's, less any rejected request's); the denominator of every rate.
        num_output_tokens: tokens generated.
        prefill_tokens_computed: prompt tokens the model computed the first time they were
            needed.
        gpu_prefix_hit_tokens: prompt tokens first served from the GPU prefix cache.
        connector_hit_tokens: prompt tokens first loaded by the connector.
        recomputed_tokens: prompt tokens computed or loaded again after a preemption or a
            failed load (not in the three counters above, which add up to
            ``num_prompt_tokens`` once every request finished).
        gpu_hit_rate: ``gpu_prefix_hit_tokens / num_prompt_tokens``.
        connector_hit_rate: ``connector_hit_tokens / num_prompt_tokens``.
        total_hit_rate: the sum of both rates (at most 1).
        num_preemptions: requests preempted (recomputed later).
        num_failed_loads_recovered: requests rolled back after a failed load.
        bytes_loaded: bytes the connector loaded into the GPU pool.
        bytes_stored: bytes the connector stored out of it.
        load_seconds: time the connector reports for loads.
        store_seconds: time the connector reports for stores.
        load_gbps: ``bytes_loaded / load_seconds / 1e9`` (0 without time); for a
            MultiConnector, over the children that report ``load_seconds`` only.
        store_gbps: ``bytes_stored / store_seconds / 1e9``, likewise.
        connector_stats: every other connector stats number, summed over steps; nested
            dicts give dotted keys (a MultiConnector's ``children.<child>.<key>``).
        connector_errors: per hook name, how many times the connector raised (contained);
            a MultiConnector's children as ``<child>.<hook>``.
        events: KV events emitted, by ``<Type>`` and ``<Type>[<medium>]``.
        steps: engine steps executed.
        wall_seconds: wall time of the run.
    """

    num_requests: int = 0
    num_finished: int = 0
    num_failed: int = 0
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    prefill_tokens_computed: int = 0
    gpu_prefix_hit_tokens: int = 0
    connector_hit_tokens: int = 0
    recomputed_tokens: int = 0
    gpu_hit_rate: float = 0.0
    connector_hit_rate: float = 0.0
    total_hit_rate: float = 0.0
    num_preemptions: int = 0
    num_failed_loads_recovered: int = 0
    bytes_loaded: int = 0
    bytes_stored: int = 0
    load_seconds: float = 0.0
    store_seconds: float = 0.0
    load_gbps: float = 0.0
    store_gbps: float = 0.0
    connector_stats: dict[str, float] = msgspec.field(default_factory=dict)
    connector_errors: dict[str, int] = msgspec.field(default_factory=dict)
    events: dict[str, int] = msgspec.field(default_factory=dict)
    steps: int = 0
    wall_seconds: float = 0.0


class RunResult(msgspec.Struct):
    """Outputs and metrics of one :meth:`Engine.run`.

    Attributes:
        workload: the trace's name.
        connector: the connector's name, or None.
        device: where the model ran.
        outputs: request id -> generated tokens, in trace order.
        statuses: request id -> final status name.
        metrics: the run's metrics.
        model: the model's KV shape (:meth:`ModelConfig.describe`).
        timeline: one record per step: token sources and bytes moved per tier.
    """

    workload: str
    connector: str | None
    device: str
    outputs: dict[str, list[int]]
    statuses: dict[str, str]
    metrics: RunMetrics
    model: str = ""
    timeline: list[StepRecord] = msgspec.field(default_factory=list)



def _numeric_leaves(stats: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    """Every number in ``stats`` with its dotted path (nested dicts, e.g. a MultiConnector's
    ``children``, are walked so per-child numbers are reported too)."""
    for key, value in stats.items():
        if isinstance(value, Mapping):
            yield from _numeric_leaves(value, f"{prefix}{key}.")
        elif isinstance(value, int | float) and not isinstance(value, bool):
            yield f"{prefix}{key}", value


def _fold_stats(into: dict[str, float], stats: dict[str, float]) -> None:
    """Add one step's flattened connector stats (see :func:`_numeric_leaves`): counters are
    deltas (summed); levels under a ``gauges`` key keep their latest value."""
    for key, value in stats.items():
        if "gauges" in key.split("."):
            into[key] = value
        else:
            into[key] = into.get(key, 0) + value


def _gbps(num_bytes: float, seconds: float) -> float:
    return num_bytes / seconds / 1e9 if seconds > 0 else 0.0


def _timed_gbps(direction: str, std: dict[str, Any], stats: dict[str, Any]) -> float:
    """GB/s of ``direction`` (``"load"`` or ``"store"``): the standard keys' bytes over
    their seconds, or, for a wrapper with per-child stats (``...children.<child>.``), the
    bytes of the children that report seconds over those seconds: a MultiConnector sums
    every child's bytes but only the timed children's seconds, so the plain quotient
    would count an untimed child's bytes as moved in no time."""
    bytes_key = "bytes_loaded" if direction == "load" else "bytes_stored"
    seconds_key = f"{direction}_seconds"
    prefixes = [k[:-len(bytes_key)] for k in stats
                if k.endswith("." + bytes_key) and ".children." in "." + k]
    leaves = [p for p in prefixes
              if not any(q != p and q.startswith(p + "children.") for q in prefixes)]
    if not leaves:
        return _gbps(std[bytes_key], std[seconds_key])
    timed = [p for p in leaves if stats.get(p + seconds_key, 0) > 0]
    return _gbps(sum(stats[p + bytes_key] for p in timed),
                 sum(stats[p + seconds_key] for p in timed))
