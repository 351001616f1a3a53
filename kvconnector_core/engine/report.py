"""Human and JSON reports of a :class:`~kvconnector_core.engine.engine.RunResult`, and the
comparison of its outputs with a baseline run (same trace, no connector).

Primitives: :class:`OutputComparison`, :func:`compare_outputs`, :func:`format_report`,
:func:`report_dict`.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvconnector_core.engine.engine import RunResult

__all__ = ["OutputComparison", "compare_outputs", "format_report", "report_dict"]


class OutputComparison(msgspec.Struct):
    """Whether a run generated exactly the baseline's tokens.

    Attributes:
        identical: every request's tokens match (and the same requests ran).
        num_requests: requests compared.
        num_differing: requests whose tokens differ (or that only one run has).
        first_differing_request: id of the first differing request in trace order.
        first_differing_token: index of the first differing token in that request
            (``None`` when one run lacks the request).
        expected: the baseline's tokens for that request.
        got: this run's tokens for that request.
    """

    identical: bool
    num_requests: int
    num_differing: int = 0
    first_differing_request: str | None = None
    first_differing_token: int | None = None
    expected: list[int] | None = None
    got: list[int] | None = None


def compare_outputs(result: RunResult, baseline: RunResult) -> OutputComparison:
    """Compare a run's outputs with a baseline's, request by request.

    Args:
        result: the run to check.
        baseline: the reference run (same trace).

    Returns:
        The comparison (first difference in ``result``'s request order).
    """
    ids = list(result.outputs) + [rid for rid in baseline.outputs if rid not in result.outputs]
    differing = [rid for rid in ids if result.outputs.get(rid) != baseline.outputs.get(rid)]
    if not differing:
        return OutputComparison(identical=True, num_requests=len(ids))
    rid = differing[0]
    got, expected = result.outputs.get(rid), baseline.outputs.get(rid)
    token = None
    if got is not None and expected is not None:
        token = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b),
                     min(len(got), len(expected)))
    return OutputComparison(identical=False, num_requests=len(ids), num_differing=len(differing),
                            first_differing_request=rid, first_differing_token=token,
                            expected=expected, got=got)


def report_dict(result: RunResult, baseline: RunResult | None = None) -> dict[str, Any]:
    """The machine-readable report.

    Args:
        result: the run.
        baseline: the no-connector run of the same trace, if any.

    Returns:
        ``{"workload", "connector", "device", "model", "metrics", "baseline_metrics"?,
        "comparison"?, "timeline"}`` (outputs are left out; they are in the RunResult;
        ``timeline`` is one record per step, see
        :class:`~kvconnector_core.engine.timeline.StepRecord`).
    """
    out: dict[str, Any] = {
        "workload": result.workload,
        "connector": result.connector,
        "device": result.device,
        "model": result.model,
        "metrics": msgspec.to_builtins(result.metrics),
    }
    if baseline is not None:
        out["baseline_metrics"] = msgspec.to_builtins(baseline.metrics)
        out["comparison"] = msgspec.to_builtins(compare_outputs(result, baseline))
    out["timeline"] = msgspec.to_builtins(result.timeline)
    return out


def _fmt_stat(value: float) -> str:
    """A connector stats number: whole numbers in full (byte counts), others to 6 digits."""
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover - loop always returns


def _rows(result: RunResult) -> list[tuple[str, str]]:
    m = result.metrics
    rows = [("model", result.model)] if result.model else []
    rows += [
        ("requests", f"{m.num_finished} finished / {m.num_requests}"
                     + (f" ({m.num_failed} failed)" if m.num_failed else "")),
        ("prompt tokens", f"{m.num_prompt_tokens}"),
        ("output tokens", f"{m.num_output_tokens}"),
        ("prefill tokens computed", f"{m.prefill_tokens_computed}"),
        ("served from GPU prefix cache", f"{m.gpu_prefix_hit_tokens} ({m.gpu_hit_rate:.1%})"),
        ("served by connector", f"{m.connector_hit_tokens} ({m.connector_hit_rate:.1%})"),
        ("total hit rate", f"{m.total_hit_rate:.1%}"),
        ("recomputed (preemption, failed load)", f"{m.recomputed_tokens}"),
        ("preemptions", f"{m.num_preemptions}"),
    ]
    if m.num_failed_loads_recovered:
        rows.append(("failed loads recovered", f"{m.num_failed_loads_recovered}"))
    if result.connector is not None:
        rows += [
            ("loaded (connector -> GPU)",
             f"{_fmt_bytes(m.bytes_loaded)} at {m.load_gbps:.2f} GB/s"),
            ("stored (GPU -> connector)",
             f"{_fmt_bytes(m.bytes_stored)} at {m.store_gbps:.2f} GB/s"),
        ]
        rows += [(f"connector: {k}", _fmt_stat(v)) for k, v in sorted(m.connector_stats.items())]
        if m.connector_errors:
            rows.append(("connector errors (contained)",
                         ", ".join(f"{k}={v}" for k, v in m.connector_errors.items())))
    if m.events:  # none recorded unless events were on (--kv-events, --publish-events)
        rows.append(("KV events", ", ".join(f"{k}={v}" for k, v in m.events.items() if "[" in k)))
    rows += [("steps", f"{m.steps}"),
             ("wall time", f"{m.wall_seconds:.2f} s")]
    return rows


def format_report(result: RunResult, baseline: RunResult | None = None) -> str:
    """The human-readable report: one table, plus the baseline comparison.

    Args:
        result: the run.
        baseline: the no-connector run of the same trace, if any.

    Returns:
        Multi-line text (no trailing newline).
    """
    title = (f"workload {result.workload!r} on {result.device}, connector: "
             f"{result.connector or 'none'}")
    rows = _rows(result)
    if baseline is not None:
        b = baseline.metrics
        rows += [("baseline (no connector)",
                  (f"{b.prefill_tokens_computed} prefill tokens computed, "
                   f"hit rate {b.total_hit_rate:.1%}, {b.wall_seconds:.2f} s"))]
    width = max(len(k) for k, _ in rows)
    lines = [title, "-" * len(title)] + [f"{k:<{width}}  {v}" for k, v in rows]
    if baseline is not None:
        cmp = compare_outputs(result, baseline)
        if cmp.identical:
            lines.append(f"outputs identical to baseline: yes ({cmp.num_requests} requests)")
        else:
            if cmp.got is None or cmp.expected is None:
                where = "only in the baseline" if cmp.got is None else "missing from the baseline"
                first = f"{cmp.first_differing_request!r} ({where})"
            else:
                first = (f"{cmp.first_differing_request!r} at token {cmp.first_differing_token}: "
                         f"expected {cmp.expected}, got {cmp.got}")
            lines.append("outputs identical to baseline: NO "
                         f"({cmp.num_differing} of {cmp.num_requests} "
                         f"requests differ; first: {first})")
    return "\n".join(lines)
