"""Workload generators and the JSONL trace format."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvconnector_core.errors import ConfigError
from kvconnector_core.engine.workloads import (
    WORKLOADS,
    Trace,
    TraceFormatError,
    TraceRequest,
    UnknownWorkloadError,
    dump_trace_jsonl,
    get_workload,
    load_trace_jsonl,
    multi_turn_chat,
    private_prefixes,
    repeated_documents,
)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_named_workloads_are_deterministic_sorted_and_unique(name):
    """Same seed -> same trace; other seed -> other tokens; sorted by arrival; unique ids."""
    a, b, c = get_workload(name, 0), get_workload(name, 0), get_workload(name, 1)
    assert a == b
    assert [r.prompt_token_ids for r in a] != [r.prompt_token_ids for r in c]
    arrivals = [r.arrival for r in a]
    assert arrivals == sorted(arrivals)
    ids = [r.request_id for r in a]
    assert None not in ids and len(set(ids)) == len(ids)


def test_chat_turn_extends_previous_turn():
    """Turn t = turn t-1 prompt + synthetic answer + user tokens; users share the system prompt."""
    trace = multi_turn_chat(7, num_users=3, turns=4, system_prompt_len=20, user_turn_len=5,
                            max_new_tokens=3, vocab=50)
    by_id = {r.request_id: r.prompt_token_ids for r in trace}
    for u in range(3):
        for t in range(1, 4):
            prev, cur = by_id[f"chat-u{u}-t{t - 1}"], by_id[f"chat-u{u}-t{t}"]
            assert cur[:len(prev)] == prev and len(cur) == len(prev) + 3 + 5
        assert by_id[f"chat-u{u}-t0"][:20] == by_id["chat-u0-t0"][:20]
    assert by_id["chat-u1-t0"][20:] != by_id["chat-u0-t0"][20:]
    assert all(0 <= tok < 50 for r in trace for tok in r.prompt_token_ids)


def test_documents_are_reused_and_private_prefixes_salted():
    """Each document is asked questions_per_doc times; private prefixes carry per-user salts."""
    docs = repeated_documents(3, num_docs=4, doc_len=30, questions_per_doc=3, question_len=4)
    prefixes: dict[tuple[int, ...], int] = {}
    for r in docs:
        key = tuple(r.prompt_token_ids[:30])
        prefixes[key] = prefixes.get(key, 0) + 1
    assert sorted(prefixes.values()) == [3, 3, 3, 3]
    priv = private_prefixes(3, num_users=3, prefix_len=10, requests_per_user=2, suffix_len=2,
                            identical_prefix_tokens=True)
    assert {tuple(r.prompt_token_ids[:10]) for r in priv} == {
        tuple(priv.requests[0].prompt_token_ids[:10])
    }
    assert {r.cache_salt for r in priv} == {"user-0", "user-1", "user-2"}
    distinct = private_prefixes(3, num_users=3, prefix_len=10, requests_per_user=1, suffix_len=2)
    assert len({tuple(r.prompt_token_ids[:10]) for r in distinct}) == 3


def test_chat_large_scale():
    """The benchmark chat trace has >= 1000 requests and about 1.3M prompt tokens."""
    trace = get_workload("chat_large")
    assert len(trace) >= 1000
    assert 1_200_000 <= trace.num_prompt_tokens <= 1_400_000


def test_bad_sizes_and_unknown_workload():
    """Invalid sizes and names raise ConfigError subclasses naming the value and choices."""
    with pytest.raises(ConfigError, match="num_users must be >= 1, got 0"):
        multi_turn_chat(num_users=0)
    with pytest.raises(UnknownWorkloadError, match="valid workloads: chat, chat_large, documents"):
        get_workload("nope")


_requests = st.builds(
    TraceRequest,
    arrival=st.floats(0, 1e6, allow_nan=False),
    prompt_token_ids=st.lists(st.integers(0, 2**31), min_size=1, max_size=20),
    max_new_tokens=st.integers(1, 100),
    cache_salt=st.none() | st.text(max_size=5),
    request_id=st.none(),
)


@settings(max_examples=25, deadline=None)
@given(requests=st.lists(_requests, max_size=8))
def test_jsonl_roundtrip(tmp_path_factory, requests):
    """dump -> load gives the same requests (sorted by arrival), named after the file."""
    path = tmp_path_factory.mktemp("t") / "mine.jsonl"
    dump_trace_jsonl(requests, path)
    loaded = load_trace_jsonl(path)
    assert loaded == Trace("mine", sorted(requests, key=lambda r: r.arrival))


@pytest.mark.parametrize(
    ("line", "field", "needle"),
    [
        (
            '{"arrival": 0, "prompt_token_ids": [1], "max_new_tokens": "x"}',
            "$.max_new_tokens",
            "int",
        ),
        (
            '{"arrival": 0, "prompt_token_ids": [1, -3], "max_new_tokens": 2}',
            "$.prompt_token_ids[1]",
            ">= 0",
        ),
        (
            '{"arrival": 0, "prompt_token_ids": [], "max_new_tokens": 2}',
            "$.prompt_token_ids",
            "length",
        ),
        ('{"arrival": 0, "max_new_tokens": 2}', None, "prompt_token_ids"),
        (
            '{"arrival": 0, "prompt_token_ids": [1], "max_new_tokens": 2, "x": 1}',
            None,
            "unknown field",
        ),
        (
            '{"arrival": 0, "prompt_token_ids": [1], "max_new_tokens": 2, "request_id": "a"}',
            "$.request_id",
            "duplicate request_id 'a'",
        ),
        ("{not json", None, "not a JSON object"),
    ],
    ids=[
        "wrong-type",
        "negative-token",
        "empty-prompt",
        "missing-field",
        "unknown-field",
        "duplicate-id",
        "bad-json",
    ],
)
def test_bad_jsonl_names_line_and_field(tmp_path, line, field, needle):
    """Errors name the file, the 1-based line number and the field."""
    good = {"arrival": 0, "prompt_token_ids": [1], "max_new_tokens": 2, "request_id": "a"}
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(good) + "\n\n" + line + "\n")
    with pytest.raises(TraceFormatError) as info:
        load_trace_jsonl(path)
    assert info.value.line_number == 3
    assert f"bad.jsonl:3:" in str(info.value) and needle in str(info.value)
    if field is not None:
        assert info.value.field == field


def test_jsonl_token_outside_vocab_names_line_and_range(tmp_path):
    path = tmp_path / "v.jsonl"
    path.write_text(
        '{"arrival": 0, "prompt_token_ids": [1], "max_new_tokens": 1}\n\n'
        '{"arrival": 0, "prompt_token_ids": [5, 100], "max_new_tokens": 1}\n'
    )
    assert len(load_trace_jsonl(path)) == 2  # no vocabulary given: not checked
    with pytest.raises(TraceFormatError) as info:
        load_trace_jsonl(path, vocab_size=100)
    assert info.value.line_number == 3 and info.value.field == "$.prompt_token_ids[1]"
    assert f"{path}:3:" in str(info.value) and "0..99" in str(info.value)
