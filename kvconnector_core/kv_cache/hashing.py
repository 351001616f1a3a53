"""Chained, collision-resistant hashing of full token blocks.

A block's hash covers its parent's hash, its token ids and its extra keys, so
equal hashes mean equal *prefixes*, not just equal blocks. The digest is
sha256 over a msgpack encoding: unlike Python's ``hash()`` it is stable across
processes and machines (connectors use it as a storage key) and collisions are
not a practical concern.

Extra keys, in order: the LoRA name (every block), then the request's
``cache_salt`` (first block only, which through chaining separates the whole
sequence, so tenants with different salts never share a block). The two are
hashed in separate domains by position: a salted first block always has the
pair ``(lora_name, cache_salt)``, ``None`` standing for "no LoRA", so a salt can
never hash like a LoRA name of the same spelling (``cache_salt="x"`` gives
``(None, "x")``, LoRA ``"x"`` gives ``("x",)``).

Block hashes are keys shared with other processes and engines (tiers, routers):
tests pin known digests, so any change to this module that changes them fails.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, NewType

import msgspec

__all__ = [
    "NONE_HASH",
    "BlockHash",
    "BlockHashWithGroupId",
    "generate_block_extra_keys",
    "get_block_hash",
    "get_group_id",
    "hash_block_tokens",
    "hash_request_tokens",
    "make_block_hash_with_group_id",
]

# NewTypes, as in vLLM: bytes at run time (no wrapper object, no copy), distinct types for
# a type checker, so a group-keyed hash or an arbitrary ``bytes`` cannot pass as a BlockHash.
BlockHash = NewType("BlockHash", bytes)
"""A 32-byte sha256 digest identifying a block and everything before it."""

BlockHashWithGroupId = NewType("BlockHashWithGroupId", bytes)
"""A :data:`BlockHash` followed by the KV cache group id as 4 big-endian bytes."""

_encode = msgspec.msgpack.Encoder().encode
_sha256 = hashlib.sha256

NONE_HASH = BlockHash(_sha256(b"kvconnector-none-hash").digest())
"""The parent hash used for the first block of every sequence."""


def hash_block_tokens(
    parent_block_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> BlockHash:
    """Hash one full block.

    Args:
        parent_block_hash: hash of the previous block, or None for the first block.
        token_ids: the block's token ids.
        extra_keys: extra keys that must also match (LoRA name, cache salt), or None.

    Returns:
        The block's 32-byte digest.
    """
    if parent_block_hash is None:
        parent_block_hash = NONE_HASH
    return BlockHash(_sha256(_encode((parent_block_hash, token_ids, extra_keys))).digest())


def generate_block_extra_keys(
    block_index: int, lora_name: str | None, cache_salt: str | None
) -> tuple[Any, ...] | None:
    """Return the extra keys of block ``block_index`` of a request (None if it has none).

    A salted first block is ``(lora_name or None, cache_salt)``: the salt's position,
    not its value, keeps it apart from LoRA names (see the module docstring).
    """
    if block_index == 0 and cache_salt is not None:
        return (lora_name, cache_salt)
    if lora_name is not None:
        return (lora_name,)
    return None


def hash_request_tokens(
    token_ids: Sequence[int],
    hash_block_size: int,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    existing: Sequence[BlockHash] = (),
) -> list[BlockHash]:
    """Hash every full block of ``token_ids`` that ``existing`` does not cover yet.

    Args:
        token_ids: all tokens of the sequence so far.
        hash_block_size: tokens per hashed block.
        lora_name: LoRA adapter name, part of every block's extra keys.
        cache_salt: per-request salt, part of the first block's extra keys.
        existing: hashes already computed for the leading blocks; hashing
            continues from the last of them.

    Returns:
        The hashes of the *new* full blocks only, in order.
    """
    start = len(existing)
    parent = existing[-1] if existing else None
    out: list[BlockHash] = []
    num_full = len(token_ids) // hash_block_size
    for i in range(start, num_full):
        lo = i * hash_block_size
        parent = hash_block_tokens(
            parent,
            token_ids[lo : lo + hash_block_size],
            generate_block_extra_keys(i, lora_name, cache_salt),
        )
        out.append(parent)
    return out


def make_block_hash_with_group_id(block_hash: BlockHash, group_id: int) -> BlockHashWithGroupId:
    """Key a block hash by KV cache group, so groups never share cache entries."""
    return BlockHashWithGroupId(block_hash + group_id.to_bytes(4, "big"))


def get_block_hash(key: BlockHashWithGroupId) -> BlockHash:
    """Return the block hash part of a group-keyed hash."""
    return BlockHash(key[:-4])


def get_group_id(key: BlockHashWithGroupId) -> int:
    """Return the KV cache group id part of a group-keyed hash."""
    return int.from_bytes(key[-4:], "big")
