"""Tests for the KV event structs and their msgpack wire form (kvconnector_core/kv_events.py)."""

from __future__ import annotations

import importlib.util

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

import _vllm033_events
from kvconnector_core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_event_batch,
    encode_event_batch,
    to_external_hash,
)

# vLLM 0.33 field order (reference §5).
STORED_FIELDS = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
]
REMOVED_FIELDS = ["block_hashes", "medium", "group_idx", "locality", "ownership"]


def stored(**kw) -> BlockStored:
    fields = dict(
        block_hashes=[2**64 - 1, 7],
        parent_block_hash=None,
        token_ids=[1, 2, 3, 4],
        block_size=2,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    fields.update(kw)
    return BlockStored(**fields)


def sample_batch() -> KVEventBatch:
    return KVEventBatch(
        ts=1757500000.25,
        events=[
            stored(
                extra_keys=[("salt",), None],
                group_idx=1,
                kv_cache_spec_kind="sliding_window",
                kv_cache_spec_sliding_window=128,
            ),
            BlockRemoved(block_hashes=[7], medium="GPU", group_idx=1),
            AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )


def vllm_033_batch_type():
    """Independent replica of vLLM 0.33's event structs (reference §5), to cross-decode."""
    return (
        _vllm033_events.KVEventBatch,
        _vllm033_events.BlockStored,
        _vllm033_events.BlockRemoved,
        _vllm033_events.AllBlocksCleared,
    )


# -- round trip ----------------------------------------------------------------------------------


def test_batch_round_trip():
    """A batch with all three event kinds survives encode/decode unchanged."""
    batch = sample_batch()
    back = decode_event_batch(encode_event_batch(batch))
    assert back == batch
    assert [type(e) for e in back.events] == [BlockStored, BlockRemoved, AllBlocksCleared]


def test_round_trip_with_bytes_hashes():
    """Hashes in raw-bytes form round-trip too (ExternalBlockHash = bytes | int)."""
    batch = KVEventBatch(
        ts=1.0, events=[stored(block_hashes=[b"\x01" * 32], parent_block_hash=b"\x02" * 32)]
    )
    assert decode_event_batch(encode_event_batch(batch)) == batch


def test_decode_rejects_garbage():
    """Decoding something that is not a KV event batch raises a msgspec error."""
    with pytest.raises(msgspec.DecodeError):
        decode_event_batch(msgspec.msgpack.encode({"not": "a batch"}))


# -- wire layout ---------------------------------------------------------------------------------


def test_struct_field_order_matches_vllm():
    """BlockStored and BlockRemoved declare vLLM's fields in vLLM's order."""
    assert [f.name for f in msgspec.structs.fields(BlockStored)] == STORED_FIELDS
    assert [f.name for f in msgspec.structs.fields(BlockRemoved)] == REMOVED_FIELDS


def test_batch_encodes_as_array_ts_events_rank():
    """The batch envelope is an array: [ts, events, data_parallel_rank]."""
    raw = msgspec.msgpack.decode(encode_event_batch(sample_batch()))
    assert isinstance(raw, list)
    assert raw[0] == 1757500000.25
    assert len(raw[1]) == 3
    assert raw[2] == 0


def test_events_encode_in_field_order_with_type_tag():
    """Each event carries its class-name tag first, then its set fields in vLLM's order."""
    raw = msgspec.msgpack.decode(encode_event_batch(sample_batch()))
    ev_stored, ev_removed, ev_cleared = raw[1]
    items = list(ev_stored.items()) if isinstance(ev_stored, dict) else None
    assert items is not None, "vLLM 0.33 encodes events as tagged maps"
    assert items[0] == ("type", "BlockStored")
    keys = [k for k, _ in items[1:]]
    assert keys == [f for f in STORED_FIELDS if f in keys]
    assert keys[:7] == STORED_FIELDS[:7]  # required fields are always present
    assert ev_stored["block_hashes"] == [2**64 - 1, 7]
    assert ev_stored["kv_cache_spec_sliding_window"] == 128
    assert list(ev_removed) == ["type", "block_hashes", "medium", "group_idx"]
    assert ev_cleared == {"type": "AllBlocksCleared"}


def test_none_defaults_are_omitted():
    """Optional fields left at None are not put on the wire."""
    raw = msgspec.msgpack.decode(encode_event_batch(KVEventBatch(ts=0.0, events=[stored()])))
    assert set(raw[1][0]) == {"type", *STORED_FIELDS[:7]}


def test_vllm_consumer_decodes_our_batch():
    """A consumer using vLLM 0.33's structs decodes our batch field for field."""
    VBatch, VStored, VRemoved, VCleared = vllm_033_batch_type()
    ours = sample_batch()
    theirs = msgspec.msgpack.Decoder(VBatch).decode(encode_event_batch(ours))
    assert [type(e).__name__ for e in theirs.events] == [
        "BlockStored",
        "BlockRemoved",
        "AllBlocksCleared",
    ]
    s = theirs.events[0]
    assert s.block_hashes == ours.events[0].block_hashes
    assert s.extra_keys == [("salt",), None]
    assert s.group_idx == 1 and s.kv_cache_spec_sliding_window == 128
    assert theirs.events[1].block_hashes == [7]


def test_we_decode_a_vllm_batch():
    """decode_event_batch reads a batch encoded with vLLM 0.33's structs."""
    VBatch, VStored, VRemoved, VCleared = vllm_033_batch_type()
    theirs = VBatch(
        ts=2.5,
        events=[
            VStored(
                block_hashes=[11, 12],
                parent_block_hash=None,
                token_ids=list(range(8)),
                block_size=4,
                lora_id=None,
                medium="GPU",
                lora_name="a",
                extra_keys=[("a", "s"), ("a",)],
                group_idx=0,
            ),
            VRemoved(block_hashes=[11], medium="GPU", group_idx=0),
            VCleared(),
        ],
        data_parallel_rank=3,
    )
    ours = decode_event_batch(msgspec.msgpack.encode(theirs))
    assert ours.ts == 2.5 and ours.data_parallel_rank == 3
    assert ours.events[0] == stored(
        block_hashes=[11, 12],
        token_ids=list(range(8)),
        block_size=4,
        lora_name="a",
        extra_keys=[("a", "s"), ("a",)],
        group_idx=0,
    )
    assert ours.events[1] == BlockRemoved(block_hashes=[11], medium="GPU", group_idx=0)
    assert ours.events[2] == AllBlocksCleared()


def test_our_encoding_is_byte_identical_to_vllm():
    """Our batch and the same batch built from vLLM's structs encode to the same bytes."""
    VBatch, VStored, VRemoved, VCleared = vllm_033_batch_type()
    ours = KVEventBatch(
        ts=3.0,
        events=[
            stored(group_idx=0),
            BlockRemoved(block_hashes=[5], medium="CPU"),
            AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )
    theirs = VBatch(
        ts=3.0,
        events=[
            VStored(
                block_hashes=[2**64 - 1, 7],
                parent_block_hash=None,
                token_ids=[1, 2, 3, 4],
                block_size=2,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                group_idx=0,
            ),
            VRemoved(block_hashes=[5], medium="CPU"),
            VCleared(),
        ],
        data_parallel_rank=0,
    )
    assert encode_event_batch(ours) == msgspec.msgpack.encode(theirs)


def test_events_are_hashable():
    """Stored and removed events are hashable and equal events hash equal (for aggregation)."""
    assert hash(stored()) == hash(stored())
    assert hash(BlockRemoved(block_hashes=[1], medium="GPU")) == hash(
        BlockRemoved(block_hashes=[1], medium="GPU")
    )


# -- external hash ---------------------------------------------------------------------------------


def test_to_external_hash_is_last_8_bytes_big_endian():
    """The wire hash is the digest's last 8 bytes read big-endian."""
    digest = bytes(range(32))
    assert to_external_hash(digest) == int.from_bytes(bytes(range(24, 32)), "big")
    assert to_external_hash(b"\x00" * 24 + b"\x00" * 7 + b"\x01") == 1
    assert to_external_hash(b"\xff" * 32) == 2**64 - 1


@given(st.binary(min_size=32, max_size=32))
def test_to_external_hash_fits_uint64(digest):
    """Every wire hash fits msgpack's uint64 and ignores the leading 24 bytes."""
    h = to_external_hash(digest)
    assert 0 <= h < 2**64
    assert h == to_external_hash(b"\x00" * 24 + digest[-8:])


# -- AllBlocksCleared.medium -----------------------------------------------------------------------


def test_cleared_medium_is_a_trailing_optional_field():
    """medium defaults to None (every medium, the old meaning) and is omitted from the wire then."""
    assert [f.name for f in msgspec.structs.fields(AllBlocksCleared)] == ["medium"]
    assert AllBlocksCleared().medium is None
    raw = msgspec.msgpack.decode(
        encode_event_batch(
            KVEventBatch(ts=0.0, events=[AllBlocksCleared(), AllBlocksCleared(medium="CPU")])
        )
    )
    assert raw[1] == [{"type": "AllBlocksCleared"}, {"type": "AllBlocksCleared", "medium": "CPU"}]


def test_vllm_consumer_decodes_a_resync_batch():
    """vLLM 0.33's structs read a per-medium clear plus snapshot, every existing field intact."""
    VBatch, VStored, VRemoved, VCleared = vllm_033_batch_type()
    ours = KVEventBatch(
        ts=4.0,
        events=[
            AllBlocksCleared(medium="CPU"),
            stored(medium="CPU", lora_name="a", extra_keys=[("a",), ("a",)], group_idx=0),
            BlockRemoved(block_hashes=[3], medium="GPU", group_idx=0),
            AllBlocksCleared(),
        ],
        data_parallel_rank=1,
    )
    theirs = msgspec.msgpack.Decoder(VBatch).decode(encode_event_batch(ours))
    assert [type(e) for e in theirs.events] == [VCleared, VStored, VRemoved, VCleared]
    assert (theirs.ts, theirs.data_parallel_rank) == (4.0, 1)
    s = theirs.events[1]
    for name in STORED_FIELDS:
        assert getattr(s, name) == getattr(ours.events[1], name), name
    for name in REMOVED_FIELDS:
        assert getattr(theirs.events[2], name) == getattr(ours.events[2], name), name


def test_cleared_medium_round_trips_and_vllm_clears_read_as_every_medium():
    """Our decoder keeps the medium; a vLLM clear (no field) decodes as medium None."""
    VBatch, VStored, VRemoved, VCleared = vllm_033_batch_type()
    batch = KVEventBatch(ts=1.0, events=[AllBlocksCleared(medium="STORAGE")])
    assert decode_event_batch(encode_event_batch(batch)).events == [
        AllBlocksCleared(medium="STORAGE")
    ]
    back = decode_event_batch(msgspec.msgpack.encode(VBatch(ts=1.0, events=[VCleared()])))
    assert back.events == [AllBlocksCleared(medium=None)]


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="needs vLLM 0.33, installed only in its own venv (make vllm-venv)",
)
def test_real_vllm_decoder_reads_a_resync_batch():
    """Where vLLM 0.33 is installed, its own structs have the replica's layout and decode a
    batch with per-medium clears, every existing field intact."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # vLLM's import-time warnings are not ours
        from vllm.distributed import kv_events as vk
    assert [f.name for f in msgspec.structs.fields(vk.BlockStored)] == STORED_FIELDS
    assert [f.name for f in msgspec.structs.fields(vk.BlockRemoved)] == REMOVED_FIELDS
    ours = KVEventBatch(
        ts=5.0,
        events=[
            AllBlocksCleared(medium="CPU"),
            stored(medium="CPU", group_idx=0),
            BlockRemoved(block_hashes=[3], medium="GPU"),
            AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )
    theirs = msgspec.msgpack.Decoder(vk.KVEventBatch).decode(encode_event_batch(ours))
    assert [type(e) for e in theirs.events] == [
        vk.AllBlocksCleared,
        vk.BlockStored,
        vk.BlockRemoved,
        vk.AllBlocksCleared,
    ]
    for name in STORED_FIELDS:
        assert getattr(theirs.events[1], name) == getattr(ours.events[1], name), name
    assert theirs.events[2].block_hashes == [3] and theirs.events[2].medium == "GPU"
