"""What ``run_data_check`` watches besides KV rows (private): every lookup asked twice, and
the faults a fault-injecting wrapper made on purpose.

Primitives: :func:`ask_lookups_twice`, :func:`lookup_side_effects`, :func:`injected_raises`,
:func:`connector_raises`, :func:`visible_failed_stores`, :func:`fail_nth_sync_load`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvconnector_core.engine.engine import Engine
    from kvconnector_core.scheduler.output import ModelRunnerOutput, SchedulerOutput

__all__ = ["GUARD_RESPONSES", "MAX_PROBLEMS", "NEVER", "ask_lookups_twice", "connector_raises",
           "fail_nth_sync_load", "injected_raises", "lookup_side_effects", "visible_failed_stores"]

NEVER = 2**62
"""A ``HookFault.at_step`` no run reaches: the fault stays unarmed until
:func:`fail_nth_sync_load` arms it."""

MAX_PROBLEMS = 8
"""Problems one report lists: enough to see a pattern; more only buries the first one."""


GUARD_RESPONSES = frozenset({"quarantined", "event_gap", "update_connector_output.dropped"})
"""Keys of ``RunMetrics.connector_errors`` that count what the guard did about raises
(quarantine, an event gap marker, a dropped report), not raises themselves: counting them
would blame a correct connector for a quarantine that injected raises caused."""


def connector_raises(errors: dict[str, int]) -> int:
    """How many hook calls raised, from ``RunMetrics.connector_errors``."""
    return sum(count for key, count in errors.items() if key not in GUARD_RESPONSES)


def injected_raises(engine: Engine) -> int:
    """Raises a fault-injecting wrapper (``fault_injection_config``) made on purpose."""
    from kvconnector_core.testing.faults import FaultInjectingConnector

    return sum(c.num_injected_raises for c in (engine.scheduler_connector, engine.worker_connector)
               if isinstance(c, FaultInjectingConnector))


def fail_nth_sync_load(engine: Engine, n: int, armed: list[int]) -> None:
    """Make the worker's ``start_load_kv`` raise once, in the ``n``-th (from 0) step whose
    scheduler output has synchronous loads; the step's number goes into ``armed``.

    ``engine`` runs a ``fault_injection_config`` whose ``start_load_kv`` fault has
    ``at_step=NEVER``; this moves it to the plan the step is about to bind.
    """
    from kvconnector_core.testing.fault_settings import HookFault
    from kvconnector_core.testing.faults import FaultInjectingConnector

    worker = engine.worker_connector
    if not isinstance(worker, FaultInjectingConnector):
        msg = f"fail_nth_sync_load needs a fault-injecting worker, got {type(worker).__qualname__}"
        raise TypeError(msg)
    runner = engine.model_runner
    inner = runner.execute_model
    seen = 0
    step = 0

    def execute_model(so: SchedulerOutput) -> ModelRunnerOutput:
        nonlocal seen, step
        step += 1
        if so.has_sync_kv_loads and so.kv_connector_metadata is not None:
            if seen == n:
                # bind_connector_metadata counts this step's plan first: raise at that count.
                worker.arm_hook_fault(HookFault(hook="start_load_kv", at_step=worker.step + 1))
                armed.append(step)
            seen += 1
        return inner(so)

    runner.execute_model = execute_model  # type: ignore[method-assign,assignment]


def visible_failed_stores(engine: Engine) -> int:
    from kvconnector_core.testing.faults import FaultInjectingConnector

    conn = engine.scheduler_connector
    return len(conn.failed_store_hits) if isinstance(conn, FaultInjectingConnector) else 0


def ask_lookups_twice(engine: Engine, problems: list[str]) -> None:
    """Ask every lookup twice in a row and report a second answer that differs.

    vLLM 0.33's scheduler asks ``get_num_new_matched_tokens`` again, with the same
    arguments, whenever a waiting request is not admitted (no budget, no blocks), so an
    answer must not depend on having been asked before. A first answer of None ("not
    known yet, ask again") may change.
    """
    conn = engine.scheduler_connector
    if conn is None:
        return
    ask = conn.get_num_new_matched_tokens

    def twice(request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        first = ask(request, num_computed_tokens)
        again = ask(request, num_computed_tokens)
        if first[0] is not None and tuple(again) != tuple(first) and len(problems) < MAX_PROBLEMS:
            problems.append(
                f"request {request.request_id!r}: get_num_new_matched_tokens(request, "
                f"{num_computed_tokens}) answered {tuple(first)}, then {tuple(again)} when asked "
                f"again at once; a lookup must give the same answer until the state changes "
                f"(vLLM asks again for a request that stays waiting)")
        if again[1] and not conn.supports_async_load and len(problems) < MAX_PROBLEMS:
            problems.append(f"request {request.request_id!r}: the lookup answered load_async=True, "
                            f"but the connector does not declare supports_async_load")
        return again

    conn.get_num_new_matched_tokens = twice  # type: ignore[method-assign]


def _count_stats(stats: dict[str, float]) -> dict[str, float]:
    """The integer counters of a run's connector stats (timings, floats, vary between runs)."""
    return {k: v for k, v in stats.items() if isinstance(v, int) and not isinstance(v, bool)}


def lookup_side_effects(run: Any) -> list[str]:
    """Run a workload twice, lookups asked once and asked twice; report what differs.

    Args:
        run: ``run(ask_twice: bool) -> RunResult``, one engine run with the connector.

    Returns:
        Problems: differing outputs, hit tokens or integer stats counters (a lookup that
        counts hits, reserves or reorders on a hit shows up here even when it answers
        the same when asked again).
    """
    once, twice = run(False), run(True)
    problems = []
    if once.outputs != twice.outputs:
        problems.append("outputs differ when every lookup is asked twice")
    a, b = once.metrics, twice.metrics
    if a.connector_hit_tokens != b.connector_hit_tokens:
        problems.append(f"the connector served {a.connector_hit_tokens} tokens with lookups "
                        f"asked once, {b.connector_hit_tokens} with lookups asked twice")
    sa, sb = _count_stats(a.connector_stats), _count_stats(b.connector_stats)
    changed = {k: (sa.get(k), sb.get(k))
               for k in sorted(sa.keys() | sb.keys()) if sa.get(k) != sb.get(k)}
    if changed:
        problems.append(f"stats counters differ when every lookup is asked twice (once, twice): "
                        f"{changed}; a lookup must not count, reserve or reorder (do that in "
                        f"update_state_after_alloc)")
    return problems
