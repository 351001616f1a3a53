"""Tests for chained block hashing (kvconnector_core.kv_cache.hashing)."""

from __future__ import annotations

import hashlib

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvconnector_core.kv_cache.hashing import (
    NONE_HASH,
    generate_block_extra_keys,
    get_block_hash,
    get_group_id,
    hash_block_tokens,
    hash_request_tokens,
    make_block_hash_with_group_id,
)


def test_hash_block_tokens_is_sha256_of_parent_tokens_extra():
    """A block hash is sha256 over (parent, tokens, extra keys), not Python's hash()."""
    parent = hashlib.sha256(b"p").digest()
    got = hash_block_tokens(parent, [1, 2, 3], ("lora",))
    want = hashlib.sha256(msgspec.msgpack.encode((parent, [1, 2, 3], ("lora",)))).digest()
    assert got == want
    assert isinstance(got, bytes) and len(got) == 32


def test_first_block_uses_none_hash_as_parent():
    """A block without a parent is hashed with NONE_HASH as its parent."""
    assert hash_block_tokens(None, [7, 8]) == hash_block_tokens(NONE_HASH, [7, 8])


def test_only_full_blocks_are_hashed():
    """A trailing partial block gets no hash."""
    assert len(hash_request_tokens(list(range(11)), 4)) == 2
    assert len(hash_request_tokens(list(range(12)), 4)) == 3
    assert hash_request_tokens([1, 2, 3], 4) == []


def test_hashes_are_chained():
    """Each block's hash is computed from the previous block's hash."""
    toks = list(range(12))
    hashes = hash_request_tokens(toks, 4)
    h0 = hash_block_tokens(None, toks[0:4])
    h1 = hash_block_tokens(h0, toks[4:8])
    h2 = hash_block_tokens(h1, toks[8:12])
    assert hashes == [h0, h1, h2]


def test_same_block_different_prefix_differs():
    """Equal tokens after different prefixes hash differently (hash identifies the prefix)."""
    a = hash_request_tokens([1, 2, 9, 9], 2)
    b = hash_request_tokens([3, 4, 9, 9], 2)
    assert a[1] != b[1]


def test_hashes_are_stable_across_calls():
    """Hashing the same tokens twice gives identical digests."""
    toks = [5, 3, 1, 4, 1, 5, 9, 2]
    assert hash_request_tokens(toks, 2, lora_name="a", cache_salt="s") == hash_request_tokens(
        toks, 2, lora_name="a", cache_salt="s"
    )


def test_none_hash_is_deterministic_sha256():
    """NONE_HASH is a fixed sha256 digest (same in every process)."""
    assert isinstance(NONE_HASH, bytes) and len(NONE_HASH) == 32


def test_incremental_hashing_matches_full_hashing():
    """Continuing from existing hashes gives the same chain as hashing everything at once."""
    toks = list(range(20))
    full = hash_request_tokens(toks, 4)
    head = hash_request_tokens(toks[:9], 4)
    tail = hash_request_tokens(toks, 4, existing=head)
    assert head + tail == full


def test_cache_salt_only_in_first_block_extra_keys():
    """The cache salt is an extra key of block 0 only."""
    assert generate_block_extra_keys(0, None, "salt") == ("salt",)
    assert generate_block_extra_keys(1, None, "salt") is None
    assert generate_block_extra_keys(0, None, None) is None


def test_lora_name_in_every_block_extra_keys_before_salt():
    """The LoRA name is an extra key of every block, ahead of the salt."""
    assert generate_block_extra_keys(0, "lora-a", "salt") == ("lora-a", "salt")
    assert generate_block_extra_keys(3, "lora-a", "salt") == ("lora-a",)


def test_different_salts_never_share_any_block():
    """Different cache salts change every block hash (through the chain)."""
    toks = list(range(16))
    a = hash_request_tokens(toks, 4, cache_salt="tenant-a")
    b = hash_request_tokens(toks, 4, cache_salt="tenant-b")
    none = hash_request_tokens(toks, 4)
    assert set(a).isdisjoint(b)
    assert set(a).isdisjoint(none)


def test_salt_hash_matches_explicit_extra_keys():
    """The salted chain is the first block with ("salt",) then plain blocks."""
    toks = list(range(8))
    h0 = hash_block_tokens(None, toks[:4], ("s",))
    h1 = hash_block_tokens(h0, toks[4:], None)
    assert hash_request_tokens(toks, 4, cache_salt="s") == [h0, h1]


def test_lora_name_changes_every_block():
    """Different LoRA adapters never share a block hash."""
    toks = list(range(16))
    a = hash_request_tokens(toks, 4, lora_name="a")
    b = hash_request_tokens(toks, 4, lora_name="b")
    assert all(x != y for x, y in zip(a, b))


@given(st.binary(min_size=32, max_size=32), st.integers(min_value=0, max_value=2**32 - 1))
def test_group_id_round_trip(block_hash, group_id):
    """make_block_hash_with_group_id splits back into the hash and the group id."""
    key = make_block_hash_with_group_id(block_hash, group_id)
    assert get_block_hash(key) == block_hash
    assert get_group_id(key) == group_id
    assert key[-4:] == group_id.to_bytes(4, "big")


def test_group_keys_differ_per_group():
    """One block hash keyed by two groups gives two distinct keys."""
    assert make_block_hash_with_group_id(NONE_HASH, 0) != make_block_hash_with_group_id(NONE_HASH, 1)


@given(st.lists(st.integers(min_value=0, max_value=50_000), max_size=40), st.integers(1, 8))
def test_prefix_property(tokens, bs):
    """The hashes of a prefix are a prefix of the hashes of the whole sequence."""
    full = hash_request_tokens(tokens, bs)
    assert len(full) == len(tokens) // bs
    cut = len(tokens) // 2
    assert hash_request_tokens(tokens[:cut], bs) == full[: cut // bs]


@pytest.mark.parametrize("bs", [1, 3, 16])
def test_hash_block_size_changes_chunking(bs):
    """A block covers exactly hash_block_size tokens."""
    toks = list(range(48))
    hashes = hash_request_tokens(toks, bs)
    assert hashes[0] == hash_block_tokens(None, toks[:bs])
