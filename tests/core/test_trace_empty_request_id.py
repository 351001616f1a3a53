"""An empty ``request_id`` in a JSONL trace is an error that names the file and the line."""

from __future__ import annotations

import json

import pytest

from kvconnector_core.engine.workloads import TraceFormatError, load_trace_jsonl


@pytest.mark.parametrize("bad_id", ["", "   "], ids=["empty", "blank"])
def test_empty_request_id_is_an_error_naming_the_line(tmp_path, bad_id):
    """A trace line whose ``request_id`` is empty (or blank) is refused, naming line and field."""
    good = {"arrival": 0, "prompt_token_ids": [1], "max_new_tokens": 2, "request_id": "a"}
    bad = {**good, "request_id": bad_id}
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(TraceFormatError) as info:
        load_trace_jsonl(path)
    assert info.value.line_number == 2
    assert info.value.field == "$.request_id"
    assert "t.jsonl:2:" in str(info.value) and "request_id is empty" in str(info.value)


def test_trace_without_request_ids_still_loads(tmp_path):
    """Leaving ``request_id`` out stays valid: the engine assigns the ids."""
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"arrival": 0, "prompt_token_ids": [1], "max_new_tokens": 2}) + "\n")
    assert load_trace_jsonl(path).requests[0].request_id is None
