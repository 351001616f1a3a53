"""Tests for Request: tokens, status and incrementally maintained block hashes (request.py)."""

from __future__ import annotations

import pytest

from kvconnector_core.errors import ConfigError
from kvconnector_core.kv_cache.hashing import hash_request_tokens
from kvconnector_core.request import Request, RequestStatus


def test_new_request_state():
    """A new request is WAITING with nothing computed and the prompt as all its tokens."""
    r = Request("r", [1, 2, 3], 5)
    assert r.status is RequestStatus.WAITING
    assert r.num_computed_tokens == 0 and r.num_preemptions == 0
    assert r.prompt_token_ids == [1, 2, 3] and r.all_token_ids == [1, 2, 3]
    assert r.output_token_ids == []
    assert (r.num_tokens, r.num_prompt_tokens, r.num_output_tokens) == (3, 3, 0)
    assert not r.is_finished()


def test_prompt_is_copied():
    """Mutating the caller's list does not change the request."""
    toks = [1, 2, 3]
    r = Request("r", toks, 1)
    toks.append(4)
    assert r.prompt_token_ids == [1, 2, 3] and r.num_tokens == 3


def test_empty_prompt_is_config_error():
    """An empty prompt is rejected with the request id in the message."""
    with pytest.raises(ConfigError, match="'r0'.*empty"):
        Request("r0", [], 1)


def test_bad_max_tokens_is_config_error():
    """max_tokens below 1 is rejected."""
    with pytest.raises(ConfigError, match="max_tokens=0"):
        Request("r", [1], 0)


def test_no_hashes_without_hash_block_size():
    """Without a hash block size the request has no block hashes."""
    assert Request("r", list(range(32)), 1).block_hashes == []


def test_block_hashes_cover_full_prompt_blocks():
    """block_hashes are the chained hashes of every full prompt block."""
    r = Request("r", list(range(10)), 1, hash_block_size=4)
    assert r.block_hashes == hash_request_tokens(list(range(10)), 4)
    assert len(r.block_hashes) == 2


def test_block_hashes_grow_with_output():
    """Appending output tokens extends block_hashes as blocks fill, matching a fresh hash."""
    r = Request("r", list(range(7)), 10, hash_block_size=4)
    assert len(r.block_hashes) == 1
    r.append_output_token_ids(100)
    assert len(r.block_hashes) == 2
    r.append_output_token_ids([101, 102, 103])
    assert len(r.block_hashes) == 2
    r.append_output_token_ids(104)
    assert len(r.block_hashes) == 3
    assert r.block_hashes == hash_request_tokens(r.all_token_ids, 4)


def test_append_updates_token_lists():
    """Appended tokens land in output_token_ids and all_token_ids."""
    r = Request("r", [1, 2], 4)
    r.append_output_token_ids(3)
    r.append_output_token_ids([4, 5])
    assert r.output_token_ids == [3, 4, 5]
    assert r.all_token_ids == [1, 2, 3, 4, 5]
    assert r.num_tokens == 5 and r.num_output_tokens == 3


def test_salt_and_lora_enter_hashes():
    """cache_salt and lora_name change the request's block hashes."""
    toks = list(range(8))
    plain = Request("a", toks, 1, hash_block_size=4).block_hashes
    salted = Request("b", toks, 1, hash_block_size=4, cache_salt="s").block_hashes
    lora = Request("c", toks, 1, hash_block_size=4, lora_name="l").block_hashes
    assert salted == hash_request_tokens(toks, 4, cache_salt="s")
    assert lora == hash_request_tokens(toks, 4, lora_name="l")
    assert len({plain[1], salted[1], lora[1]}) == 3


def test_output_hashes_keep_salt_chain():
    """Hashes of generated blocks continue the salted chain."""
    r = Request("r", list(range(4)), 8, hash_block_size=4, cache_salt="s")
    r.append_output_token_ids([9, 9, 9, 9])
    assert r.block_hashes == hash_request_tokens(r.all_token_ids, 4, cache_salt="s")


@pytest.mark.parametrize(
    "status,finished",
    [
        (RequestStatus.WAITING, False),
        (RequestStatus.WAITING_FOR_REMOTE_KVS, False),
        (RequestStatus.RUNNING, False),
        (RequestStatus.PREEMPTED, False),
        (RequestStatus.FINISHED_STOPPED, True),
        (RequestStatus.FINISHED_LENGTH_CAPPED, True),
        (RequestStatus.FINISHED_ABORTED, True),
        (RequestStatus.FINISHED_ERROR, True),
    ],
)
def test_finished_states(status, finished):
    """Only FINISHED_* statuses count as finished."""
    r = Request("r", [1], 1)
    r.status = status
    assert r.is_finished() is finished
    assert RequestStatus.is_finished(status) is finished


def test_optional_attributes_kept():
    """cache_salt, lora_name, arrival_time and eos_token_id are stored as given."""
    r = Request("r", [1], 1, cache_salt="s", lora_name="l", arrival_time=3.5, eos_token_id=2)
    assert (r.cache_salt, r.lora_name, r.arrival_time, r.eos_token_id) == ("s", "l", 3.5, 2)


def test_repr_names_request():
    """repr shows the id, token counts and status."""
    text = repr(Request("rid-1", [1, 2], 1))
    assert "rid-1" in text and "WAITING" in text
