"""The rig's byte oracle: every computed block of a running request holds its hash's bytes.

vLLM counts a request's first ``num_computed_tokens`` as computed. Each of its full blocks
was written by the stub model, a connector load, or an earlier request (a prefix-cache
hit): whichever it was, it must hold :meth:`~.model.StubModel.pattern` of its hash in every
layer of its group, on every worker. The oracle checks that and names each wrong block by
where it came from:

- ``loaded``: a connector load wrote it (noted from ``update_state_after_alloc``);
- ``prefix hit``: vLLM served it from its prefix cache (below the request's local hit, noted
  from ``get_num_new_matched_tokens``);
- ``computed``: the model wrote it in this request (so something overwrote it since).

Primitives: :class:`ByteOracle`, :class:`WrongBlock`.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import msgspec
import torch

from kvconnector_core.testing.vllm.model import StubModel
from kvconnector_core.testing.vllm.report import Stats

__all__ = ["ByteOracle", "WrongBlock"]


class WrongBlock(msgspec.Struct, frozen=True):
    """One layer of one block whose bytes differ from what the model wrote for its hash.

    Attributes:
        kind: ``loaded``, ``prefix hit`` or ``computed`` (see the module docstring).
        request_id: the running request that holds the block.
        block_index: the block's position in the request.
        block_id: vLLM's block id.
        block_hash: the block's hash (hex, first 8 bytes).
        layer: the layer's name.
        worker: the worker (TP rank).
        wrong_bytes: bytes that differ in this layer-block.
        looks_like: what the bytes are instead, when the oracle can tell: another
            worker's or layer's bytes for the same hash (a shard or layer mix-up), or
            all zeros (never written since the rig zeroed the cache); else empty.
    """

    kind: str
    request_id: str
    block_index: int
    block_id: int
    block_hash: str
    layer: str
    worker: int
    wrong_bytes: int

    looks_like: str = ""

    def describe(self) -> str:
        """One line naming the block."""
        differ = "byte differs" if self.wrong_bytes == 1 else "bytes differ"
        instead = f"; it holds {self.looks_like}" if self.looks_like else ""
        return (f"request {self.request_id} block #{self.block_index} (id {self.block_id}, hash "
                f"{self.block_hash}) layer {self.layer} worker {self.worker}: {self.wrong_bytes} "
                f"{differ} from what the model wrote for its hash ({self.kind} block){instead}")


class ByteOracle:
    """Checks the computed blocks of vLLM's running requests against the stub model.

    Args:
        model: the stub model (its tensors and patterns).
        scheduler: vLLM's scheduler.
        stats: where the counts go.
        raise_on_wrong: raise AssertionError at the first wrong block (test mode); else
            record it in :attr:`wrong` and go on (report mode).
    """

    def __init__(self, model: StubModel, scheduler: Any, stats: Stats, *,
                 raise_on_wrong: bool = True) -> None:
        self.model = model
        self.scheduler = scheduler
        self.stats = stats
        self.raise_on_wrong = raise_on_wrong
        self.loaded: set[int] = set()
        """Block ids a connector load wrote, not yet checked."""
        self.prefix_hits: dict[str, int] = {}
        """Request id -> blocks vLLM served it from its prefix cache at its last admission."""
        self.wrong: list[WrongBlock] = []
        """Wrong layer-blocks found (each layer-block and hash once)."""
        self._reported: set[tuple[int, bytes, str, int]] = set()

    def note_lookup(self, request_id: str, num_computed_tokens: int) -> None:
        """vLLM asked the connector about a request whose first tokens hit its prefix cache."""
        self.prefix_hits[request_id] = num_computed_tokens // self.model.block_size

    def note_load(self, block_ids: Collection[int]) -> None:
        """A connector load will write these blocks."""
        self.loaded.update(b for b in block_ids if b != 0)  # null: out of a sliding window

    def check_running(self, invalid: Collection[int] = ()) -> None:
        """Check every full computed block of every running request.

        Args:
            invalid: block ids a worker reported as failed loads in the step being
                processed: a request's blocks from the first of them on are not checked
                (vLLM rolls the request back to it in ``update_from_output``).

        Raises:
            AssertionError: in test mode, at the first wrong layer-block.
        """
        for block_id in invalid:
            self.loaded.discard(block_id)
        for req in list(self.scheduler.running):
            groups = self.scheduler.kv_cache_manager.get_block_ids(req.request_id)
            stop = _first_invalid(groups, invalid)
            for g, block_ids in enumerate(groups):
                self._check_group(req, g, block_ids, stop)

    def _check_group(self, req: Any, g: int, block_ids: list[int], stop: int) -> None:
        bs = self.model.block_size
        n_full = min(req.num_computed_tokens // bs, len(req.block_hashes), len(block_ids), stop)
        hits = self.prefix_hits.get(req.request_id, 0)
        for i in range(n_full):
            bid = block_ids[i]
            if bid == 0:  # left the sliding window: nothing to check
                continue
            kind = "loaded" if bid in self.loaded else "prefix hit" if i < hits else "computed"
            for w, caches in enumerate(self.model.kv_caches):
                for layer, name in self.model.group_layers[g]:
                    self._check_layer_block(req, i, bid, (w, layer, name), caches[name][bid], kind)
            self.loaded.discard(bid)

    def _check_layer_block(self, req: Any, index: int, bid: int, where: tuple[int, int, str],
                           view: torch.Tensor, kind: str) -> None:
        worker, layer, name = where
        block_hash = bytes(req.block_hashes[index])
        want = self.model.expected(block_hash, layer, view, worker).to(view.dtype)
        nbytes = view.numel() * view.element_size()
        self.stats.layer_blocks_checked += 1
        if kind == "loaded":
            self.stats.loaded_layer_blocks_checked += 1
            self.stats.bytes_loaded += nbytes
        elif kind == "prefix hit":
            self.stats.hit_layer_blocks_checked += 1
        if torch.equal(view, want):
            return
        got_bytes = view.contiguous().view(torch.uint8)
        wrong = int((got_bytes != want.view(torch.uint8)).sum())
        found = WrongBlock(kind, req.request_id, index, bid, block_hash[:8].hex(), name, worker,
                           wrong, self._looks_like(view, block_hash, where))
        if self.raise_on_wrong:
            raise AssertionError(found.describe())
        key = (bid, block_hash, name, worker)
        if key not in self._reported:  # counted once, though checked again every step
            self._reported.add(key)
            self.wrong.append(found)
            self.stats.wrong_bytes[kind] = self.stats.wrong_bytes.get(kind, 0) + wrong


    def _looks_like(self, view: torch.Tensor, block_hash: bytes,
                    where: tuple[int, int, str]) -> str:
        """What a wrong layer-block holds instead, when it is a known pattern."""
        worker, layer, name = where
        if not bool(view.any()):
            return "zeros (never written)"
        for w in range(len(self.model.kv_caches)):
            if w != worker and torch.equal(view, self.model.expected(
                    block_hash, layer, view, w).to(view.dtype)):
                return f"worker {w}'s bytes for this hash (another TP shard)"
        for layers in self.model.group_layers:
            for other, other_name in layers:
                if other_name != name and torch.equal(view, self.model.expected(
                        block_hash, other, view, worker).to(view.dtype)):
                    return f"layer {other_name}'s bytes for this hash"
        return ""


def _first_invalid(groups: Any, invalid: Collection[int]) -> int:
    """The first block position holding an invalid block in any group (a large number if
    none): vLLM recomputes a request from there."""
    if not invalid:
        return 1 << 30
    return min((i for ids in groups for i, b in enumerate(ids) if b in invalid), default=1 << 30)
