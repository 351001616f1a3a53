"""``DataCheck``: does a connector move the *right* KV data? Tests that compare with no connector.

Subclass it in a test module and set ``connector_config``::

    from kvconnector_core.connector import KVConnectorConfig
    from kvconnector_core.testing import DataCheck

    class TestMyConnectorData(DataCheck):
        connector_config = KVConnectorConfig(name="MyConnector", extra_config={...})

Each inherited ``test_*`` method runs one small workload (:func:`data_check_workloads`)
twice through the real engine, once without a connector (the baseline) and once with
the connector under test, and fails when:

- any request's generated tokens differ from the baseline's;
- after a step, a KV row the scheduler counts as computed for a scheduled request (GPU
  prefix hit, connector load or model output) differs from the baseline's row for the
  same request and position. Rows are compared block by block through the worker's
  view of the paged tensors, right after the step's worker hooks ran, so a wrong block,
  a changed value or a missing block is named with its request, token range and GPU
  block id. Blocks the worker reported in ``get_block_ids_with_load_errors`` (or
  requests in ``failed_recving``) are exempt: a *reported* failed load is recomputed.

Silent over-claims cannot hide behind stale data: before each step, every block that
newly joined a request's block table and is not a GPU prefix-cache hit is filled with a
poison value the engine's model never writes, so a block the connector claimed but
never loaded is caught even when the pool happens to reuse a block holding the same
prefix. The workloads use a tiny exact-integer model (see ``docs/determinism.md``) with
int16 KV, in which every byte of every element carries data, so equal data means
bit-equal rows and a corrupted byte anywhere in a block is a differing row.

Every lookup is asked twice in a row (as vLLM may ask again); ``test_lookups_are_repeatable``
also compares runs with lookups asked once and twice. ``test_hybrid`` runs a model with
three KV cache groups when the connector declares ``supports_multiple_kv_cache_groups``
and otherwise checks that it is refused; ``layer_types`` runs every workload on a model
of your choice. A ``fault_injection_config`` may be checked too: the faults it injects
are not counted as the connector's errors.

:func:`run_data_check` does the same without pytest and returns a
:class:`DataCheckReport`. ``test_failed_sync_loads`` (:func:`run_failed_load_check`) makes
``start_load_kv`` raise once in each of the first steps with synchronous loads, one run
per step: that step's forward runs on blocks that were never loaded, so a connector that
later serves the stores planned in that step is caught deterministically, not by the luck
of a random fault rate.

Primitives: :class:`DataCheck`, :class:`DataCheckWorkload`, :class:`DataCheckReport`,
:func:`data_check_workloads`, :func:`run_data_check`, :func:`run_failed_load_check`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, ClassVar

from kvconnector_core.engine.engine import Engine, RunResult
from kvconnector_core.engine.workloads import Trace
from kvconnector_core.errors import ConfigError
from kvconnector_core.testing._data_probes import (
    NEVER,
    ask_lookups_twice,
    connector_raises,
    fail_nth_sync_load,
    injected_raises,
    lookup_side_effects,
    visible_failed_stores,
)
from kvconnector_core.testing._data_rows import POISON, Checker, Recorder, observe  # noqa: F401 - POISON: kept importable here
from kvconnector_core.testing._data_workloads import DataCheckWorkload, data_check_workloads

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvconnector_core.connector.config import KVConnectorConfig

__all__ = ["DataCheck", "DataCheckReport", "DataCheckWorkload", "data_check_workloads",
           "run_data_check", "run_failed_load_check"]

FAILED_LOAD_STEPS = 4
"""How many steps with synchronous loads :func:`run_failed_load_check` fails, one run each."""


@dataclass
class DataCheckReport:
    """What :func:`run_data_check` found.

    Attributes:
        workload: the workload's name.
        problems: one line per problem found (empty = the connector passed): a KV row
            that differs (request, group, token range, block index, GPU block, whether
            it was never written), an output or final status that differs, raises of
            the connector that were not injected, a failed store a lookup served.
        baseline: the run without a connector (:class:`RunResult`: ``outputs``,
            ``statuses``, ``metrics``, ``timeline``).
        checked: the run with the connector (its ``metrics.connector_errors`` counts
            every contained raise, injected ones included).
        injected_raises: raises a fault-injecting wrapper made on purpose (not problems).
    """

    workload: str
    problems: list[str] = field(default_factory=list)
    baseline: RunResult | None = None
    checked: RunResult | None = None
    injected_raises: int = 0

    @property
    def ok(self) -> bool:
        """True when nothing was found."""
        return not self.problems

    def __str__(self) -> str:
        head = f"data check {self.workload!r}: "
        if self.ok:
            return head + "ok"
        return head + f"{len(self.problems)} problem(s)\n  " + "\n  ".join(self.problems)


def _outputs_problems(baseline: RunResult, checked: RunResult) -> list[str]:
    problems = []
    for rid, want in baseline.outputs.items():
        got = checked.outputs.get(rid)
        if got != want:
            at = next((i for i, (a, b) in enumerate(zip(got or [], want)) if a != b), None)
            problems.append(f"request {rid!r}: output {got} != no-connector output {want}"
                            + (f" (first difference at token {at})" if at is not None else ""))
    for rid, status in checked.statuses.items():
        if status != baseline.statuses.get(rid):
            problems.append(f"request {rid!r}: status {status} != no-connector status "
                            f"{baseline.statuses.get(rid)}")
    return problems


def _resolve(workload: DataCheckWorkload | str,
             layer_types: tuple[str, ...] | None = None) -> DataCheckWorkload:
    if isinstance(workload, DataCheckWorkload):
        work = workload
    else:
        known = data_check_workloads()
        if workload not in known:
            msg = f"unknown data check workload {workload!r}; valid names: {', '.join(known)}"
            raise ConfigError(msg)
        work = known[workload]
    return work if layer_types is None else replace(work, layer_types=tuple(layer_types))


def run_data_check(connector: KVConnectorConfig, workload: DataCheckWorkload | str, *,
                   layer_types: tuple[str, ...] | None = None) -> DataCheckReport:
    """Run ``workload`` without and with ``connector``; compare outputs and KV rows.

    ``connector`` may be wrapped in faults (``fault_injection_config``): the faults it
    injects on purpose (raising hooks, failed stores, which are raises from
    ``wait_for_save``) are not counted as the connector's own errors, while outputs and
    rows are still compared, and a failed store that a later lookup served is a problem.
    Every lookup is asked twice in a row (as vLLM may): a second answer that differs from
    the first is a problem.

    Args:
        connector: the connector to check.
        workload: a :class:`DataCheckWorkload` or the name of a standard one
            (:func:`data_check_workloads`: ``"block_aligned"``, ``"full_prompt_hit"``,
            ``"repeated_prefixes"``, ``"eviction"``, ``"preemption"``, ``"hybrid"``).
        layer_types: run the workload on this model instead (e.g.
            ``("full", "sliding:8")``, a hybrid model with two KV cache groups).

    Returns:
        The report; ``report.ok`` when nothing differed.

    Raises:
        ConfigError: an unknown workload name, or the connector refused the model (a
            connector without ``supports_multiple_kv_cache_groups`` on a hybrid model).
    """
    return _check(connector, _resolve(workload, layer_types))


def _check(connector: KVConnectorConfig, work: DataCheckWorkload,
           prepare: Callable[[Engine], None] | None = None) -> DataCheckReport:
    """:func:`run_data_check` of a resolved workload; ``prepare`` sees the checked engine
    before it runs."""
    trace = Trace(work.name, list(work.requests))
    with Engine(work.engine_config(None)) as engine:
        recorder = Recorder(engine)
        observe(engine, recorder)
        baseline = engine.run(trace)
    with Engine(work.engine_config(connector)) as engine:
        checker = Checker(engine, recorder.book)
        observe(engine, checker)
        ask_lookups_twice(engine, checker.problems)
        if prepare is not None:
            prepare(engine)
        checked = engine.run(trace)
    report = DataCheckReport(work.name, baseline=baseline, checked=checked)
    report.problems = checker.problems + _outputs_problems(baseline, checked)
    errors = checked.metrics.connector_errors
    report.injected_raises = injected_raises(engine)
    if connector_raises(errors) > report.injected_raises:
        report.problems.append(
            f"the connector raised (contained by the engine) in: {errors}"
            + (f"; only {report.injected_raises} of these raises were injected faults"
               if report.injected_raises else ""))
    if visible := visible_failed_stores(engine):
        report.problems.append(f"{visible} lookup(s) claimed blocks whose store failed "
                               "(injected): a failed store must never become visible to "
                               "lookups")
    return report


def run_failed_load_check(connector: KVConnectorConfig,
                          workload: DataCheckWorkload | str = "chained_prefixes",
                          *, layer_types: tuple[str, ...] | None = None,
                          max_steps: int = FAILED_LOAD_STEPS) -> DataCheckReport:
    """:func:`run_data_check` with ``start_load_kv`` raising once, in a step with
    synchronous loads; one run for each of the first ``max_steps`` such steps.

    The engine recomputes the failed loads, but that step's forward already ran on blocks
    that were never loaded, so the stores the connector planned for the step hold wrong
    KV: a connector that serves them later fails (writing-a-connector.md, "When a
    synchronous load fails"). A connector that never loads synchronously passes at once.
    The fault is armed while the run goes (at the n-th step whose scheduler output has
    synchronous loads), so no earlier run has to find those steps first: a persistent
    tier would keep that run's stores and serve them instead of the faulted step's.

    Returns:
        The first failing run's report (its problems name the step), else the last one's.
    """
    from kvconnector_core.testing.fault_settings import FaultSettings, HookFault
    from kvconnector_core.testing.faults import fault_injection_config

    work = _resolve(workload, layer_types)
    # Armed by fail_nth_sync_load, never by the step count.
    faults = FaultSettings(raise_in=(HookFault(hook="start_load_kv", at_step=NEVER),))
    report = DataCheckReport(work.name)
    for n in range(max_steps):
        armed: list[int] = []
        report = _check(fault_injection_config(connector, faults), work,
                        prepare=functools.partial(fail_nth_sync_load, n=n, armed=armed))
        if not armed:
            break  # fewer than n + 1 steps with synchronous loads: the last run had no fault
        if not report.ok:
            report.problems = [f"start_load_kv raised (injected) in step {armed[0]}, the step with "
                               f"synchronous loads number {n + 1}: {problem}"
                               for problem in report.problems]
            break
    return report


class DataCheck:
    """Data tests for one connector configuration (see the module docstring).

    Attributes:
        connector_config: the connector to check (required); may be a
            ``fault_injection_config`` (injected faults are not counted as errors).
        layer_types: when set, every standard workload runs on this model instead of
            the kit's one-group model (e.g. ``("full", "sliding:8")``).
        engine: ``"kvconnector"`` (the default) or ``"vllm"``: the workloads run under
            vLLM 0.33's own scheduler behind kvconnector's adapter, checked by the vLLM
            rig's byte oracle (:mod:`kvconnector_core.testing.vllm.kit`; needs vLLM).
    """

    connector_config: ClassVar[KVConnectorConfig]
    layer_types: ClassVar[tuple[str, ...] | None] = None
    engine: ClassVar[str] = "kvconnector"

    def check(self, workload_name: str) -> DataCheckReport:
        """Run one standard workload; fail the test with the report unless it is clean."""
        if self.engine == "vllm":
            from kvconnector_core.testing.vllm.kit import run_vllm_data_check

            report = run_vllm_data_check(self.connector_config, workload_name,
                                         layer_types=self.layer_types)
            assert report.ok, str(report)
            return report
        report = run_data_check(self.connector_config, workload_name, layer_types=self.layer_types)
        assert report.ok, str(report)
        return report

    def test_block_aligned(self) -> None:
        """Prompts of whole blocks extended by whole blocks: same outputs, same KV rows."""
        self.check("block_aligned")

    def test_full_prompt_hit(self) -> None:
        """Repeated prompts the connector may serve whole: same outputs, same KV rows."""
        self.check("full_prompt_hit")

    def test_repeated_prefixes(self) -> None:
        """Shared prefixes with GPU and connector hits mixed: same outputs, same KV rows."""
        self.check("repeated_prefixes")

    def test_eviction(self) -> None:
        """A pool too small to keep prefixes: same outputs, same KV rows."""
        self.check("eviction")

    def test_preemption(self) -> None:
        """Preempted requests admitted again: same outputs, same KV rows."""
        self.check("preemption")

    def test_failed_sync_loads(self) -> None:
        """``start_load_kv`` raising once in a step with synchronous loads: the stores of
        that step (computed on blocks never loaded) are never served later."""
        if self.connector_config.name == "FaultInjector":
            import pytest  # the kit's pytest part; run_data_check works without pytest

            pytest.skip("connector_config injects faults already; test_failed_sync_loads needs "
                        "the bare connector")
        if self.engine == "vllm":
            from kvconnector_core.testing.vllm.kit import run_vllm_failed_load_check

            report = run_vllm_failed_load_check(self.connector_config)
        else:
            report = run_failed_load_check(self.connector_config, layer_types=self.layer_types)
        assert report.ok, str(report)

    def test_lookups_are_repeatable(self) -> None:
        """The ``eviction`` workload with lookups asked once and twice: same outputs, hits
        and stats counters (vLLM asks again for a request that stays waiting)."""
        if self.engine == "vllm":
            import pytest

            pytest.skip("kvconnector's engine only: vLLM asks again by itself")
        work = data_check_workloads()["eviction"]
        if self.layer_types is not None:
            work = replace(work, layer_types=self.layer_types)

        def run(ask_twice: bool) -> RunResult:
            with Engine(work.engine_config(self.connector_config)) as engine:
                if ask_twice:
                    ask_lookups_twice(engine, [])
                return engine.run(Trace(work.name, list(work.requests)))

        problems = lookup_side_effects(run)
        assert not problems, "\n".join(problems)

    def test_hybrid(self) -> None:
        """A model with three KV cache groups: the same checks when the connector declares
        ``supports_multiple_kv_cache_groups``, else the engine must refuse it (ConfigError).
        Under vLLM: the rig's hybrid model with ``KVConnectorAdapterHMA``, if declared."""
        from kvconnector_core.connector.base import KVConnectorRole
        from kvconnector_core.plugins.registry import create_connector

        work = data_check_workloads()["hybrid"]
        one_group = data_check_workloads()["block_aligned"].engine_config(None).kv_cache_config()
        probe = create_connector(self.connector_config, KVConnectorRole.SCHEDULER, one_group)
        declared = probe.supports_multiple_kv_cache_groups
        probe.shutdown()
        if declared:
            self.check(work.name)
            return
        if self.engine == "vllm":
            import pytest

            pytest.skip("vLLM turns its hybrid KV cache manager off for this connector")
        try:
            Engine(work.engine_config(self.connector_config)).shutdown()
        except ConfigError:
            return  # refused, as a one-group connector must be
        msg = (f"{self.connector_config.name} does not declare supports_multiple_kv_cache_groups, "
               f"yet the engine accepted it on a model with several KV cache groups")
        raise AssertionError(msg)
