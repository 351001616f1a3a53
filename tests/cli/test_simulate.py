"""``kvconnector simulate``: the offload tier's manager driven alone over a Mooncake trace.

It must count the same tier hits as the offload connector driven by the engine on the
same requests when the GPU prefix cache cannot serve them, be fast, and fail with one
line and exit 2 on a bad trace line or policy name.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest

from connectors.offload.simulator import mooncake_chains, simulate
from kvconnector_core.cli import main as cli_main
from kvconnector_core.engine._trace import (
    MooncakeRecord,
    mooncake_prompt_length,
    mooncake_to_trace,
    read_mooncake,
)
from kvconnector_core.engine.engine import Engine, EngineConfig

SLICE = (Path(__file__).resolve().parents[1] / "core" / "data" / "mooncake"
         / "conversation_head.jsonl")
BS = 16


def _conversations(seed: int = 0, convs: int = 6, turns: int = 5) -> list[MooncakeRecord]:
    """Multi-turn chats on two system prompts, turns interleaved, in Mooncake's form."""
    rng = random.Random(seed)
    next_id = 10
    chains = [[u % 2] for u in range(convs)]
    out = []
    for turn in range(turns):
        for c, chain in enumerate(chains):
            grow = rng.randint(1, 3)
            chain += range(next_id, next_id + grow)
            next_id += grow
            out.append(MooncakeRecord(timestamp=float(turn * 100 + c), line_number=len(out) + 1,
                                      input_length=512 * len(chain) - rng.choice((0, 200)),
                                      output_length=5, hash_ids=list(chain)))
    return out


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_simulate_counts_the_tier_hits_of_the_connector_driven_by_the_engine(policy: str
                                                                            ) -> None:
    """One request at a time, no GPU prefix caching: every hit is the tier's."""
    records = _conversations()
    capacity = 40  # below the trace's 100+ chunks: evictions and policy choices matter
    chains = mooncake_chains(records, tokens_per_id=BS, chunk_tokens=BS)
    [sim] = simulate(chains, [policy], [capacity])
    trace = mooncake_to_trace(records, "chats", tokens_per_id=BS)
    for i, req in enumerate(trace.requests):
        req.max_new_tokens = 1  # generated tokens would complete chunks simulate leaves out
        req.arrival = 10.0 * i  # its stores complete before the next request looks up
    longest = max(mooncake_prompt_length(r, BS) for r in records)
    eng = Engine(EngineConfig(
        num_gpu_blocks=(longest + 8) // BS + 2, block_size=BS, max_model_len=longest + 8,
        max_num_batched_tokens=longest + 8, max_num_seqs=1, enable_prefix_caching=False,
        connector={"name": "cpu_offload", "extra_config": {
            "num_cpu_blocks": capacity, "cache_policy": policy}}))
    result = eng.run(trace)
    eng.shutdown()
    assert sim.hits > 0
    assert result.metrics.connector_hit_tokens == BS * sim.hits


def test_simulate_drives_a_million_chunk_lookups_in_seconds() -> None:
    records = _conversations(convs=300, turns=30)
    chains = mooncake_chains(records, tokens_per_id=512, chunk_tokens=128)
    asked = sum(c.loadable for c in chains)
    start = time.process_time()
    [result] = simulate(chains, ["arc"], [20_000])
    seconds = time.process_time() - start
    assert result.asked == asked and asked > 1_000_000
    assert seconds < 30  # CPU time: about 2 s per million lookups on one unloaded core


def test_simulate_prints_hit_rate_per_policy_and_capacity(
        capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli_main(["simulate", "--trace", str(SLICE), "--policies", "lru,arc",
                   "--capacities", "64,512", "--json"])
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["policy"], r["capacity"]) for r in rows] == [
        ("lru", 64), ("lru", 512), ("arc", 64), ("arc", 512)]
    assert all(0 < r["hit_rate"] < 1 and r["asked"] == rows[0]["asked"] for r in rows)
    assert rows[0]["asked"] == sum(c.loadable for c in mooncake_chains(read_mooncake(SLICE)))


def test_an_unknown_policy_is_one_line_naming_the_nearest_and_exit_2(
        capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli_main(["simulate", "--trace", str(SLICE), "--policies", "lru,ark"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and "unknown cache policy 'ark' (did you mean 'arc'?)" in err


def test_a_malformed_mooncake_line_is_one_line_naming_line_and_field_and_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    lines = SLICE.read_text().splitlines()[:3]
    bad.write_text("\n".join([*lines, '{"timestamp": 1, "input_length": 5, "output_length": 1, '
                              '"hash_ids": "x"}']) + "\n")
    rc = cli_main(["simulate", "--trace", str(bad)])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and f"{bad}:4:" in err and "$.hash_ids" in err
