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
    assert generate_block_extra_keys(0, None, "salt") == (None, "salt")
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
    """The salted chain is the first block with (None, "salt") then plain blocks."""
    toks = list(range(8))
    h0 = hash_block_tokens(None, toks[:4], (None, "s"))
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
    assert make_block_hash_with_group_id(NONE_HASH, 0) != make_block_hash_with_group_id(
        NONE_HASH, 1
    )


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


def test_cache_salt_and_lora_name_hash_in_separate_domains():
    """cache_salt="x" and LoRA "x" give different first-block hashes (not both keyed ("x",))."""
    toks = list(range(8))
    salted = hash_request_tokens(toks, 4, cache_salt="x")
    lora = hash_request_tokens(toks, 4, lora_name="x")
    assert salted[0] != lora[0]
    assert generate_block_extra_keys(0, None, "x") != generate_block_extra_keys(0, "x", None)


# Known digests: block hashes key CPU tiers, remote stores and routers in other processes, so
# they must never change by accident (a new root hash, encoding or extra-key layout).
PINNED_NONE_HASH = "1a934b767e2984d067e669df6c49438bbaa2bca4287090494073d60615255609"
PINNED_CHAINS = {
    "plain": (
        {},
        [
            "3be2930760d15a70d296413d76c5aa62334193fd3ca8f49adce61478d59b1827",
            "222ce2594f77642247a6ee3ff1fd310408dd60750d5e2a81d22aba28b71dae5b",
        ],
    ),
    "salt": (
        {"cache_salt": "x"},
        [
            "4c5e45a957335d54906725e751c09cd9b683ded81c93f15b3757996b94fa7ccf",
            "e8d7e6ba23f0225e086e9f26fb7fe837361e8f16267f0294a514f059848a5ec2",
        ],
    ),
    "lora": (
        {"lora_name": "x"},
        [
            "e5a672535f4fdbd6308618f34808b32fc34f2ac0d6b64920162c4c8c37ef8131",
            "27f09e7dacf45bf8294dd24fc05cc44f06d2b7209d099f0ddd13f7b4002b13e5",
        ],
    ),
    "both": (
        {"lora_name": "x", "cache_salt": "x"},
        [
            "5a8d421f857f716c40f4447795aa1ba9ce2de1c267de633561df7d5b553dfcbd",
            "109b904286734184009ebf2363fd236b63d16e54123f2298a363110851b82e6c",
        ],
    ),
}


@pytest.mark.parametrize("case", sorted(PINNED_CHAINS))
def test_block_hashes_are_pinned(case):
    """Tokens 0..7 in blocks of 4 hash to known digests (plain, salted, LoRA, both)."""
    assert NONE_HASH.hex() == PINNED_NONE_HASH
    kwargs, expected = PINNED_CHAINS[case]
    assert [h.hex() for h in hash_request_tokens(list(range(8)), 4, **kwargs)] == expected


def test_block_hashes_are_the_same_in_another_process():
    """A fresh interpreter with another PYTHONHASHSEED computes the pinned digests too."""
    import os
    import subprocess
    import sys

    code = (
        "from kvconnector_core.kv_cache.hashing import NONE_HASH, hash_request_tokens as h; "
        "print(NONE_HASH.hex(), "
        "*(x.hex() for x in h(list(range(8)), 4, lora_name='x', cache_salt='x')))"
    )
    for seed in ("0", "12345"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            check=True,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout.split()
        assert out == [PINNED_NONE_HASH, *PINNED_CHAINS["both"][1]]
