"""Mooncake's public trace format: detection, expansion into prompts, scaling, errors.

The slice ``tests/core/data/mooncake/conversation_head.jsonl`` is the head of Mooncake's
FAST'25 conversation trace (Apache-2.0, ``kvcache-ai/Mooncake``; see its README).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvconnector_core.cli import main as cli_main
from kvconnector_core.engine._trace import (
    MooncakeRecord,
    TraceFormatError,
    detect_trace_format,
    load_trace,
    mooncake_to_trace,
    read_mooncake,
)

SLICE = Path(__file__).resolve().parent / "data" / "mooncake" / "conversation_head.jsonl"


def _rec(ids: list[int], input_length: int, ts: float = 0.0, out: int = 10) -> MooncakeRecord:
    return MooncakeRecord(timestamp=ts, input_length=input_length, output_length=out,
                          hash_ids=ids)


def test_a_mooncake_file_is_detected_and_a_jsonl_file_is_not(tmp_path: Path) -> None:
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text('{"arrival": 0, "prompt_token_ids": [1, 2], "max_new_tokens": 1}\n')
    assert detect_trace_format(SLICE) == "mooncake"
    assert detect_trace_format(jsonl) == "jsonl"


def test_equal_hash_ids_give_equal_blocks_and_chains_share_their_prefix() -> None:
    trace = mooncake_to_trace([_rec([1, 2, 3], 3 * 512), _rec([1, 2, 4], 3 * 512)], "t",
                              tokens_per_id=16)
    a, b = (r.prompt_token_ids for r in trace.requests)
    assert len(a) == len(b) == 48
    assert a[:32] == b[:32] and a[32:] != b[32:]


def test_tokens_per_id_scales_the_prompt_and_cuts_the_last_block_by_input_length() -> None:
    # 2 full blocks and 256 of 512 tokens of the third: at 16 tokens per id, 32 + 8 tokens.
    trace = mooncake_to_trace([_rec([1, 2, 3], 2 * 512 + 256, out=64)], "t", tokens_per_id=16)
    req = trace.requests[0]
    assert len(req.prompt_token_ids) == 40 and req.max_new_tokens == 2
    full = mooncake_to_trace([_rec([1, 2, 3], 2 * 512 + 256)], "t")
    assert len(full.requests[0].prompt_token_ids) == 2 * 512 + 256


def test_timestamps_become_arrival_steps_in_order() -> None:
    trace = mooncake_to_trace([_rec([1], 10, ts=3000), _rec([2], 10, ts=500)], "t",
                              ms_per_step=1000)
    assert [r.arrival for r in trace.requests] == [0.5, 3.0]


def test_limit_and_sample_scale_the_trace_down_deterministically() -> None:
    assert len(read_mooncake(SLICE)) == 300
    assert len(read_mooncake(SLICE, limit=25)) == 25
    half = read_mooncake(SLICE, sample=0.5, seed=1)
    assert 100 < len(half) < 200
    assert half == read_mooncake(SLICE, sample=0.5, seed=1)
    assert len(load_trace(SLICE, limit=7, tokens_per_id=16)) == 7


@pytest.mark.parametrize(("line", "field"), [
    ('{"timestamp": 0, "input_length": 10, "output_length": 3}', None),
    ('{"timestamp": 0, "input_length": "x", "output_length": 3, "hash_ids": [1]}',
     "$.input_length"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 3, "hash_ids": [1], "z": 1}', None),
    ("not json", None),
])
def test_a_malformed_mooncake_line_names_its_line_and_field(tmp_path: Path, line: str,
                                                            field: str | None) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(SLICE.read_text().splitlines()[0] + "\n\n" + line + "\n")
    with pytest.raises(TraceFormatError) as info:
        read_mooncake(path)
    assert info.value.line_number == 3
    assert f"{path}:3:" in str(info.value)
    if field is not None:
        assert info.value.field == field


def test_kvconnector_run_reads_a_mooncake_trace(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli_main(["run", "--trace", str(SLICE), "--tokens-per-id", "16", "--limit", "3",
                   "--connector", "none", "--no-baseline", "--json"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["workload"] == "conversation_head"
    assert report["metrics"]["num_requests"] == 3 and report["metrics"]["num_finished"] == 3
