"""The rig's stub model: writes a deterministic byte pattern per block hash, layer and rank.

No weights and no arithmetic: a "forward" writes, into every layer of each block a step
computes, bytes derived from the block's vLLM hash (and the layer and the worker, since TP
ranks hold different shards). Any block a connector later loads, or vLLM serves from its
prefix cache, can then be checked against its hash (:class:`~.check.ByteOracle`).

As attention does, a forward depends on the KV its tokens attend to: when a block before
a request's first scheduled token holds wrong bytes (a load that did not happen yet, or
failed), the blocks the forward writes for that request get wrong bytes too (the
pattern's complement), and stay wrong until recomputed from good KV. So KV computed on
a failed or late load shows wherever vLLM keeps it, even after the bad block itself was
rewritten.

Primitives: :class:`StubModel`, :data:`EOS`.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["EOS", "StubModel"]

EOS = 2
"""The stub model config's end-of-sequence token (never sampled: requests ignore EOS)."""


class StubModel:
    """Writes and predicts the bytes of KV blocks in vLLM's per-worker KV cache tensors.

    Args:
        kv_caches: per worker, vLLM's layer name -> KV cache tensor (``allocate_kv_cache``).
        group_layers: per KV cache group, its layers as (index in the model, name).
        block_size: tokens per block.
    """

    def __init__(self, kv_caches: list[dict[str, torch.Tensor]],
                 group_layers: list[list[tuple[int, str]]], block_size: int) -> None:
        self.kv_caches = kv_caches
        self.group_layers = group_layers
        self.block_size = block_size
        # async scheduling: blocks a step filled before their last token was known (so
        # before their hash): (request id, group, block index, block id), written once known
        self.unhashed: list[tuple[str, int, int, int]] = []
        # (worker, block id) of blocks part of which was computed on wrong KV
        self.tainted: set[tuple[int, int]] = set()

    @staticmethod
    def pattern(block_hash: bytes, layer: int, numel: int, worker: int = 0) -> torch.Tensor:
        """The values a block with this hash holds in this layer on this worker."""
        seed = torch.frombuffer(bytearray(bytes(block_hash)[:32]), dtype=torch.int8).clone()
        seed[0] = seed[0] + layer
        seed[1] = seed[1] + worker
        return seed.repeat(-(-numel // seed.numel()))[:numel]

    def expected(self, block_hash: bytes, layer: int, view: torch.Tensor,
                 worker: int) -> torch.Tensor:
        """What ``view`` (one layer of one block) must hold for this hash."""
        return self.pattern(block_hash, layer, view.numel(), worker).view(view.shape)

    def write(self, block_id: int, block_hash: bytes | None, group: int = 0,
              worker: int | None = None) -> None:
        """Write a block's bytes in every layer of its group, on one worker or on all (-1
        when the block is not full, so it has no hash yet; the pattern's complement when
        part of it was computed on wrong KV)."""
        if block_id == 0:  # vLLM's null block (a sliding-window position out of the window)
            return
        for w, caches in enumerate(self.kv_caches):
            if worker is not None and w != worker:
                continue
            for layer, name in self.group_layers[group]:
                view = caches[name][block_id]
                if block_hash is None:
                    view.fill_(-1)
                elif (w, block_id) in self.tainted:
                    view.copy_(~self.expected(block_hash, layer, view, w))
                else:
                    view.copy_(self.expected(block_hash, layer, view, w))

    def loaded(self, block_ids: list[int]) -> None:
        """A connector load writes these blocks whole: what they held before is gone."""
        self.tainted -= {(w, b) for w in range(len(self.kv_caches)) for b in block_ids}

    def wipe(self) -> None:
        """Zero every KV byte (after a prefix-cache reset only loads can restore them)."""
        for caches in self.kv_caches:
            for t in caches.values():
                t.zero_()
        self.tainted.clear()

    def forward(self, scheduler: Any, so: Any,
                worker: int = 0) -> tuple[list[str], list[list[int]]]:
        """One worker's forward of a scheduler output: write the blocks its tokens fill, in
        that worker's tensors only (each worker computes after its own load hooks, as in
        vLLM). Returns (request ids, sampled tokens): one token per request whose prompt
        is done."""
        req_ids, sampled = [], []
        bs = self.block_size
        pending = {bid for _, _, _, bid in self.unhashed}
        for rid, n in so.num_scheduled_tokens.items():
            req = scheduler.requests[rid]
            end = req.num_computed_tokens  # already advanced by schedule()
            start = end - n
            groups = scheduler.kv_cache_manager.get_block_ids(rid)
            bad = not self._context_holds(req, groups, start, worker, pending)
            for g, block_ids in enumerate(groups):
                for i in range(start // bs, -(-end // bs)):
                    key = (worker, block_ids[i])
                    if bad or (i * bs < start and key in self.tainted):
                        self.tainted.add(key)
                    else:
                        self.tainted.discard(key)
                    full = i < len(req.block_hashes) and (i + 1) * bs <= end
                    self.write(block_ids[i], req.block_hashes[i] if full else None, g, worker)
                    if not full and (i + 1) * bs <= end and worker == 0:
                        self.unhashed.append((rid, g, i, block_ids[i]))
            req_ids.append(rid)
            sampled.append([1000 + len(req.output_token_ids)] if end >= req.num_tokens else [])
        return req_ids, sampled

    def _context_holds(self, req: Any, groups: Any, start: int, worker: int,
                       pending: set[int]) -> bool:
        """Whether every full block before token ``start`` (what the step's tokens attend
        to) holds its hash's bytes on this worker; blocks still waiting for their hash
        (async scheduling) and vLLM's null block are taken as good."""
        full = min(start // self.block_size, len(req.block_hashes))
        caches = self.kv_caches[worker]
        for g, block_ids in enumerate(groups):
            for i, bid in enumerate(block_ids[:full]):
                if bid == 0 or bid in pending:
                    continue
                for layer, name in self.group_layers[g]:
                    view = caches[name][bid]
                    if not torch.equal(view, self.expected(req.block_hashes[i], layer, view,
                                                           worker).to(view.dtype)):
                        return False
        return True

    def write_hashed(self, scheduler: Any) -> None:
        """Async scheduling: give blocks whose hash is now known their bytes (the model
        wrote them in the step that filled them; the rig learns the hash later)."""
        waiting = []
        for rid, g, i, bid in self.unhashed:
            req = scheduler.requests.get(rid)
            ids = scheduler.kv_cache_manager.get_block_ids(rid)[g] if req is not None else []
            if i >= len(ids) or ids[i] != bid:
                continue  # freed or preempted: nothing to write
            if i < len(req.block_hashes):
                self.write(bid, req.block_hashes[i], g)
            else:
                waiting.append((rid, g, i, bid))
        self.unhashed = waiting
