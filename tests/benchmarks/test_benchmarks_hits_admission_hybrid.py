"""Smoke tests for the offload hit-rate, planning-cost, admission and hybrid-model
benchmarks: tiny sizes, no timing assertions."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))

import _drivers as d  # noqa: E402
import bench_admission  # noqa: E402
import bench_hybrid  # noqa: E402
import bench_offload_hits  # noqa: E402
import bench_offload_planning  # noqa: E402


def test_hit_rate_table_has_every_policy_and_size():
    chains = d.offload_key_chains(d.chat_trace("tiny"))
    for gpu_blocks in (0, 8):
        rates = bench_offload_hits.hit_rates(
            chains, [8, 64], with_vllm=False, gpu_blocks=gpu_blocks
        )
        assert len(rates) == 5
        assert all(
            set(by) == {8, 64} and all(0.0 <= v <= 1.0 for v in by.values())
            for by in rates.values()
        )
    # A tier that holds everything serves every repeated prefix, whatever the policy.
    big = bench_offload_hits.hit_rates(chains, [4096], with_vllm=False)
    assert len({by[4096] for by in big.values()}) == 1 and next(iter(big.values()))[4096] > 0


def test_gpu_cache_model_serves_repeats_before_the_tier():
    chains = d.offload_key_chains(d.chat_trace("tiny"))
    st = d.run_offload_trace(
        d.KvconnectorSide(), chains, policy="arc", num_blocks=64, gpu_blocks=4096
    )
    assert st.gpu_hit_keys > 0 and st.hit_keys == 0  # the GPU holds every repeat


def test_planning_measure_runs():
    ours, old = bench_offload_planning.measure(256, steps=20)
    assert ours > 0 and old > 0


def test_admission_runs_do_the_same_work():
    trace = d.chat_trace("tiny")
    a = bench_admission.run(trace, 64, False, max_num_seqs=4, budget=64, max_model_len=512)
    b = bench_admission.run(trace, 64, True, max_num_seqs=4, budget=64, max_model_len=512)
    assert a.finished == b.finished == len(trace.requests)
    assert a.output_tokens == b.output_tokens


def test_hybrid_memory_rows_show_sharing():
    rows = bench_hybrid.memory_rows()
    assert [r.split("|")[-2].strip() for r in rows] == ["1.00x", "2.00x", "3.00x"]


def test_hit_rate_table_leaves_the_policy_registry_as_it_was():
    from connectors.offload.manager import available_cache_policies

    before = available_cache_policies()
    bench_offload_hits.hit_rates(d.offload_key_chains(d.chat_trace("tiny")), [8], with_vllm=False)
    assert available_cache_policies() == before
