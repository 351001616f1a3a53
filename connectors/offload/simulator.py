"""A capacity planner: the CPU offload tier's manager driven alone over a trace.

Each request of a trace becomes a chain of offload keys, one per chunk of its prompt, and
is driven through a :class:`~connectors.offload.manager.CPUOffloadingManager` the way
``OffloadingConnector`` drives it with ``recency="all_keys"`` (vLLM 0.33's rule) when the
GPU prefix cache cannot serve the request (a GPU pool that holds one request at a time):
look up the leading ready chunks (at most those before the prompt's last token, which
the engine always computes), load them, offer the rest of the prompt's full chunks for
storing, complete the store, and commit the request's recency when it finishes.

What it models: the tier's contents, its policy's decisions (evictions, ghosts, adaptive
target, request-scoped recency) and its hit counts, request after request in arrival
order. What it leaves out: the GPU prefix cache (nothing is served before the tier),
requests running at the same time (each finishes before the next starts, so nothing is
pinned by another request and stores complete at once), chunked prefill (a prompt's
chunks are offered in one store, so a prompt longer than the tier is never stored,
where the connector would store its head), generated tokens (only prompt chunks are
stored), transfer time and failures.

Keys: a Mooncake hash id stands for ``tokens_per_id`` tokens (512, the trace's own, by
default; prompt lengths are expanded as ``kvconnector run`` expands them) and splits into
``tokens_per_id / chunk_tokens`` offload chunks; a chunk's key is a hash of the chain of
ids and chunk offsets up to it, so chains share keys exactly as far as they share a
prefix. Tier capacities are in chunks: with the defaults one chunk is one hash id.

Primitives: :func:`mooncake_chains`, :func:`simulate`, :class:`SimResult`,
:func:`drive_request`.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from connectors.offload.manager import CPUOffloadingManager, OffloadKey, RequestAccess
from kvconnector_core.engine._trace import MooncakeRecord, mooncake_prompt_length

__all__ = ["Chain", "SimResult", "drive_request", "mooncake_chains", "simulate"]

_GROUP = bytes(4)


@dataclass(frozen=True, slots=True)
class Chain:
    """One request as the tier sees it.

    Attributes:
        keys: the keys of its prompt's full chunks, head first.
        loadable: how many leading keys a load may cover (chunks before the last token).
    """

    keys: list[OffloadKey]
    loadable: int


@dataclass(frozen=True, slots=True)
class SimResult:
    """Hit counts of one (policy, capacity) run.

    Attributes:
        policy: the cache policy's name.
        capacity: tier size in chunks.
        hits: chunks served by the tier.
        asked: chunks looked up (the loadable chunks of every request).
        seconds: wall time of the run.
    """

    policy: str
    capacity: int
    hits: int
    asked: int
    seconds: float

    @property
    def hit_rate(self) -> float:
        """hits / asked (0 when nothing was asked)."""
        return self.hits / self.asked if self.asked else 0.0


def mooncake_chains(records: Sequence[MooncakeRecord], tokens_per_id: int = 512,
                    chunk_tokens: int = 512) -> list[Chain]:
    """The chunk key chain of every Mooncake request, in arrival order (stable).

    Args:
        records: the trace.
        tokens_per_id: tokens a hash id stands for (as ``kvconnector run --tokens-per-id``;
            prompt lengths are expanded the same way).
        chunk_tokens: tokens per offload chunk (the connector's ``block_size *
            blocks_per_chunk``); must divide ``tokens_per_id``.

    Raises:
        ValueError: ``chunk_tokens`` does not divide ``tokens_per_id``.
    """
    per_id, rest = divmod(tokens_per_id, chunk_tokens)
    if rest or not per_id:
        msg = f"chunk_tokens {chunk_tokens} must divide tokens_per_id {tokens_per_id}"
        raise ValueError(msg)
    known: dict[tuple[bytes, int], bytes] = {}
    chains: list[Chain] = []
    for rec in sorted(records, key=lambda r: r.timestamp):
        length = mooncake_prompt_length(rec, tokens_per_id)
        keys: list[OffloadKey] = []
        prev = b""
        for i in range(length // chunk_tokens):
            hash_id, sub = divmod(i, per_id)
            link = (prev, rec.hash_ids[hash_id] * per_id + sub)
            digest = known.get(link)
            if digest is None:
                raw = prev + link[1].to_bytes(8, "big")
                digest = known[link] = hashlib.blake2b(raw, digest_size=16).digest()
            prev = digest
            keys.append(OffloadKey(digest + _GROUP))
        chains.append(Chain(keys, (length - 1) // chunk_tokens))
    return chains


def drive_request(manager: CPUOffloadingManager, chain: Chain) -> int:
    """One request's offload protocol, as the connector drives it; returns its tier hits."""
    keys = chain.keys
    access = RequestAccess(position={k: i + 1 for i, k in enumerate(keys)})
    hits = manager.lookup(keys[:chain.loadable])
    if hits:
        loaded = keys[:hits]
        manager.prepare_load(loaded, access)
        manager.complete_load(loaded)
    out = manager.prepare_store(keys[hits:] if hits else keys, access)
    if out is not None and out.keys_to_store:
        manager.complete_store(out.keys_to_store)
    if access.seen:
        position = access.position
        manager.finish_request(sorted(access.seen, key=position.__getitem__), access.reused,
                               access.stored_only)
    return hits


def simulate(chains: Sequence[Chain], policies: Sequence[str], capacities: Sequence[int],
             progress: Callable[[SimResult], None] | None = None) -> list[SimResult]:
    """Run every (policy, capacity) pair over ``chains``, each on a fresh manager.

    Raises:
        ConfigError: an unknown policy name (the message names the nearest one).
    """
    asked = sum(c.loadable for c in chains)
    results: list[SimResult] = []
    for policy in policies:
        for capacity in capacities:
            manager = CPUOffloadingManager(capacity, cache_policy=policy)
            start = time.perf_counter()
            hits = sum(drive_request(manager, chain) for chain in chains)
            result = SimResult(policy, capacity, hits, asked, time.perf_counter() - start)
            results.append(result)
            if progress is not None:
                progress(result)
    return results
