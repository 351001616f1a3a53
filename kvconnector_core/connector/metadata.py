"""Records that cross the scheduler/worker boundary of a connector.

The scheduler-side and worker-side instances of a connector talk only through
two records, as if they lived in different processes:

- :class:`KVConnectorMetadata` (scheduler -> worker): the per-step plan built by
  ``build_connector_meta``. Every connector subclasses it; it travels inside the
  ``SchedulerOutput`` and must survive a msgpack round trip
  (:func:`check_metadata_roundtrip`).
- :class:`KVConnectorOutput` (worker -> scheduler): what the worker side
  finished, failed and observed this step, handed to ``update_connector_output``.

Both are msgspec Structs so the boundary stays serialisable by construction,
and so that a field without a default is caught when the record is defined,
not when it is first sent.

Primitives: :class:`KVConnectorMetadata`, :class:`KVConnectorOutput`,
:class:`KVConnectorTransferResults`,
:func:`check_metadata_roundtrip`, :func:`encode_metadata`, :func:`decode_metadata`,
:data:`WireKVCacheEvent`.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from kvconnector_core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

__all__ = [
    "KVConnectorMetadata",
    "KVConnectorOutput",
    "KVConnectorTransferResults",
    "WireKVCacheEvent",
    "check_metadata_roundtrip",
    "decode_metadata",
    "encode_metadata",
]

WireKVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
"""Every concrete KV cache event; the union msgspec decodes tagged events into."""

M = TypeVar("M", bound="KVConnectorMetadata")


class KVConnectorMetadata(msgspec.Struct, kw_only=True):
    """Base class of a connector's per-step plan (scheduler -> worker).

    Subclass it with the fields your worker side needs; give every field a
    default (``msgspec.field(default_factory=dict)`` for containers) so the
    record can grow without breaking older producers. Keep fields to types
    msgpack carries (ints, strings, bytes, lists, dicts, sets, nested Structs):
    the test kit checks ``msgspec.msgpack.decode(encode(meta), type=type(meta))
    == meta``. Declare the subclass on your connector as ``metadata_type`` so a
    wrapper (e.g. MultiConnector) can decode it on the worker side.

    The base is neither frozen nor tagged, so subclasses may choose either.
    """


class KVConnectorTransferResults(msgspec.Struct, kw_only=True):
    """Transfers a worker-side connector finished in one step (``get_transfer_results``).

    Attributes:
        finished_sending: requests whose saves all completed (each reported once).
        finished_recving: requests whose loads completed, failed ones included.
        failed_recving: the subset of ``finished_recving`` whose load failed.
    """

    finished_sending: set[str] = msgspec.field(default_factory=set)
    finished_recving: set[str] = msgspec.field(default_factory=set)
    failed_recving: set[str] = msgspec.field(default_factory=set)


class KVConnectorOutput(msgspec.Struct, kw_only=True):
    """What the worker side of a connector reports to the scheduler after a step.

    Built by the model runner from the worker-side hooks and handed to the
    scheduler, which passes it to the scheduler-side ``update_connector_output``.

    Attributes:
        finished_sending: requests whose asynchronous saves all completed this
            step; the scheduler may now free the blocks it kept because
            ``request_finished`` returned ``delay_free=True``. Each id is
            reported exactly once.
        finished_recving: requests whose asynchronous loads completed (or
            failed: a failed receive also appears here, so the scheduler stops
            waiting for it).
        failed_recving: the subset of ``finished_recving`` whose load failed;
            the scheduler recomputes them (or fails them, by policy).
        invalid_block_ids: GPU block ids whose KV could not be loaded
            (``get_block_ids_with_load_errors``); the scheduler rolls the
            owning requests back to the first invalid block.
        kv_connector_stats: the worker's ``get_kv_connector_stats()`` (None
            when it has nothing to report). Standard keys: ``bytes_loaded``,
            ``bytes_stored``, ``load_seconds``, ``store_seconds``.
        kv_cache_events: wire KV events emitted by the worker side.
        kv_connector_worker_meta: the worker side's
            ``build_connector_worker_meta()`` (None when it has nothing or does
            not define the hook): per-connector records for its own scheduler
            side, such as ids of finished transfer jobs. A typed channel, unlike
            the stats, which a wrapper aggregates and an engine reports. A
            MultiConnector carries one entry per child, by position.
        loads_failed: a worker hook failed so that this step's loads may not have
            run (set by the guard; see ``docs/failure-contract.md``).
        stores_failed: a worker hook failed so that this step's stores may not have
            run or may have read changed blocks; they must never become visible.
    """

    finished_sending: set[str] = msgspec.field(default_factory=set)
    finished_recving: set[str] = msgspec.field(default_factory=set)
    failed_recving: set[str] = msgspec.field(default_factory=set)
    invalid_block_ids: set[int] = msgspec.field(default_factory=set)
    kv_connector_stats: dict[str, Any] | None = None
    kv_cache_events: list[WireKVCacheEvent] = msgspec.field(default_factory=list)
    kv_connector_worker_meta: Any = None
    loads_failed: bool = False
    stores_failed: bool = False

    def is_empty(self) -> bool:
        """Return True when the output carries nothing for the scheduler to act on."""
        return not (
            self.finished_sending
            or self.finished_recving
            or self.failed_recving
            or self.invalid_block_ids
            or self.kv_connector_stats
            or self.kv_cache_events
            or self.kv_connector_worker_meta is not None
            or self.loads_failed
            or self.stores_failed
        )


_encoder = msgspec.msgpack.Encoder()


def encode_metadata(meta: KVConnectorMetadata) -> bytes:
    """Encode connector metadata to msgpack bytes.

    Args:
        meta: the metadata record (any :class:`KVConnectorMetadata` subclass).

    Returns:
        The msgpack encoding (no type tag; decode with :func:`decode_metadata`).
    """
    return _encoder.encode(meta)


def decode_metadata(payload: bytes | msgspec.Raw, metadata_type: type[M]) -> M:
    """Decode msgpack bytes produced by :func:`encode_metadata`.

    Args:
        payload: msgpack bytes (or a ``msgspec.Raw`` holding them).
        metadata_type: the connector's metadata class (its ``metadata_type``).

    Returns:
        The decoded record.

    Raises:
        msgspec.ValidationError: the payload does not match ``metadata_type``.
    """
    return msgspec.msgpack.decode(payload, type=metadata_type)


def check_metadata_roundtrip(meta: KVConnectorMetadata) -> KVConnectorMetadata:
    """Check that ``meta`` survives a msgpack round trip unchanged.

    The scheduler and worker sides of a connector must be able to live in
    different processes, so a plan that does not survive encoding is a bug
    even when the in-process engine never encodes it.

    Args:
        meta: the record returned by ``build_connector_meta``.

    Returns:
        The decoded copy (equal to ``meta``).

    Raises:
        TypeError: ``meta`` is not a :class:`KVConnectorMetadata`, cannot be
            encoded, or decodes to something different (the message names the
            type and both values).
    """
    if not isinstance(meta, KVConnectorMetadata):
        msg = (
            f"connector metadata must be a KVConnectorMetadata (msgspec.Struct) subclass, "
            f"got {type(meta).__qualname__}: {meta!r}"
        )
        raise TypeError(msg)
    try:
        decoded = decode_metadata(encode_metadata(meta), type(meta))
    except (msgspec.EncodeError, msgspec.ValidationError, TypeError) as exc:
        msg = f"{type(meta).__qualname__} does not survive msgpack: {exc}"
        raise TypeError(msg) from exc
    if decoded != meta:
        msg = (
            f"{type(meta).__qualname__} changes across a msgpack round trip: "
            f"{meta!r} became {decoded!r}"
        )
        raise TypeError(msg)
    return decoded
