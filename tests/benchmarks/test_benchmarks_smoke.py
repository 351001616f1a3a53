"""Smoke tests for the benchmark scripts: tiny sizes, no timing assertions.

They keep ``benchmarks/bench_core.py`` and its shared drivers from rotting as the core
evolves: every workload runs end to end and its counters are checked for consistency.
``compare_vllm.py`` needs vLLM 0.33 and is only exercised where vLLM is installed.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))

import _drivers as d  # noqa: E402
import bench_core  # noqa: E402

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def test_block_pool_rows_cover_every_usable_block() -> None:
    """Each block pool row processes exactly the usable blocks, in positive time."""
    rows = d.run_block_pool(d.KvconnectorSide(), num_blocks=65, batch=16)
    assert set(rows) == {"allocate", "free uncached", "cache full blocks", "free cached",
                         "lookup hit", "lookup miss", "touch", "allocate evicting"}
    for name, (ns, n) in rows.items():
        assert n == 64, name
        assert ns > 0, name


def test_block_pool_rejects_sizes_that_do_not_split_into_batches() -> None:
    """A pool whose usable blocks are not a multiple of the batch is refused, naming both."""
    with pytest.raises(ValueError, match="batch=16"):
        d.run_block_pool(d.KvconnectorSide(), num_blocks=64, batch=16)


def test_bench_block_pool_reports_a_rate_per_operation() -> None:
    """bench_core's block pool benchmark returns one positive rate per operation."""
    res = bench_core.bench_block_pool(num_blocks=33, batch=16, repeats=1)
    assert len(res) == 8
    assert all(r["rate"] > 0 and r["unit"] == "blocks/s" for r in res)


@pytest.mark.parametrize("events", [False, True])
def test_manager_trace_finishes_every_request(events: bool) -> None:
    """The manager simulation finishes all requests and counts hits and events sensibly."""
    side = d.KvconnectorSide()
    trace = d.chat_trace("tiny")
    st = d.run_manager_trace(side, d.build_manager_requests(side, trace), num_blocks=256,
                             events=events)
    assert st.requests == len(trace)
    assert st.prompt_tokens == trace.num_prompt_tokens
    # Later turns extend earlier prompts and all users share a system prompt.
    assert 0 < st.hit_tokens < st.prompt_tokens
    assert st.free_calls == st.requests + st.preemptions
    assert (st.events > 0) == events


def test_manager_trace_preempts_when_the_pool_is_tight_and_still_finishes() -> None:
    """A pool too small for the batch forces preemptions; every request still finishes."""
    side = d.KvconnectorSide()
    trace = d.chat_trace("tiny")
    st = d.run_manager_trace(side, d.build_manager_requests(side, trace), num_blocks=20,
                             max_running=8)
    assert st.requests == len(trace)
    assert st.preemptions > 0


def test_manager_trace_is_deterministic() -> None:
    """Two runs of the same trace make exactly the same calls with the same outcomes."""
    side = d.KvconnectorSide()
    trace = d.chat_trace("tiny")
    a = d.run_manager_trace(side, d.build_manager_requests(side, trace), num_blocks=40)
    b = d.run_manager_trace(side, d.build_manager_requests(side, trace), num_blocks=40)
    assert a.semantics() == b.semantics()


def test_bench_kv_cache_manager_reports_three_metrics_per_events_setting() -> None:
    """bench_core's manager benchmark reports requests/s, steps/s and calls/s per setting."""
    res = bench_core.bench_kv_cache_manager("tiny", num_blocks=256, repeats=1)
    assert [r["unit"] for r in res] == ["requests/s", "steps/s", "allocate+free calls/s"] * 2
    assert all(r["rate"] > 0 and 0 < r["hit_rate"] < 1 for r in res)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_offload_trace_hits_repeated_prefixes(policy: str) -> None:
    """Key chains that repeat earlier prefixes hit the offload tier."""
    trace = d.chat_trace("tiny")
    chains = d.offload_key_chains(trace)
    st = d.run_offload_trace(d.KvconnectorSide(), chains, policy=policy, num_blocks=64)
    assert st.keys == sum(len(c) for c in chains)
    assert 0 < st.hit_keys < st.keys


def test_events_round_trip_through_msgpack() -> None:
    """Encoded event batches decode back to the same values."""
    import msgspec

    trace = d.chat_trace("tiny")
    res = d.run_events(d.KvconnectorSide(), d.offload_key_chains(trace), trace, passes=1)
    assert res["encode"][1] == 2 * len(trace)
    _, _, decode = d.KvconnectorSide().event_codec()
    for payload, batch in zip(res["payloads"], res["batches"]):
        assert msgspec.to_builtins(decode(payload)) == msgspec.to_builtins(batch)


def test_interleaved_events_time_every_side_on_the_same_batches() -> None:
    """The pass-by-pass interleaved event benchmark returns per-side results that decode back."""
    import msgspec

    trace = d.chat_trace("tiny")
    side = d.KvconnectorSide()
    res = d.run_events_interleaved([side], d.offload_key_chains(trace), trace, passes=3)
    one = res["kvconnector"]
    assert one["encode"][1] == one["decode"][1] == 2 * len(trace)
    assert one["encode"][0] > 0 and one["decode"][0] > 0
    _, _, decode = side.event_codec()
    for payload, batch in zip(one["payloads"], one["batches"]):
        assert msgspec.to_builtins(decode(payload)) == msgspec.to_builtins(batch)


def test_hashing_counts_full_blocks_only() -> None:
    """Hashing covers every full block of every prompt and nothing else."""
    trace = d.chat_trace("tiny")
    inputs = d.hashing_inputs(trace)
    ns, n = d.run_hashing(d.KvconnectorSide(), inputs)
    assert n == sum(len(r.prompt_token_ids) // d.BLOCK_SIZE for r in trace.requests)
    assert ns > 0


def test_record_section_appends_runs_and_keeps_other_sections(tmp_path: Path) -> None:
    """Recording a run appends under its heading and leaves other sections intact."""
    path = tmp_path / "RESULTS.md"
    path.write_text("# Benchmark results\n\n## Transfers (bench_transfer.py)\n\nGB/s table\n")
    d.record_section(path, bench_core.SECTION, "### Run 1\n")
    d.record_section(path, bench_core.SECTION, "### Run 2\n")
    d.record_section(path, "## Other", "x\n")
    text = path.read_text()
    assert "## Transfers (bench_transfer.py)\n\nGB/s table\n" in text
    core = text.index(bench_core.SECTION)
    assert core < text.index("### Run 1") < text.index("### Run 2") < text.index("## Other")


def test_bench_core_main_writes_json(tmp_path: Path) -> None:
    """The command line runs end to end (tiny sizes) and writes its JSON."""
    import json

    out = tmp_path / "core.json"
    assert bench_core.main(["--repeats", "1", "--trace", "tiny", "--pool-blocks", "33",
                            "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["machine"]["cores"]
    assert len(data["results"]) == 8 + 6


OWN_CODE = tuple(
    str(BENCH_DIR.parent / part) for part in ("kvconnector_core", "connectors", "benchmarks")
)


@pytest.mark.skipif(
    not HAVE_VLLM,
    reason="needs vLLM 0.33, installed only in its own venv "
    "(make vllm-venv; then .vllm-venv/bin/python -m pytest)",
)
def test_compare_vllm_tiny_run_has_matching_semantics() -> None:
    """With vLLM installed, a tiny comparison runs and both managers agree on every counter.

    vLLM and its dependencies warn at import and at run time (e.g. requests about a missing
    charset detector), and the suite turns warnings into errors: those warnings are
    recorded rather than raised, and only warnings from this project's own code fail.
    """
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import compare_vllm

        rows, checks = compare_vllm.compare(
            repeats=1, trace_size="tiny", pool_blocks=33, log=lambda _m: None
        )
    ours = [
        f"{w.filename}:{w.lineno}: {w.message}" for w in caught if w.filename.startswith(OWN_CODE)
    ]
    assert ours == []
    assert rows
    assert checks["manager events off"]["same_semantics"]
    assert checks["manager events on"]["same_semantics"]


@pytest.mark.skipif(
    not HAVE_VLLM,
    reason="needs vLLM 0.33, installed only in its own venv "
    "(make vllm-venv; then .vllm-venv/bin/python -m pytest)",
)
@pytest.mark.parametrize(
    ("block_size", "spec", "blocks"), [(32, "hybrid", 300), (64, "sliding", 60)]
)
def test_compare_vllm_other_shapes_do_the_same_work(
    block_size: int, spec: str, blocks: int
) -> None:
    """Other block sizes and attention layouts, a tight pool: both managers agree on every
    counter and both offload managers hit the same keys, request by request."""
    import warnings

    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        import compare_vllm

        try:
            rows, checks = compare_vllm.compare(
                repeats=1,
                trace_size="medium",
                seed=5,
                block_size=block_size,
                spec=spec,
                window=128,
                manager_blocks=blocks,
                offload_blocks=64,
                only=("manager", "offload"),
                log=lambda _m: None,
            )
        finally:
            d.configure()
    assert not [r for r in rows if r.failure]
    assert checks["manager events on"]["same_semantics"]
    assert checks["manager events on"]["kvconnector"]["preemptions"] > 0
    assert checks["offload arc"]["equal"] and checks["offload lru"]["equal"]
    assert {r.group for r in rows} == {"KV cache manager", "CPU offload manager"}


@pytest.fixture
def _default_shape():
    yield
    d.configure()  # back to 16-token blocks, full attention, for the other tests


@pytest.mark.parametrize("name", ["long", "short", "shared", "noshare"])
def test_unseen_trace_shapes_are_seeded_and_sized_as_documented(name: str) -> None:
    a, b, c = d.chat_trace(name, 1), d.chat_trace(name, 1), d.chat_trace(name, 2)
    assert [r.prompt_token_ids for r in a.requests] == [r.prompt_token_ids for r in b.requests]
    assert [r.prompt_token_ids for r in a.requests] != [r.prompt_token_ids for r in c.requests]
    lengths = [len(r.prompt_token_ids) for r in a.requests]
    lo, hi, count = {
        "long": (8193, 32001, 48),
        "short": (25, 137, 4000),
        "shared": (2049, 2049, 960),
        "noshare": (201, 1201, 1500),
    }[name]
    assert len(lengths) == count and lo <= min(lengths) and max(lengths) <= hi
    assert len({r.request_id for r in a.requests}) == count


@pytest.mark.usefixtures("_default_shape")
def test_block_size_and_spec_shape_every_input_of_our_side() -> None:
    """configure() sets the hashed block size of keys, hashing inputs and requests, and
    the manager's groups (hybrid: a full and a sliding-window group)."""
    trace = d.chat_trace("tiny")
    d.configure(block_size=32, spec="hybrid", window=64)
    assert [len(c) for c in d.offload_key_chains(trace)] == [
        len(r.prompt_token_ids) // 32 for r in trace.requests
    ]
    assert {len(b) for blocks in d.hashing_inputs(trace) for b in blocks} == {32}
    side = d.KvconnectorSide()
    groups = side.new_manager(64).kv_cache_config.kv_cache_groups
    assert [type(g.kv_cache_spec).__name__ for g in groups] == [
        "FullAttentionSpec",
        "SlidingWindowSpec",
    ]
    assert {g.kv_cache_spec.block_size for g in groups} == {32}
    st = d.run_manager_trace(side, d.build_manager_requests(side, trace), num_blocks=64)
    assert st.requests == len(trace)
    with pytest.raises(ValueError, match="unknown spec 'mla'; valid: full, sliding, hybrid"):
        d.configure(spec="mla")


def test_bench_tiers_disk_rows_run_and_check_the_read_back(tmp_path, capsys) -> None:
    """bench_tiers.py's disk comparison runs end to end on tiny sizes (no Redis needed)."""
    import json

    import bench_tiers

    out = tmp_path / "tiers.json"
    assert (
        bench_tiers.main(
            [
                "--count",
                "4",
                "--value-kib",
                "4",
                "--repeats",
                "2",
                "--skip-redis",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    (row,) = json.loads(out.read_text())["rows"]
    assert row["tier"] == "disk" and row["bytes"] == 4 * 4096
    assert row["store_ratio"] > 0 and row["load_ratio"] > 0


def test_bench_tier_shards_runs_and_refuses_unequal_work(capsys, monkeypatch) -> None:
    """bench_tier_shards.py times 1, 2 and 4 shards on disk, and refuses a run in which a
    side does not find every chunk (here: nothing was stored)."""
    import bench_tier_shards

    assert bench_tier_shards.main(["--chunks", "4", "--repeats", "1", "--skip-redis"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| disk |")]
    assert [row.split("|")[2].strip() for row in rows] == ["1", "2", "4"]
    monkeypatch.setattr(bench_tier_shards, "_fill", lambda spec, keys: None)
    with pytest.raises(SystemExit, match="4 of 4 chunks not found"):
        bench_tier_shards.main(["--chunks", "4", "--repeats", "1", "--skip-redis"])


def test_transfer_benchmarks_run_every_variant_on_cpu(tmp_path: Path) -> None:
    """bench_transfer and bench_interference run end to end on CPU and every row checks out."""
    import json

    import bench_interference
    import bench_transfer

    kv = [
        "--device",
        "cpu",
        "--layers",
        "2",
        "--kv-heads",
        "1",
        "--head-size",
        "8",
        "--block-size",
        "4",
        "--num-gpu-blocks",
        "16",
    ]
    out = tmp_path / "t.json"
    assert bench_transfer.main([*kv, "--batch", "4", "--reps", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 3 * 8 * 2  # layouts x default variants x id patterns
    assert all(r["ok"] for r in rows)
    out = tmp_path / "i.json"
    assert (
        bench_interference.main(
            [
                *kv,
                "--blocks",
                "2",
                "--steps",
                "1",
                "--warmup",
                "0",
                "--tokens",
                "4",
                "--hidden",
                "8",
                "--ffn",
                "8",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 3 * 7 and all(r["ok"] for r in rows)


def test_connector_cost_measures_hooks_only_with_a_connector() -> None:
    """The cost benchmark times the scheduler on both sides and hooks only with the connector."""
    import bench_connector_cost

    b = bench_connector_cost
    trace = d.chat_trace("tiny")
    without = b.measure(trace, b.NO_CONNECTOR)
    with_conn = b.measure(trace, b.OFFLOAD)
    split = b.measure(trace, b.OFFLOAD, hooks=True)
    threaded = b.measure(trace, b.OFFLOAD_THREAD)
    assert without["scheduler"] > 0 and "worker hooks" not in without
    # Scheduler-side hooks are timed only when the split is asked for (nested timers).
    assert with_conn["worker hooks"] > 0 and "scheduler hooks" not in with_conn
    assert split["scheduler hooks"] > 0 and split["worker hooks"] > 0
    assert with_conn["requests"] == without["requests"] == len(trace)
    assert with_conn["request_steps"] > 0 and with_conn["steps"] > 0  # empty steps exist
    # The copies moved to the mover's thread: its CPU time is measured, not lost.
    assert with_conn["mover_thread_us"] == 0 and threaded["mover_thread_us"] > 0
    assert with_conn["wall_s"] > 0
    # The sides must have done the same work, or the run is refused.
    runs = {"a": [without], "b": [with_conn, threaded]}
    variants = [b.Variant("a", connector=False), b.Variant("b", connector=True)]
    b._check_same_work(runs, variants)  # noqa: SLF001
    with pytest.raises(SystemExit, match="different work"):
        b._check_same_work({**runs, "a": [dict(without, outputs="x")]}, variants)  # noqa: SLF001
