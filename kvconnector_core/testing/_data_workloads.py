"""The workloads :class:`~kvconnector_core.testing.DataCheck` runs (private: import them
from :mod:`kvconnector_core.testing`).

Primitives: :class:`DataCheckWorkload`, :func:`data_check_workloads`.
"""

from __future__ import annotations

import functools
import operator
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvconnector_core.engine.engine import EngineConfig
from kvconnector_core.engine.workloads import TraceRequest
from kvconnector_core.worker.model import ModelConfig

if TYPE_CHECKING:
    from kvconnector_core.connector.config import KVConnectorConfig

__all__ = ["DEFAULT_LAYER_TYPES", "HYBRID_LAYER_TYPES", "DataCheckWorkload", "data_check_workloads"]

_VOCAB = 1000

DEFAULT_LAYER_TYPES: tuple[str, ...] = ("full", "full")
"""The kit's model: two full-attention layers, so one KV cache group."""

HYBRID_LAYER_TYPES: tuple[str, ...] = ("full", "sliding:8", "chunked:8", "full")
"""The ``hybrid`` workload's model: three KV cache groups (full, an 8-token sliding window,
8-token chunked local attention); with block size 4 the window groups free blocks that
leave the window (they become the null block) as prompts grow."""


@dataclass(frozen=True)
class DataCheckWorkload:
    """One small workload and the engine it runs on.

    Attributes:
        name: what it exercises.
        requests: the trace (request ids are set, so both runs name requests alike).
        num_gpu_blocks: GPU pool size (small values force eviction and preemption).
        enable_prefix_caching: off makes every repeated prefix a connector hit.
        block_size: tokens per block.
        max_num_batched_tokens: token budget of a step.
        max_num_seqs: most requests running at once.
        max_model_len: longest sequence.
        layer_types: the model's layers (``"full"``, ``"sliding:N"``, ``"chunked:N"``); each
            distinct kind is one KV cache group, so more than one kind is a hybrid model.
        kv_dtype: the KV element type (:data:`~kvconnector_core.worker.model.KV_DTYPES`).
            ``"int16"`` by default: the model's values are residues below 2**16, so as int32
            the upper two bytes of every element are always zero and a connector that
            corrupts them (truncates, zeroes, drops the last byte of a block) would move
            data equal to the truth; as int16 every byte of every element carries data,
            as in vLLM's 2-byte KV dtypes.
    """

    name: str
    requests: tuple[TraceRequest, ...]
    num_gpu_blocks: int = 64
    enable_prefix_caching: bool = True
    block_size: int = 4
    max_num_batched_tokens: int = 64
    max_num_seqs: int = 8
    max_model_len: int = 96
    layer_types: tuple[str, ...] = DEFAULT_LAYER_TYPES
    kv_dtype: str = "int16"

    def engine_config(self, connector: KVConnectorConfig | None) -> EngineConfig:
        """The engine config of this workload, with ``connector`` (None = baseline)."""
        model = ModelConfig(vocab_size=_VOCAB, layer_types=self.layer_types, num_kv_heads=1,
                            head_size=8, mlp_size=16, kv_dtype=self.kv_dtype)
        return EngineConfig(model=model, num_gpu_blocks=self.num_gpu_blocks,
                            block_size=self.block_size,
                            max_num_batched_tokens=self.max_num_batched_tokens,
                            max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len,
                            enable_prefix_caching=self.enable_prefix_caching, connector=connector)

    @property
    def is_hybrid(self) -> bool:
        """Whether the model has several KV cache groups."""
        return len(self.engine_config(None).kv_cache_config().kv_cache_groups) > 1


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(_VOCAB) for _ in range(n)]


def _trace(items: Sequence[tuple[float, list[int], int]]) -> tuple[TraceRequest, ...]:
    return tuple(TraceRequest(arrival=a, prompt_token_ids=p, max_new_tokens=m, request_id=f"r{i}")
                 for i, (a, p, m) in enumerate(items))


def data_check_workloads(seed: int = 0) -> dict[str, DataCheckWorkload]:
    """The standard workloads, by name (block size 4).

    - ``block_aligned``: prompts of whole blocks; later ones extend earlier ones by whole
      blocks (prefix caching off, so the shared part is the connector's to load).
    - ``full_prompt_hit``: prompts repeated exactly, block-aligned and not, prefix caching
      off: the connector may serve the whole prompt (see the full-prompt-hit rule in
      ``KVConnectorBase_V1.update_state_after_alloc``).
    - ``repeated_prefixes``: a shared system prompt that ends mid-block plus per-user
      conversations that grow by a turn each round, prefix caching on, a pool too small
      to keep every conversation: GPU hits and connector hits mix.
    - ``eviction``: a pool just big enough for one request; the GPU prefix cache keeps
      almost nothing, so repeats come from the connector.
    - ``preemption``: long generations on a tiny pool; preempted requests are admitted
      again with their output tokens as part of the prefix.
    - ``chained_prefixes``: each prompt extends the previous one by whole blocks, one
      request at a time, prefix caching off: every request loads all of the previous
      one's blocks and stores its own new ones, which the next request loads. What
      :func:`~kvconnector_core.testing.run_failed_load_check` fails loads in.
    - ``hybrid``: a model with three KV cache groups (:data:`HYBRID_LAYER_TYPES`),
      repeated and extended prompts with prefix caching off. Only for connectors that
      declare ``supports_multiple_kv_cache_groups``; others must be refused on it.
    """
    rng = random.Random(seed)
    a16, a24, b16 = _tokens(rng, 16), _tokens(rng, 24), _tokens(rng, 16)
    aligned = _trace([(0, a16, 3), (0, b16, 3), (10, a16 + _tokens(rng, 8), 3),
                      (10, a24, 3), (20, a24 + _tokens(rng, 4), 3), (20, b16 + a16, 3)])
    odd = _tokens(rng, 18)
    full = _trace([(0, a16, 3), (0, odd, 3), (10, a16, 3), (10, odd, 3), (20, a16, 4),
                   (20, odd, 2), (20, b16, 2), (30, b16, 2)])
    system = _tokens(rng, 10)
    turns = [[_tokens(rng, 7)] + [_tokens(rng, 3) for _ in range(2)] for _ in range(4)]
    prefixes = _trace([(8 * r + i,
                        system + functools.reduce(operator.iadd, turns[i][:r + 1], []), 3)
                       for r in range(3) for i in range(4)])
    prompts = [_tokens(rng, 12 + 2 * i) for i in range(4)]
    evict = _trace([(6 * i, prompts[i % 4], 2) for i in range(12)])
    long_prompts = [_tokens(rng, 20 + i) for i in range(4)]
    preempt = _trace([(0, p, 24) for p in long_prompts] + [(40, p, 8) for p in long_prompts])
    # Drawn last, so adding it left the other workloads' tokens unchanged.
    h24, h19 = _tokens(rng, 24), _tokens(rng, 19)
    chain = _tokens(rng, 8)
    links = [chain := chain + _tokens(rng, 8) for _ in range(3)]
    chained = _trace([(0, links[0][:8], 2)] + [(10 * (i + 1), p, 2) for i, p in enumerate(links)]
                     + [(40, links[-1] + _tokens(rng, 3), 2)])
    hybrid = _trace([(0, h24, 3), (0, h19, 3), (10, h24, 3), (10, h19 + _tokens(rng, 9), 3),
                     (20, h24 + _tokens(rng, 12), 4), (20, h19, 2)])
    workloads = [
        DataCheckWorkload("block_aligned", aligned, enable_prefix_caching=False),
        DataCheckWorkload("full_prompt_hit", full, enable_prefix_caching=False),
        DataCheckWorkload("repeated_prefixes", prefixes, num_gpu_blocks=14, max_model_len=48),
        DataCheckWorkload("eviction", evict, num_gpu_blocks=10, max_model_len=32, max_num_seqs=2),
        DataCheckWorkload("preemption", preempt, num_gpu_blocks=30, max_model_len=64),
        DataCheckWorkload("chained_prefixes", chained, enable_prefix_caching=False),
        DataCheckWorkload("hybrid", hybrid, enable_prefix_caching=False,
                          layer_types=HYBRID_LAYER_TYPES),
    ]
    return {w.name: w for w in workloads}
