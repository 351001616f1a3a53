"""vLLM's configs as kvconnector's: the wrapped connector's config and the KV cache config.

- :func:`connector_config_from_vllm`: the connector config, from vLLM's
  ``KVTransferConfig`` (the ``kvconnector`` key of its extra config) and parallel config.
- :func:`kv_cache_config_from_vllm`: kvconnector's ``KVCacheConfig`` for vLLM's.
- :data:`EXTRA_CONFIG_KEY`: the extra-config key naming the wrapped connector.

Primitives: :func:`connector_config_from_vllm`, :func:`kv_cache_config_from_vllm`,
:data:`EXTRA_CONFIG_KEY`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.v1 import kv_cache_interface as vkv

from kvconnector_core.connector.config import KVConnectorConfig
from kvconnector_core.errors import ConfigError
from kvconnector_core.kv_cache import kv_cache_spec as kspec

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["EXTRA_CONFIG_KEY", "connector_config_from_vllm", "kv_cache_config_from_vllm"]

EXTRA_CONFIG_KEY = "kvconnector"
"""Key of ``kv_connector_extra_config`` holding the wrapped connector's kvconnector config."""


def connector_config_from_vllm(vllm_config: VllmConfig) -> KVConnectorConfig:
    """The wrapped connector's config, from vLLM's ``KVTransferConfig``.

    ``kv_connector_extra_config["kvconnector"]`` is a kvconnector connector
    config (``name``, ``extra_config``, optionally ``module_path``); ``role``,
    ``engine_id`` and ``load_failure_policy`` come from vLLM's own fields,
    ``world_size``, ``rank`` and ``pipeline_parallel_size`` from its parallel config and
    ``enable_kv_cache_events`` from its ``kv_events_config``.

    Raises:
        ConfigError: the key is missing or not a connector config, or vLLM runs prefill
            context parallelism (its workers would not all be counted).
    """
    ktc = vllm_config.kv_transfer_config
    raw = (ktc.kv_connector_extra_config or {}).get(EXTRA_CONFIG_KEY) if ktc is not None else None
    if not isinstance(raw, dict) or "name" not in raw:
        msg = (f"kv_connector_extra_config[{EXTRA_CONFIG_KEY!r}] must name the kvconnector "
               f"connector to wrap, e.g. {{\"{EXTRA_CONFIG_KEY}\": {{\"name\": \"cpu_offload\", "
               f"\"extra_config\": {{...}}}}}}; got {raw!r}")
        raise ConfigError(msg)
    bad = sorted(set(raw) - {"name", "extra_config", "module_path"})
    if bad:
        msg = (f"kv_connector_extra_config[{EXTRA_CONFIG_KEY!r}] has unknown keys {bad}; valid: "
               "name, extra_config, module_path (role, engine_id and the load failure policy "
               "come from vLLM's kv_role, engine_id and kv_load_failure_policy)")
        raise ConfigError(msg)
    parallel = vllm_config.parallel_config
    pcp = getattr(parallel, "prefill_context_parallel_size", 1)
    if pcp > 1:
        # vLLM then runs tp * pp * pcp workers: world_size would not count them all, and
        # a job would complete before every worker had moved its part.
        msg = (f"kvconnector connectors do not support prefill context parallelism "
               f"(prefill_context_parallel_size={pcp}); use 1")
        raise ConfigError(msg)
    world_size = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
    events = getattr(vllm_config, "kv_events_config", None)
    return KVConnectorConfig.from_dict({
        **raw,
        "role": ktc.kv_role or "kv_both",
        "engine_id": ktc.engine_id,
        "load_failure_policy": ktc.kv_load_failure_policy,
        "world_size": world_size,
        # vLLM's worker sets parallel_config.rank (pp_rank * tp_size + tp_rank) before it
        # builds its connector; the scheduler process keeps 0. Under the external launcher
        # with data parallelism the rank counts across DP groups (DP outermost).
        "rank": parallel.rank % world_size,
        "pipeline_parallel_size": parallel.pipeline_parallel_size,
        # vLLM builds KV events only when kv_events_config enables them; so do we.
        "enable_kv_cache_events": bool(events is not None and events.enable_kv_cache_events),
    })


def _spec_from_vllm(spec: Any) -> kspec.KVCacheSpec:
    common = {"block_size": spec.block_size, "num_kv_heads": getattr(spec, "num_kv_heads", 1),
              "head_size": getattr(spec, "head_size", 1),
              "dtype": getattr(spec, "dtype", "bfloat16")}
    if isinstance(spec, vkv.SlidingWindowSpec):
        return kspec.SlidingWindowSpec(**common, sliding_window=spec.sliding_window)
    if isinstance(spec, vkv.ChunkedLocalAttentionSpec):
        return kspec.ChunkedLocalAttentionSpec(**common,
                                               attention_chunk_size=spec.attention_chunk_size)
    if isinstance(spec, vkv.FullAttentionSpec) and spec.sliding_window is None \
            and spec.attention_chunk_size is None:
        return kspec.FullAttentionSpec(**common)
    msg = (f"vLLM KV cache spec {type(spec).__name__} has no kvconnector counterpart; supported: "
           "FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec")
    raise ConfigError(msg)


def kv_cache_config_from_vllm(kv_cache_config: Any) -> kspec.KVCacheConfig | None:
    """kvconnector's ``KVCacheConfig`` for vLLM's (same pool size, groups and specs)."""
    if kv_cache_config is None:
        return None
    groups = [kspec.KVCacheGroupSpec(list(g.layer_names), _spec_from_vllm(g.kv_cache_spec))
              for g in kv_cache_config.kv_cache_groups]
    return kspec.KVCacheConfig(num_blocks=kv_cache_config.num_blocks, kv_cache_groups=groups)
