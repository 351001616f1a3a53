"""Tests for KV cache specs, admission caps and pool sizing (kv_cache/kv_cache_spec.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvconnector_core.errors import ConfigError
from kvconnector_core.kv_cache.kv_cache_spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
    cdiv,
    get_kv_cache_config,
)


def full(bs=16, heads=8, head=128, dtype="bfloat16"):
    return FullAttentionSpec(block_size=bs, num_kv_heads=heads, head_size=head, dtype=dtype)


def swa(sw, bs=16, heads=8, head=128, dtype="bfloat16"):
    return SlidingWindowSpec(
        block_size=bs, num_kv_heads=heads, head_size=head, dtype=dtype, sliding_window=sw
    )


def chunked(chunk, bs=16, heads=8, head=128, dtype="bfloat16"):
    return ChunkedLocalAttentionSpec(
        block_size=bs, num_kv_heads=heads, head_size=head, dtype=dtype, attention_chunk_size=chunk
    )


# -- page size ------------------------------------------------------------------------


def test_page_size_bytes_counts_k_and_v():
    """A page holds K and V: 2 * block_size * heads * head_size * dtype bytes."""
    assert full().page_size_bytes == 2 * 16 * 8 * 128 * 2


@pytest.mark.parametrize(
    "dtype,nbytes", [("float32", 4), ("float16", 2), ("bfloat16", 2), ("float8_e4m3fn", 1)]
)
def test_page_size_bytes_scales_with_dtype(dtype, nbytes):
    """The page size scales with the element size of the dtype."""
    assert full(bs=4, heads=2, head=8, dtype=dtype).page_size_bytes == 2 * 4 * 2 * 8 * nbytes


def test_page_size_same_for_all_attention_kinds():
    """Sliding-window and chunked pages are sized like full-attention pages."""
    assert swa(64).page_size_bytes == full().page_size_bytes == chunked(64).page_size_bytes


# -- admission caps -----------------------------------------------------------------------


def test_full_attention_cap_is_cdiv_max_model_len():
    """Full attention may need every block of max_model_len: cdiv(mml, bs)."""
    spec = full(bs=16)
    assert (
        spec.max_admission_blocks_per_request(max_num_batched_tokens=64, max_model_len=4096) == 256
    )
    assert spec.max_admission_blocks_per_request(max_num_batched_tokens=64, max_model_len=100) == 7


def test_sliding_window_cap_formula():
    """SWA cap is cdiv(min(sw - 1 + mnbt, mml), bs) + 1."""
    spec = swa(128, bs=16)
    # min(127 + 64, 4096) = 191 -> cdiv(191, 16) = 12, + 1
    assert (
        spec.max_admission_blocks_per_request(max_num_batched_tokens=64, max_model_len=4096) == 13
    )


def test_sliding_window_cap_clamped_by_max_model_len():
    """A window longer than max_model_len is capped at max_model_len (plus the mid-block slack)."""
    spec = swa(4096, bs=16)
    assert (
        spec.max_admission_blocks_per_request(max_num_batched_tokens=64, max_model_len=100)
        == cdiv(100, 16) + 1
    )


def test_chunked_local_cap_formula():
    """Chunked local cap is cdiv(min(chunk + mnbt, mml), bs)."""
    spec = chunked(256, bs=16)
    assert (
        spec.max_admission_blocks_per_request(max_num_batched_tokens=64, max_model_len=4096) == 20
    )
    assert spec.max_admission_blocks_per_request(max_num_batched_tokens=64, max_model_len=100) == 7


@given(
    sw=st.integers(1, 2000),
    bs=st.sampled_from([1, 2, 4, 16]),
    mnbt=st.integers(1, 512),
    mml=st.integers(1, 8192),
)
def test_sliding_window_cap_property(sw, bs, mnbt, mml):
    """The SWA cap matches the formula for any sizes."""
    spec = SlidingWindowSpec(block_size=bs, sliding_window=sw)
    got = spec.max_admission_blocks_per_request(max_num_batched_tokens=mnbt, max_model_len=mml)
    assert got == -(-min(sw - 1 + mnbt, mml) // bs) + 1


@given(
    chunk=st.integers(1, 2000),
    bs=st.sampled_from([1, 2, 4, 16]),
    mnbt=st.integers(1, 512),
    mml=st.integers(1, 8192),
)
def test_chunked_cap_property(chunk, bs, mnbt, mml):
    """The chunked-local cap matches the formula for any sizes."""
    spec = ChunkedLocalAttentionSpec(block_size=bs, attention_chunk_size=chunk)
    got = spec.max_admission_blocks_per_request(max_num_batched_tokens=mnbt, max_model_len=mml)
    assert got == -(-min(chunk + mnbt, mml) // bs)


@pytest.mark.parametrize("spec", [full(), swa(128), chunked(256)], ids=["full", "swa", "chunked"])
def test_max_memory_usage_uses_the_cap(spec):
    """max_memory_usage_bytes is the admission cap times the page size."""
    cap = spec.max_admission_blocks_per_request(max_num_batched_tokens=64, max_model_len=4096)
    assert (
        spec.max_memory_usage_bytes(max_model_len=4096, max_num_batched_tokens=64)
        == cap * spec.page_size_bytes
    )


def test_sliding_window_needs_less_memory_than_full():
    """A short window needs far less memory per request than full attention."""
    assert (
        swa(128).max_memory_usage_bytes(max_model_len=32768, max_num_batched_tokens=64)
        < full().max_memory_usage_bytes(max_model_len=32768, max_num_batched_tokens=64) // 10
    )


def test_spec_kinds():
    """Each spec reports its kind name for KV events."""
    assert full().kind == "full_attention"
    assert swa(8).kind == "sliding_window"
    assert chunked(8).kind == "chunked_local_attention"


# -- validation --------------------------------------------------------------------------


def test_unknown_dtype_is_config_error():
    """An unknown dtype names itself and the known dtypes."""
    with pytest.raises(ConfigError, match=r"dtype='fp7'.*bfloat16"):
        full(dtype="fp7")


@pytest.mark.parametrize("bs", [0, -4, 2.5])
def test_bad_block_size_is_config_error(bs):
    """A block size that is not a positive int is rejected."""
    with pytest.raises(ConfigError, match="block_size"):
        FullAttentionSpec(block_size=bs)


@pytest.mark.parametrize("kw", [{"num_kv_heads": 0}, {"head_size": 0}])
def test_bad_heads_is_config_error(kw):
    """Zero heads or head size is rejected."""
    with pytest.raises(ConfigError):
        FullAttentionSpec(block_size=4, **kw)


def test_bad_window_and_chunk_are_config_errors():
    """A sliding window or chunk size below 1 is rejected."""
    with pytest.raises(ConfigError, match="sliding_window=0"):
        SlidingWindowSpec(block_size=4)
    with pytest.raises(ConfigError, match="attention_chunk_size=0"):
        ChunkedLocalAttentionSpec(block_size=4)


def test_config_errors_are_value_errors():
    """ConfigError is a ValueError, so generic handlers catch it."""
    with pytest.raises(ValueError):
        full(dtype="nope")


def test_kv_cache_config_validation():
    """KVCacheConfig needs at least 2 blocks and one group."""
    with pytest.raises(ConfigError, match="num_blocks=1"):
        KVCacheConfig(num_blocks=1, kv_cache_groups=[KVCacheGroupSpec(["a"], full())])
    with pytest.raises(ConfigError, match="kv_cache_groups"):
        KVCacheConfig(num_blocks=4, kv_cache_groups=[])


def test_specs_are_hashable_and_equal_by_value():
    """Equal specs compare and hash equal (they key layer grouping)."""
    assert full() == full() and hash(full()) == hash(full())
    assert swa(8) != swa(16)


# -- get_kv_cache_config --------------------------------------------------------------------


def test_get_kv_cache_config_sizes_pool_from_budget():
    """num_blocks is the budget divided by the bytes one block id costs across all layers."""
    spec = full(bs=16, heads=1, head=8)
    layers = {"l0": spec, "l1": spec}
    per_block = 2 * spec.page_size_bytes
    cfg = get_kv_cache_config(
        layers, per_block * 300 + 5, max_model_len=1024, max_num_batched_tokens=64
    )
    assert cfg.num_blocks == 300
    assert len(cfg.kv_cache_groups) == 1
    assert cfg.kv_cache_groups[0].layer_names == ["l0", "l1"]
    assert cfg.bytes_per_block == per_block


def test_get_kv_cache_config_groups_by_spec_full_first():
    """Layers are grouped by equal spec, full-attention groups first, layer order kept."""
    f, s = full(bs=16, heads=1, head=8), swa(32, bs=16, heads=1, head=8)
    layers = {"s0": s, "f0": f, "s1": s, "f1": f}
    cfg = get_kv_cache_config(layers, 10**8, max_model_len=1024, max_num_batched_tokens=64)
    assert [g.kv_cache_spec for g in cfg.kv_cache_groups] == [f, s]
    assert [g.layer_names for g in cfg.kv_cache_groups] == [["f0", "f1"], ["s0", "s1"]]
    # Equal page sizes: the two groups share one physical pool of 2 layer slots.
    assert cfg.physical_pools == [[0, 1]]
    assert cfg.bytes_per_block == 2 * f.page_size_bytes


def test_groups_of_different_page_size_do_not_share_memory():
    f, s = full(bs=16, heads=1, head=8), swa(32, bs=16, heads=2, head=8)
    cfg = get_kv_cache_config(
        {"f0": f, "s0": s, "s1": s}, 10**8, max_model_len=1024, max_num_batched_tokens=64
    )
    assert cfg.physical_pools == [[0], [1]]
    assert cfg.bytes_per_block == f.page_size_bytes + 2 * s.page_size_bytes


def test_get_kv_cache_config_too_small_budget_names_numbers():
    """A budget that cannot hold one max_model_len request raises ConfigError with the numbers."""
    spec = full(bs=16, heads=1, head=8)
    page = spec.page_size_bytes
    # one request of 1024 tokens needs 64 blocks + the null block
    with pytest.raises(ConfigError, match=r"available_memory=.*64 blocks.*65 blocks"):
        get_kv_cache_config({"l0": spec}, page * 64, max_model_len=1024, max_num_batched_tokens=64)
    cfg = get_kv_cache_config(
        {"l0": spec}, page * 65, max_model_len=1024, max_num_batched_tokens=64
    )
    assert cfg.num_blocks == 65


def test_get_kv_cache_config_sliding_window_uses_cap():
    """A sliding-window-only model fits a budget far below max_model_len's worth of blocks."""
    spec = swa(32, bs=16, heads=1, head=8)
    cap = spec.max_admission_blocks_per_request(max_num_batched_tokens=64, max_model_len=100_000)
    budget = spec.page_size_bytes * (cap + 1)
    cfg = get_kv_cache_config(
        {"l0": spec}, budget, max_model_len=100_000, max_num_batched_tokens=64
    )
    assert cfg.num_blocks == cap + 1
    with pytest.raises(ConfigError):
        get_kv_cache_config(
            {"l0": spec}, budget - 1, max_model_len=100_000, max_num_batched_tokens=64
        )


def test_get_kv_cache_config_no_layers():
    """An empty layer map is a ConfigError."""
    with pytest.raises(ConfigError, match="layer_specs"):
        get_kv_cache_config({}, 10**6, max_model_len=16, max_num_batched_tokens=16)
