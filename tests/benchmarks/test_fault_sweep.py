"""The fault sweep (benchmarks/fault_sweep.py): a quick subset of seeds, and checks that its
checks can fail."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import _fault_runs as fr  # noqa: E402
import _sweep_checks as sc  # noqa: E402
from fault_sweep import summarize  # noqa: E402

from connectors.offload.manager import CPUOffloadingManager  # noqa: E402
from kvconnector_core.engine.engine import Engine  # noqa: E402
from kvconnector_core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402

QUICK_SEEDS = range(5)


@pytest.fixture(scope="module")
def baselines():
    return {seed: fr.baseline_outputs(seed) for seed in QUICK_SEEDS}


def _cells():
    for connector in fr.CONNECTORS:
        for fault in fr.FAULTS:
            yield pytest.param(connector, fault, id=f"{connector}-{fault}")


@pytest.mark.parametrize(("connector", "fault"), list(_cells()))
def test_quick_sweep_finds_no_damage(connector, fault, baselines):
    outcomes = [fr.run_cell(connector, fault, seed, baselines[seed]) for seed in QUICK_SEEDS]
    failing = {o.seed: (o.failed, o.detail) for o in outcomes if o.failed}
    assert not failing, f"{connector}/{fault}: {failing}"


def test_runs_are_reproducible(baselines):
    first = fr.run_cell("cpu_offload", "raise_10pct", 1, baselines[1])
    assert fr.run_cell("cpu_offload", "raise_10pct", 1, baselines[1]) == first


def _stored(h: int, medium: str) -> BlockStored:
    return BlockStored(
        block_hashes=[h],
        parent_block_hash=None,
        token_ids=[],
        block_size=4,
        lora_id=None,
        medium=medium,
        lora_name=None,
        group_idx=0,
    )


def test_replica_follows_events_and_clears_per_medium():
    replica = sc.EventReplica()
    replica.apply([_stored(1, "GPU"), _stored(1, "GPU"), _stored(7, "CPU"), _stored(8, "CPU")])
    assert replica.diff(Counter({(0, 1): 2}), {(0, 7), (0, 8)}) is None
    # a multiset: two blocks hold 1
    assert "GPU" in replica.diff(Counter({(0, 1): 1}), {(0, 7), (0, 8)})
    replica.apply([BlockRemoved(block_hashes=[8], medium="CPU"), AllBlocksCleared()])
    assert replica.diff(Counter(), set()) is None
    replica.apply([BlockRemoved(block_hashes=[5], medium="GPU")])
    assert replica.errors


def _engine_after_a_run(connector: str = "cpu_offload") -> tuple[Engine, list]:
    seed = 0
    eng = Engine(fr._engine_config(seed, fr.connector_config(connector, "transfer_only", seed)))
    trace = fr.make_trace(seed)
    driver = fr._Driver(eng, trace, budget=1000, replica=True)
    assert driver.run() and driver.replica_bad_steps == 0
    return eng, trace


def test_end_checks_are_clean_after_a_good_run_and_catch_planted_leaks():
    eng, trace = _engine_after_a_run()
    ids = {r.request_id for r in trace}
    assert (
        sc.leaked_gpu_refs(eng),
        sc.held_cpu_slots(eng),
        sc.leftover_request_state(eng, ids),
    ) == (0, 0, [])
    assert sc.real_media(eng)[1], "the CPU tier stored nothing: the checks below would be vacuous"
    manager = next(
        o for o in sc.walk([eng.scheduler_connector]) if isinstance(o, CPUOffloadingManager)
    )
    key, entry = next(iter(manager.policy))
    entry.ref_cnt += 1  # a load that never completed
    assert sc.held_cpu_slots(eng) == 1
    block = next(b for b in eng.scheduler.kv_cache_manager.block_pool.blocks if not b.is_null)
    block.ref_cnt += 1
    assert sc.leaked_gpu_refs(eng) == 1
    inner = eng.scheduler_connector.inner
    inner.__dict__["_planted"] = {"r0": object()}
    assert sc.leftover_request_state(eng, ids) == [f"{type(inner).__name__}._planted holds 'r0'"]


def test_summary_names_the_smallest_failing_seed():
    ok = fr.RunOutcome("memory", "raise_once", 4, dict.fromkeys(fr.CHECKS, 0), {})
    bad = [
        fr.RunOutcome("memory", "raise_once", s, {**dict.fromkeys(fr.CHECKS, 0), "deadlock": 1}, {})
        for s in (9, 5)
    ]
    table = summarize([ok, *bad])
    assert "| memory | raise_once | 3 | 0 | 0 | 2 |" in table
    assert "| 5 (deadlock) |" in table
