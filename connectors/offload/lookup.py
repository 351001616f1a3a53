"""Window-aware hits of the CPU offload tier for models with several KV cache groups.

A hit of ``end`` tokens needs, per group, only what the group reads to go on from there
(:func:`needed_chunks`): every chunk for full attention, the last window's chunks for a
sliding-window group, the current attention chunk's for a chunked-local group.
:func:`longest_hit` finds the longest such hit with one lookup per chunk and O(1) per
candidate end.

Primitives: :func:`needed_chunks`, :func:`longest_hit`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from connectors.offload.config import OffloadGroup
    from connectors.offload.manager import OffloadKey

__all__ = ["longest_hit", "needed_chunks"]


def needed_chunks(group: OffloadGroup, start_tokens: int, end_tokens: int, chunk_tokens: int
                  ) -> range:
    """Chunks of ``group`` whose KV must be on the GPU to continue after ``end_tokens``
    tokens, given the first ``start_tokens`` are there already (partial chunks count)."""
    first = max(group.first_needed_token(end_tokens), start_tokens)
    return range(first // chunk_tokens, -(-end_tokens // chunk_tokens))


def longest_hit(groups: Sequence[OffloadGroup], lookup: Callable[[Iterable[OffloadKey]], int],
                key: Callable[[int, int], OffloadKey], *, num_computed_tokens: int, num_chunks: int,
                last_loadable: int, chunk_tokens: int) -> int:
    """Tokens past ``num_computed_tokens`` that the tier can serve (0: no hit).

    Args:
        groups: the KV cache groups, in index order.
        lookup: the tier's lookup: how many of the keys, from the first, are ready. It
            gets a lazy iterable for full-attention groups, so keys past the first miss
            are never built (the cost of a miss is O(1), not O(prompt chunks)).
        key: ``key(group, chunk)``, the offload key of a chunk of a group.
        num_computed_tokens: tokens already on the GPU (the local hit).
        num_chunks: whole chunks the request's block hashes cover.
        last_loadable: the last token a hit may end at (the engine computes the last
            prompt token itself).
        chunk_tokens: tokens per offloaded chunk.
    """
    ct = chunk_tokens
    start = num_computed_tokens // ct
    # Full-attention groups bound the hit by their leading run of ready chunks.
    best = num_chunks
    for g, group in enumerate(groups):
        if group.is_full:
            best = min(best, start + lookup(key(g, c) for c in range(start, num_chunks)))
    # Windowed groups: the longest hit whose window is held. One lookup per chunk,
    # then O(1) per candidate end (counts of missing chunks before each chunk).
    windowed = []
    for g, group in enumerate(groups):
        if not group.is_full:
            missing = [0]  # missing[c - start]: chunks in [start, c) not ready
            for c in range(start, best):
                missing.append(missing[-1] + (lookup([key(g, c)]) == 0))
            windowed.append((group, missing))
    for n in range(best, start, -1):
        end = min(n * ct, last_loadable)
        if end <= num_computed_tokens:
            break
        for group, missing in windowed:
            chunks = needed_chunks(group, num_computed_tokens, end, ct)
            if missing[chunks.stop - start] != missing[chunks.start - start]:
                break
        else:
            return end - num_computed_tokens
    return 0
