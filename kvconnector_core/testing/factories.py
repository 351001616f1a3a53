"""Small, real engine objects for connector tests: pools, managers, requests, pairs.

Everything here is built from the real core (``BlockPool``, ``KVCacheManager``,
``Request``), sized tiny so a test runs in milliseconds. Torch is imported only
by :func:`make_kv_caches`.

Primitives: :data:`BLOCK_SIZE`, :data:`NUM_BLOCKS`, :func:`make_kv_cache_config`,
:func:`make_block_pool`, :func:`make_kv_cache_manager`, :func:`make_request`,
:func:`make_connector_pair`, :func:`make_kv_caches`, :func:`empty_scheduler_output`,
:func:`scheduler_output_for`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from kvconnector_core.connector.base import KVConnectorBase_V1, KVConnectorRole
from kvconnector_core.connector.config import KVConnectorConfig
from kvconnector_core.plugins.registry import ConnectorRegistry, create_connector

if TYPE_CHECKING:
    import torch

    from kvconnector_core.kv_cache.block_pool import BlockPool
    from kvconnector_core.kv_cache.kv_cache_manager import KVCacheManager
    from kvconnector_core.kv_cache.kv_cache_spec import AttentionSpec, KVCacheConfig
    from kvconnector_core.request import Request
    from kvconnector_core.scheduler.output import SchedulerOutput

__all__ = [
    "BLOCK_SIZE",
    "NUM_BLOCKS",
    "empty_scheduler_output",
    "make_block_pool",
    "make_connector_pair",
    "make_kv_cache_config",
    "make_kv_cache_manager",
    "make_kv_caches",
    "make_request",
    "scheduler_output_for",
]

BLOCK_SIZE = 4
"""Tokens per block in the kit's tiny configs."""
NUM_BLOCKS = 32
"""Blocks in the kit's tiny pools (block 0 is the null block)."""
MAX_MODEL_LEN = 256

_request_ids = itertools.count()


def make_kv_cache_config(
    num_blocks: int = NUM_BLOCKS,
    block_size: int = BLOCK_SIZE,
    num_layers: int = 2,
    dtype: str = "int32",
) -> KVCacheConfig:
    """Return a one-group full-attention KV cache config (layers ``layer.0`` ...).

    Args:
        num_blocks: blocks in the pool, the null block included.
        block_size: tokens per block.
        num_layers: attention layers in the group.
        dtype: KV dtype name (the engine's model uses ``"int32"``).
    """
    from kvconnector_core.kv_cache.kv_cache_spec import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )

    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=2, dtype=dtype)
    group = KVCacheGroupSpec(layer_names=[f"layer.{i}" for i in range(num_layers)],
                             kv_cache_spec=spec)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=[group])


def make_block_pool(num_blocks: int = NUM_BLOCKS, block_size: int = BLOCK_SIZE, *,
                    enable_kv_cache_events: bool = False) -> BlockPool:
    """Return a real GPU ``BlockPool`` with prefix caching on."""
    from kvconnector_core.kv_cache.block_pool import BlockPool

    return BlockPool(num_blocks, enable_caching=True, hash_block_size=block_size,
                     enable_kv_cache_events=enable_kv_cache_events)


def make_kv_cache_manager(kv_cache_config: KVCacheConfig | None = None, *,
                          max_model_len: int = MAX_MODEL_LEN) -> KVCacheManager:
    """Return a real ``KVCacheManager`` over ``kv_cache_config`` (default:
    :func:`make_kv_cache_config`)."""
    from kvconnector_core.kv_cache.kv_cache_manager import KVCacheManager

    config = kv_cache_config or make_kv_cache_config()
    block_size = config.kv_cache_groups[0].kv_cache_spec.block_size
    return KVCacheManager(config, max_model_len, max_model_len, scheduler_block_size=block_size,
                          hash_block_size=block_size)


def make_request(
    num_tokens: int = 3 * BLOCK_SIZE + 1,
    *,
    prompt_token_ids: Sequence[int] | None = None,
    request_id: str | None = None,
    max_tokens: int = 4,
    block_size: int = BLOCK_SIZE,
    **kwargs: Any,
) -> Request:
    """Return a hashed ``Request``.

    Args:
        num_tokens: prompt length when ``prompt_token_ids`` is not given
            (tokens ``0 .. num_tokens-1``, so two such requests share a prefix).
        prompt_token_ids: explicit prompt.
        request_id: id; default: a fresh ``req-N``.
        max_tokens: tokens to generate.
        block_size: hash block size.
        **kwargs: passed to ``Request`` (``cache_salt``, ``lora_name`` ...).
    """
    from kvconnector_core.request import Request

    tokens = list(prompt_token_ids) if prompt_token_ids is not None else list(range(num_tokens))
    rid = request_id if request_id is not None else f"req-{next(_request_ids)}"
    return Request(rid, tokens, max_tokens, hash_block_size=block_size, **kwargs)


def make_connector_pair(
    config: KVConnectorConfig | dict[str, Any],
    kv_cache_config: KVCacheConfig | None = None,
    *,
    registry: ConnectorRegistry | None = None,
) -> tuple[KVConnectorBase_V1, KVConnectorBase_V1]:
    """Create a connector in both roles: ``(scheduler_side, worker_side)``.

    Args:
        config: the connector config (or dict).
        kv_cache_config: layout; default: :func:`make_kv_cache_config`.
        registry: registry to resolve the name in; default: the default registry.
    """
    kvc = kv_cache_config or make_kv_cache_config()
    return (
        create_connector(config, KVConnectorRole.SCHEDULER, kvc, registry=registry),
        create_connector(config, KVConnectorRole.WORKER, kvc, registry=registry),
    )


def make_kv_caches(kv_cache_config: KVCacheConfig | None = None,
                   device: str = "cpu") -> dict[str, torch.Tensor]:
    """Allocate zeroed paged KV tensors in the engine's cross-layer layout.

    Per group one tensor ``(num_blocks, num_layers, 2, block_size, heads, head_size)``;
    each layer gets the view ``t[:, i]`` (what ``register_kv_caches`` receives).
    """
    import torch

    config = kv_cache_config or make_kv_cache_config()
    caches: dict[str, torch.Tensor] = {}
    for group in config.kv_cache_groups:
        # the worker allocates attention specs only
        spec = cast("AttentionSpec", group.kv_cache_spec)
        dtype = getattr(torch, spec.dtype)
        base = torch.zeros((config.num_blocks, len(group.layer_names), 2, spec.block_size,
                            spec.num_kv_heads, spec.head_size), dtype=dtype, device=device)
        for i, name in enumerate(group.layer_names):
            caches[name] = base[:, i]
    return caches


def empty_scheduler_output() -> SchedulerOutput:
    """Return a step with no scheduled work."""
    from kvconnector_core.scheduler.output import SchedulerOutput

    return SchedulerOutput.make_empty()


def scheduler_output_for(requests: Sequence[tuple[Request, tuple[list[int], ...], int]],
                         finished_req_ids: set[str] | None = None) -> SchedulerOutput:
    """Return a step scheduling each ``(request, block_ids, num_scheduled_tokens)`` as new.

    Args:
        requests: the requests with their block ids per group and token counts.
        finished_req_ids: requests finished since the previous step.
    """
    from kvconnector_core.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput

    new = [NewRequestData(r.request_id, list(r.prompt_token_ids), block_ids, r.num_computed_tokens)
           for r, block_ids, _ in requests]
    counts = {r.request_id: n for r, _, n in requests}
    return SchedulerOutput(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens=counts,
        total_num_scheduled_tokens=sum(counts.values()),
        finished_req_ids=set(finished_req_ids or ()),
        preempted_req_ids=set(),
    )
