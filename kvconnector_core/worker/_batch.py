"""The model runner's per-request state and its per-group attention-metadata builder."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvconnector_core.errors import InvariantError
from kvconnector_core.worker.model import GroupAttentionMetadata


@dataclass(slots=True)
class _RequestState:
    """What the worker remembers about one request between steps."""

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[list[int]]  # per KV cache group


class _GroupBuilder:
    """Accumulates one KV cache group's attention metadata while a batch is built."""

    __slots__ = ("block_size", "chunk", "decode_pos", "decode_rows", "decode_slots", "group_id",
                 "segments", "slot_parts", "window")

    def __init__(self, group_id: int, block_size: int, window: int, chunk: int = 0) -> None:
        self.group_id = group_id
        self.block_size = block_size
        self.window = window
        self.chunk = chunk
        self.slot_parts: list[torch.Tensor] = []
        self.segments: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []
        self.decode_rows: list[int] = []
        self.decode_slots: list[torch.Tensor] = []
        self.decode_pos: list[torch.Tensor] = []

    def add(self, state: _RequestState, row: int, start: int, num_tokens: int) -> None:
        """Add request rows ``[row, row + num_tokens)`` at positions ``start...``."""
        end = start + num_tokens
        key_start = max(0, start - self.window + 1) if self.window else 0
        if self.chunk:  # keys of earlier chunks are never visible (their blocks are freed)
            key_start = start // self.chunk * self.chunk
        key_pos = torch.arange(key_start, end, dtype=torch.int64)
        block_idx = torch.div(key_pos, self.block_size, rounding_mode="floor")
        block_ids = state.block_ids[self.group_id]
        last_block = (end - 1) // self.block_size
        if last_block >= len(block_ids):
            msg = (f"request {state.req_id!r}: position {end - 1} needs block #{last_block} of "
                   f"KV cache group {self.group_id}, but the scheduler gave only "
                   f"{len(block_ids)} blocks")
            raise InvariantError(msg)
        blocks = torch.tensor(block_ids, dtype=torch.int64)[block_idx]
        if bool((blocks == 0).any()):
            # Block 0 is the null block (skipped sliding-window blocks): reading it would
            # silently use garbage, so a block table that maps a visible key there is a bug.
            bad = int(key_pos[blocks == 0][0])
            msg = (f"request {state.req_id!r}: visible key position {bad} of KV cache group "
                   f"{self.group_id} maps to the null block (block table {block_ids})")
            raise InvariantError(msg)
        slots = blocks * self.block_size + (key_pos - block_idx * self.block_size)
        self.slot_parts.append(slots[-num_tokens:])
        if num_tokens == 1:
            self.decode_rows.append(row)
            self.decode_slots.append(slots)
            self.decode_pos.append(key_pos)
        else:
            self.segments.append((row, row + num_tokens, slots, key_pos))

    def build(self, device: torch.device) -> GroupAttentionMetadata:
        """Return the metadata, moved to ``device``."""
        meta = GroupAttentionMetadata(
            group_id=self.group_id, block_size=self.block_size,
            slot_mapping=torch.cat(self.slot_parts).to(device),
            segments=[(s, e, slots.to(device), pos.to(device))
                      for s, e, slots, pos in self.segments],
        )
        if self.decode_rows:
            width = max(p.numel() for p in self.decode_pos)
            slots = torch.zeros(len(self.decode_rows), width, dtype=torch.int64)
            positions = torch.full((len(self.decode_rows), width), -1, dtype=torch.int64)
            for i, (s, p) in enumerate(zip(self.decode_slots, self.decode_pos)):
                slots[i, :s.numel()] = s
                positions[i, :p.numel()] = p
            meta.decode_rows = torch.tensor(self.decode_rows, dtype=torch.int64).to(device)
            meta.decode_key_slots = slots.to(device)
            meta.decode_key_positions = positions.to(device)
        return meta
