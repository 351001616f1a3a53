"""The test kit's checks under vLLM's own scheduler: what ``engine = "vllm"`` runs.

:class:`~kvconnector_core.testing.DataCheck` and
:class:`~kvconnector_core.testing.ConnectorContract` subclasses with the class attribute
``engine = "vllm"`` run their engine-bound tests here, in a :class:`~.rig.VllmRig` with the
connector behind kvconnector's adapter, so one test file covers both engines:

- a data-check workload replays its trace in the rig (same block size, pool, limits and
  prefix-caching setting); the byte oracle stands in for the no-connector baseline (the
  stub model's rows are known from the block hashes): any wrong byte in a loaded block or
  a prefix-cache hit, an exception escaping into vLLM, a request unfinished or held, or a
  block held after shutdown is a problem;
- the failed-synchronous-load check raises ``start_load_kv`` once in each of the first
  steps whose plan carries a synchronous load (found by a first run without faults);
- contract scenarios (construction in both roles, one request's lifecycle, an empty step,
  a delayed free after an abort, pins released at shutdown) each run in a rig.

Primitives: :func:`run_vllm_data_check`, :func:`run_vllm_failed_load_check`,
:func:`run_vllm_contract_scenario`, :data:`CONTRACT_SCENARIOS`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvconnector_core.testing.data_check import FAILED_LOAD_STEPS, DataCheckReport
from kvconnector_core.testing.fault_settings import FaultSettings, HookFault
from kvconnector_core.testing.kv_transfer_config import adapter_config, with_faults
from kvconnector_core.testing.vllm.report import RigReport
from kvconnector_core.testing.vllm.rig import VllmRig
from kvconnector_core.testing.vllm.workloads import prompt, run_trace

if TYPE_CHECKING:
    from kvconnector_core.connector.config import KVConnectorConfig
    from kvconnector_core.testing.data_check import DataCheckWorkload

__all__ = ["CONTRACT_SCENARIOS", "run_vllm_contract_scenario", "run_vllm_data_check",
           "run_vllm_failed_load_check"]

CONTRACT_SCENARIOS = ("constructs", "lifecycle", "empty_step", "delayed_free", "shutdown_pins")
"""The contract's engine-bound scenarios, as run under vLLM."""


def _kv_transfer(connector: KVConnectorConfig, hybrid: bool) -> dict[str, Any]:
    inner = {k: v for k, v in connector.to_dict().items()
             if k in ("name", "module_path", "extra_config")}
    return adapter_config({"kvconnector": inner}, hma=hybrid)


def _rig(config: dict[str, Any], work: DataCheckWorkload) -> VllmRig:
    hybrid = work.is_hybrid
    return VllmRig.from_kv_transfer_config(
        config, block_size=work.block_size, num_gpu_blocks=work.num_gpu_blocks,
        max_num_batched_tokens=work.max_num_batched_tokens, max_num_seqs=work.max_num_seqs,
        max_model_len=max(work.max_model_len, work.max_num_batched_tokens),
        enable_prefix_caching=work.enable_prefix_caching, raise_on_wrong=False,
        num_layers=4 if hybrid else 2, sliding_window=8 if hybrid else None,
        hma=True if hybrid else None)


def _problems(report: RigReport) -> list[str]:
    problems = []
    if report.wrong_bytes:
        problems.append(f"{report.wrong_bytes} wrong bytes (loaded {report.wrong_bytes_loaded}, "
                        f"prefix-cache hits {report.wrong_bytes_hit}); first: "
                        f"{report.first_bad_block}")
    problems += [f"exception escaping into vLLM: {e}" for e in report.exceptions]
    for label, count in (("requests unfinished within the step budget", report.unfinished),
                         ("requests vLLM still held once idle", report.held_requests),
                         ("GPU blocks held after shutdown", report.leaked_blocks)):
        if count:
            problems.append(f"{count} {label}")
    return problems


def _run(config: dict[str, Any], work: DataCheckWorkload) -> tuple[VllmRig, DataCheckReport]:
    rig = _rig(config, work)
    run_trace(rig, work.requests)
    report = DataCheckReport(work.name, problems=_problems(rig.check()))
    return rig, report


def run_vllm_data_check(connector: KVConnectorConfig, workload: DataCheckWorkload | str, *,
                        layer_types: tuple[str, ...] | None = None) -> DataCheckReport:
    """:func:`~kvconnector_core.testing.run_data_check` under vLLM's scheduler.

    Args:
        connector: the connector (run behind kvconnector's adapter; may be a
            ``fault_injection_config``).
        workload: a standard workload's name or a workload.
        layer_types: another model; any sliding or chunked layer makes the rig's hybrid
            model (full + an 8-token sliding window, ``KVConnectorAdapterHMA``).

    Returns:
        The report (``baseline`` and ``checked`` are None: the oracle is the baseline).
    """
    from kvconnector_core.testing.data_check import _resolve

    work = _resolve(workload, layer_types)
    return _run(_kv_transfer(connector, work.is_hybrid), work)[1]


def run_vllm_failed_load_check(connector: KVConnectorConfig,
                               workload: DataCheckWorkload | str = "chained_prefixes", *,
                               max_steps: int = FAILED_LOAD_STEPS) -> DataCheckReport:
    """:func:`~kvconnector_core.testing.run_failed_load_check` under vLLM's scheduler.

    A first run without faults finds the steps whose plans carry synchronous loads; then
    one run per such step (the first ``max_steps``) has ``start_load_kv`` raise once in
    it. A connector whose state outlives the rig (a directory) serves the first run's
    stores to the later ones, which then load earlier: those runs check less.

    Returns:
        The first failing run's report (its problems name the step), else the last one's.
    """
    from kvconnector_core.testing.data_check import _resolve

    work = _resolve(workload)
    config = _kv_transfer(connector, work.is_hybrid)
    probe, report = _run(config, work)
    steps = sorted(set(probe.sync_load_steps))[:max_steps]
    for step in steps:
        faults = FaultSettings(raise_in=(HookFault(hook="start_load_kv", at_step=step),))
        report = _run(with_faults(config, faults), work)[1]
        if not report.ok:
            report.problems = [f"start_load_kv raised (injected) in step {step}: {p}"
                               for p in report.problems]
            break
    return report


def run_vllm_contract_scenario(connector: KVConnectorConfig, scenario: str) -> RigReport:
    """Run one of :data:`CONTRACT_SCENARIOS` in a rig; returns its report.

    Raises:
        AssertionError: the report shows damage (or the scenario is unknown).
    """
    assert scenario in CONTRACT_SCENARIOS, f"unknown scenario {scenario!r}"
    rig = VllmRig.from_kv_transfer_config(_kv_transfer(connector, False), num_gpu_blocks=32,
                                          raise_on_wrong=False)
    if scenario in ("lifecycle", "shutdown_pins"):
        for seed in (1, 1, 2):  # the repeat hits the GPU prefix cache or the connector
            rig.add(prompt(seed, 4 * rig.block_size + 1), max_tokens=3)
            rig.run()
    elif scenario == "empty_step":
        rig.step()
    elif scenario == "delayed_free":
        rid = rig.add(prompt(3, 4 * rig.block_size + 1), max_tokens=8)
        for _ in range(2):
            rig.step()
        rig.abort(rid)
    report = rig.check()
    assert report.ok, report.format()
    return report
