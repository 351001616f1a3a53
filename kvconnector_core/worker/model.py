"""A tiny decoder whose outputs are bit-identical however tokens are batched or chunked.

Every value in the model is an integer modulo the prime ``P = 65521`` (the largest prime
below 2**16). Matrix products run in float64 on integers: each product of two residues is
below 2**32, so a sum of fewer than 2**21 of them is below 2**53 and every partial sum is
an exactly representable integer -- the result is exact, and therefore the same in any
summation order, on any BLAS, on CPU and CUDA. Results are converted to int64 and reduced
mod P right after each product (see ``docs/determinism.md``). The KV cache holds the
residues as int32.

Per token at position ``p`` (hidden width ``D = num_kv_heads * head_size``)::

    h  = E[token] + (p + 1) * pe                                       (mod P)
    per layer:
      q, k, v = h Wq, h Wk + (p + 1) * pk, h Wv                        (mod P)
      write k, v to the paged cache at the token's slot (block table)
      for every visible key position j (j <= p; j > p - window for sliding layers;
      j // chunk == p // chunk for chunked-local layers),
      per head:  w_j = (q . k_j + 1) * c(j),   c(j) = j mod (P - 1) + 1  (mod P)
      a = sum_j w_j v_j                                                (mod P)
      h = h + a Wo;   h = h + S[h W1] W2                               (mod P)
    token = argmax(h Wout)   (first index on ties)

Attention reads K/V *only* through the paged cache (the token's own K/V included), with
weights that depend on every key and on its absolute position, so a wrong, stale,
missing or misplaced KV block changes the attention output and, through the lookup
table ``S`` (a random permutation of the residues) and the logits, the generated tokens.

Primitives: :class:`ModelConfig`, :class:`PagedIntModel`, :class:`GroupAttentionMetadata`,
:class:`ForwardBatch`, :data:`PRIME`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvconnector_core.errors import ConfigError
from kvconnector_core.kv_cache.kv_cache_spec import (
    DTYPE_SIZES,
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    SlidingWindowSpec,
)

__all__ = [
    "KV_DTYPES",
    "LAYER_TYPES",
    "PRIME",
    "ForwardBatch",
    "GroupAttentionMetadata",
    "LayerHook",
    "ModelConfig",
    "PagedIntModel",
]

PRIME = 65521
"""The modulus of every value in the model (largest prime below 2**16)."""

#: Exactness bound: float64 sums of products of residues stay exact below this many terms.
_MAX_EXACT_TERMS = 2**21

LAYER_TYPES = ("full", "sliding", "chunked")
"""Kinds of :attr:`ModelConfig.layer_types` entries (``"sliding:N"`` / ``"chunked:N"`` give
a layer its own window / chunk size)."""

KV_DTYPES = ("int32", "int16")
"""KV cache element types: residues as int32, or as int16 offset by 2**15 (2 bytes per
element, the size of a real bf16 KV cache)."""

_INT16_OFFSET = 32768

LayerHook = Callable[..., None]
"""``before(layer_name)`` / ``after(layer_name, kv_layer, attn_metadata)`` callbacks."""


@dataclass(frozen=True)
class ModelConfig:
    """Shape and seed of the model.

    Attributes:
        vocab_size: number of token ids; prompts must use ids below it.
        layer_types: one entry per layer: ``"full"``, ``"sliding"`` (window
            ``sliding_window``), ``"sliding:N"`` (window N), ``"chunked"`` (chunked local
            attention of ``attention_chunk_size`` tokens) or ``"chunked:N"``. Each distinct
            kind and size is one KV cache group, so mixing them gives a hybrid model.
        num_kv_heads: attention heads (one KV head per query head).
        head_size: width of a head; the hidden width is ``num_kv_heads * head_size``.
        mlp_size: width of the MLP.
        sliding_window: tokens a ``"sliding"`` layer sees (the current one included).
        attention_chunk_size: tokens per chunk of a ``"chunked"`` layer.
        kv_dtype: ``"int32"`` or ``"int16"`` (see :data:`KV_DTYPES`).
        seed: seed of the weights.
    """

    vocab_size: int = 32000
    layer_types: tuple[str, ...] = ("full", "full", "full", "full")
    num_kv_heads: int = 2
    head_size: int = 16
    mlp_size: int = 64
    sliding_window: int = 0
    attention_chunk_size: int = 0
    kv_dtype: str = "int32"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "num_kv_heads", "head_size", "mlp_size"):
            if getattr(self, name) < 1:
                msg = f"ModelConfig.{name} must be >= 1, got {getattr(self, name)!r}"
                raise ConfigError(msg)
        if not self.layer_types:
            msg = "ModelConfig.layer_types is empty; give at least one layer"
            raise ConfigError(msg)
        if self.kv_dtype not in KV_DTYPES:
            msg = f"ModelConfig.kv_dtype={self.kv_dtype!r}; valid: {', '.join(KV_DTYPES)}"
            raise ConfigError(msg)
        for t in self.layer_types:
            self._parse_layer_type(t)

    def _parse_layer_type(self, layer_type: str) -> tuple[str, int]:
        kind, sep, size = str(layer_type).partition(":")
        if kind not in LAYER_TYPES or (sep and (kind == "full" or not size.isdigit())):
            msg = (f"ModelConfig.layer_types has {layer_type!r}; valid layer types: "
                   "'full', 'sliding', 'sliding:<window>', 'chunked', 'chunked:<chunk size>'")
            raise ConfigError(msg)
        if kind == "full":
            return kind, 0
        default, field_name = ((self.sliding_window, "sliding_window") if kind == "sliding"
                               else (self.attention_chunk_size, "attention_chunk_size"))
        value = int(size) if sep else default
        if value < 1:
            msg = (f"ModelConfig layer type {layer_type!r} needs a size >= 1 (give "
                   f"'{kind}:<N>' or set {field_name}; it is {default})")
            raise ConfigError(msg)
        return kind, value

    def layer_attention(self) -> list[tuple[str, int]]:
        """Per layer, ``(kind, size)``: ``("full", 0)``, ``("sliding", window)`` or
        ``("chunked", chunk size)``."""
        return [self._parse_layer_type(t) for t in self.layer_types]

    @property
    def num_layers(self) -> int:
        """Number of layers."""
        return len(self.layer_types)

    @property
    def hidden_size(self) -> int:
        """Width of the hidden state."""
        return self.num_kv_heads * self.head_size

    def layer_names(self) -> list[str]:
        """Names of the attention layers, ``layers.<i>.attn``."""
        return [f"layers.{i}.attn" for i in range(self.num_layers)]

    def kv_cache_specs(self, block_size: int) -> dict[str, AttentionSpec]:
        """KV cache spec of every layer (dtype :attr:`kv_dtype`).

        Args:
            block_size: tokens per block.

        Returns:
            Layer name -> spec, in layer order.
        """
        shape = (block_size, self.num_kv_heads, self.head_size, self.kv_dtype)
        specs: dict[str, AttentionSpec] = {}
        for name, (kind, size) in zip(self.layer_names(), self.layer_attention()):
            if kind == "full":
                specs[name] = FullAttentionSpec(*shape)
            elif kind == "sliding":
                specs[name] = SlidingWindowSpec(*shape, sliding_window=size)
            else:
                specs[name] = ChunkedLocalAttentionSpec(*shape, attention_chunk_size=size)
        return specs

    def describe(self, block_size: int = 16) -> str:
        """One line stating the KV shape, e.g. for a run's report."""
        counts: dict[str, int] = {}
        for kind, size in self.layer_attention():
            label = kind if kind == "full" else f"{kind} {size}"
            counts[label] = counts.get(label, 0) + 1
        layers = ", ".join(f"{n} {label}" for label, n in counts.items())
        per_token = 2 * self.num_layers * self.hidden_size * DTYPE_SIZES[self.kv_dtype]
        return (f"{self.num_layers} layers ({layers}), {self.num_kv_heads} KV heads x "
                f"{self.head_size}, {self.kv_dtype} KV: {per_token * block_size / 2**20:.2f} MiB "
                f"per {block_size}-token block of all layers")


@dataclass
class GroupAttentionMetadata:
    """Where one step's tokens live in one KV cache group's paged tensors.

    Slots are flat: ``slot = block_id * block_size + offset``.

    Attributes:
        group_id: the KV cache group.
        block_size: tokens per block of the group.
        slot_mapping: ``(T,)`` slot of every scheduled token (where its K/V is written).
        segments: per multi-token request ``(q_start, q_end, key_slots, key_positions)``:
            the request's tokens are rows ``[q_start, q_end)`` of the batch and
            ``key_slots`` / ``key_positions`` (``(L,)``) list the keys any of them may see.
        decode_rows: ``(R,)`` batch rows of single-token requests, attended together.
        decode_key_slots: ``(R, Lmax)`` key slots of those requests (padded).
        decode_key_positions: ``(R, Lmax)`` key positions; ``-1`` marks padding.
    """

    group_id: int
    block_size: int
    slot_mapping: torch.Tensor
    segments: list[tuple[int, int, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    decode_rows: torch.Tensor | None = None
    decode_key_slots: torch.Tensor | None = None
    decode_key_positions: torch.Tensor | None = None


@dataclass
class ForwardBatch:
    """The flattened tokens of one step.

    Attributes:
        token_ids: ``(T,)`` int64 token ids.
        positions: ``(T,)`` int64 positions.
        groups: attention metadata per KV cache group.
        sample_rows: ``(S,)`` rows whose next token is sampled.
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    groups: list[GroupAttentionMetadata]
    sample_rows: torch.Tensor


def _mod(x: torch.Tensor) -> torch.Tensor:
    """Reduce an exact integer-valued float64 tensor mod P (returns float64)."""
    # int64 remainder is exact; float remainder could round near multiples of P.
    return torch.remainder(x.to(torch.int64), PRIME).to(torch.float64)


class PagedIntModel:
    """The integer paged-attention decoder (see the module docstring for the maths).

    Args:
        config: model shape and seed.
        layer_to_group: layer name -> ``(KV cache group, index in group)``.
        device: where the weights live (must match the KV cache).
    """

    def __init__(self, config: ModelConfig, layer_to_group: dict[str, tuple[int, int]],
                 device: str | torch.device = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        self.layer_names = config.layer_names()
        missing = [n for n in self.layer_names if n not in layer_to_group]
        if missing:
            msg = (f"no KV cache group holds layer {missing[0]!r}; "
                   f"groups hold {sorted(layer_to_group)}")
            raise ConfigError(msg)
        self.layer_to_group = layer_to_group
        # Weights come from a seeded CPU generator (the same on every machine) and are
        # then moved, so CPU and CUDA runs share bit-identical weights.
        gen = torch.Generator().manual_seed(config.seed)
        d, f, v = config.hidden_size, config.mlp_size, config.vocab_size

        def rand(*shape: int) -> torch.Tensor:
            return torch.randint(0, PRIME, shape, generator=gen).to(torch.float64).to(self.device)

        self.embedding = rand(v, d)
        self.pos_embedding = rand(d)
        self.layers = [
            {"wq": rand(d, d), "wk": rand(d, d), "wv": rand(d, d), "pk": rand(d),
             "wo": rand(d, d), "w1": rand(d, f), "w2": rand(f, d)}
            for _ in self.layer_names
        ]
        self.sbox = torch.randperm(PRIME, generator=gen).to(self.device)
        self.lm_head = rand(d, v)
        self._attention_of_layer = config.layer_attention()
        # int16 holds residues (< 2**16) shifted by 2**15; int32 holds them as they are.
        self._kv_offset = _INT16_OFFSET if config.kv_dtype == "int16" else 0

    def forward(self, batch: ForwardBatch, kv_caches: dict[str, torch.Tensor], *,
                before_layer: LayerHook | None = None,
                after_layer: LayerHook | None = None) -> torch.Tensor:
        """Run the layers over a batch, writing and reading the paged KV cache.

        Args:
            batch: tokens, positions and per-group attention metadata.
            kv_caches: layer name -> that layer's paged view
                ``(num_blocks, 2, block_size, heads, head_size)`` (int32).
            before_layer: called as ``before_layer(layer_name)`` before a layer touches
                its KV cache (the connector's ``wait_for_layer_load``).
            after_layer: called as ``after_layer(layer_name, kv_layer, attn_metadata)``
                once the layer wrote its KV (the connector's ``save_kv_layer``).

        Returns:
            The final hidden states, ``(T, hidden_size)`` float64 residues.
        """
        pos1 = (batch.positions + 1).to(torch.float64).unsqueeze(1)
        h = _mod(self.embedding[batch.token_ids] + pos1 * self.pos_embedding)
        for name, (kind, size), w in zip(self.layer_names, self._attention_of_layer, self.layers):
            meta = batch.groups[self.layer_to_group[name][0]]
            if before_layer is not None:
                before_layer(name)
            q = _mod(h @ w["wq"])
            k = _mod(h @ w["wk"] + pos1 * w["pk"])
            v = _mod(h @ w["wv"])
            kv_layer = kv_caches[name]
            self._write_kv(kv_layer, meta, k, v)
            window = size if kind == "sliding" else 0
            chunk = size if kind == "chunked" else 0
            attn = self._attention(kv_layer, meta, q, batch.positions, window, chunk)
            if after_layer is not None:
                after_layer(name, kv_layer, meta)
            h = _mod(h + _mod(attn @ w["wo"]))
            hidden = self.sbox[(h @ w["w1"]).to(torch.int64).remainder_(PRIME)]
            h = _mod(h + _mod(hidden.to(torch.float64) @ w["w2"]))
        return h

    def sample(self, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy next tokens for some final hidden states.

        Args:
            hidden: ``(S, hidden_size)`` rows to sample from.

        Returns:
            ``(S,)`` int64 token ids (argmax of the logits, first index on ties).
        """
        if hidden.shape[0] == 0:
            return torch.empty(0, dtype=torch.int64, device=hidden.device)
        logits = torch.remainder((hidden @ self.lm_head).to(torch.int64), PRIME)
        return torch.argmax(logits, dim=1)

    # ------------------------------------------------------------------ helpers

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], self.config.num_kv_heads, self.config.head_size)

    def _write_kv(self, kv_layer: torch.Tensor, meta: GroupAttentionMetadata,
                  k: torch.Tensor, v: torch.Tensor) -> None:
        blocks = torch.div(meta.slot_mapping, meta.block_size, rounding_mode="floor")
        offsets = meta.slot_mapping - blocks * meta.block_size
        off = self._kv_offset
        kv_layer[blocks, 0, offsets] = (self._heads(k) - off).to(kv_layer.dtype)
        kv_layer[blocks, 1, offsets] = (self._heads(v) - off).to(kv_layer.dtype)

    def _gather(self, kv_layer: torch.Tensor, slots: torch.Tensor, block_size: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = torch.div(slots, block_size, rounding_mode="floor")
        offsets = slots - blocks * block_size
        off = self._kv_offset
        return (kv_layer[blocks, 0, offsets].to(torch.float64) + off,
                kv_layer[blocks, 1, offsets].to(torch.float64) + off)

    def _attention(self, kv_layer: torch.Tensor, meta: GroupAttentionMetadata,
                   q: torch.Tensor, positions: torch.Tensor, window: int,
                   chunk: int = 0) -> torch.Tensor:
        out = torch.zeros_like(q)
        qh = self._heads(q)
        for q_start, q_end, key_slots, key_pos in meta.segments:
            keys, values = self._gather(kv_layer, key_slots, meta.block_size)  # (L, H, hs)
            # scores: (H, Tq, L) = q (H, Tq, hs) @ k^T (H, hs, L)
            scores = qh[q_start:q_end].transpose(0, 1) @ keys.permute(1, 2, 0)
            qpos = positions[q_start:q_end].unsqueeze(1)
            weights = self._weights(scores, qpos, key_pos.unsqueeze(0), window, chunk)
            att = _mod(weights @ values.transpose(0, 1))  # (H, Tq, hs)
            out[q_start:q_end] = att.transpose(0, 1).reshape(q_end - q_start, -1)
        decode_slots, key_positions = meta.decode_key_slots, meta.decode_key_positions
        if (meta.decode_rows is not None and decode_slots is not None and key_positions is not None
                and meta.decode_rows.numel()):
            rows = meta.decode_rows
            keys, values = self._gather(kv_layer, decode_slots, meta.block_size)
            # keys: (R, Lmax, H, hs); one query per request.
            scores = torch.einsum("rhd,rlhd->rhl", qh[rows], keys)
            qpos = positions[rows].view(-1, 1, 1)
            kpos = key_positions.unsqueeze(1)
            weights = self._weights(scores, qpos, kpos, window, chunk)  # (R, H, Lmax)
            att = _mod(torch.einsum("rhl,rlhd->rhd", weights, values))
            out[rows] = att.reshape(rows.numel(), -1)
        return out

    @staticmethod
    def _weights(scores: torch.Tensor, qpos: torch.Tensor, kpos: torch.Tensor,
                 window: int, chunk: int = 0) -> torch.Tensor:
        """Position-weighted scores ``(q.k + 1) * c(j)`` with causal/window/chunk/padding masks."""
        coeff = (torch.remainder(kpos, PRIME - 1) + 1).to(torch.float64)
        weights = _mod((_mod(scores) + 1) * coeff)
        visible = (kpos <= qpos) & (kpos >= 0)
        if window:
            visible &= kpos > qpos - window
        if chunk:
            visible &= torch.div(kpos, chunk, rounding_mode="floor") == torch.div(
                qpos, chunk, rounding_mode="floor")
        return weights * visible
