"""The checksum frame of a tier value: magic ``KVT1``, payload length (8 bytes), CRC-32
over the key and the payload (4 bytes), then the payload.

A truncated, corrupted or misplaced value (stored under another key) fails its check.
A payload may be checked in parts (read straight into the rows of a CPU slot) without
joining them.

Primitives: frame_header, frame_value, unframe_value, payload_length, header_matches,
intact_payload, HEADER_BYTES, and the read outcomes PLACED, ABSENT, DAMAGED, OTHER_SIZE,
FAILED.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from connectors.offload.tiers.records import TierKey

__all__ = ["ABSENT", "DAMAGED", "FAILED", "HEADER_BYTES", "OTHER_SIZE", "PLACED", "frame_header",
           "frame_value", "header_matches", "intact_payload", "payload_length", "unframe_value"]

_MAGIC = b"KVT1"
_DIGEST = 4
_HEADER = len(_MAGIC) + 8 + _DIGEST


def _digest(key: TierKey, *parts: bytes | memoryview) -> bytes:
    """CRC-32 over the key and the payload (given in consecutive parts).

    The shard's tag is part of the key, so one rank's value copied under another rank's
    key fails its check; a key without a shard (one worker) digests as before shards.
    """
    crc = zlib.crc32(key.group.to_bytes(4, "big"), zlib.crc32(key.block_hash))
    if key.shard is not None:
        crc = zlib.crc32(key.shard.tag.encode(), crc)
    for part in parts:
        crc = zlib.crc32(part, crc)
    return crc.to_bytes(_DIGEST, "big")


def frame_header(key: TierKey, payload: bytes | memoryview) -> bytes:
    """The frame that goes before ``payload`` stored under ``key``: magic, length, digest."""
    return b"".join((_MAGIC, len(payload).to_bytes(8, "big"), _digest(key, payload)))


def frame_value(key: TierKey, payload: bytes | memoryview) -> bytes:
    """Wrap ``payload`` for storage under ``key``: magic, length, digest, payload."""
    return frame_header(key, payload) + payload


def payload_length(header: bytes | memoryview) -> int | None:
    """The payload length a frame header announces (None: not a frame header)."""
    if len(header) < _HEADER or bytes(header[:4]) != _MAGIC:
        return None
    return int.from_bytes(header[4:12], "big")


def header_matches(key: TierKey, header: bytes | memoryview, parts: Sequence[memoryview]) -> bool:
    """True if ``parts`` (a payload read in pieces) is intact under ``key``'s ``header``."""
    return _digest(key, *parts) == bytes(header[12:_HEADER])


def unframe_value(key: TierKey, value: bytes | None) -> bytes | None:
    """Return the payload of a framed ``value`` read for ``key``, or None if it is not intact.

    None covers a missing value, a foreign or truncated one, and a digest mismatch
    (corruption, or a value stored under another key).
    """
    payload = intact_payload(key, value)
    return None if payload is None else bytes(payload)


def intact_payload(key: TierKey, value: bytes | None) -> memoryview | None:
    """The payload of ``value`` as a view (no copy), or None if it is not intact."""
    if value is None or payload_length(value) != len(value) - _HEADER:
        return None
    payload = memoryview(value)[_HEADER:]
    return payload if header_matches(key, value, [payload]) else None


HEADER_BYTES = _HEADER
"""Bytes of the frame before the payload."""

# Outcomes of reading one value into its destination (see ``SecondaryTier._get_into``).
PLACED, ABSENT, DAMAGED, OTHER_SIZE, FAILED = "placed", "absent", "damaged", "other size", "failed"
