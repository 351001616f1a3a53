"""A vLLM config that runs vLLM's Scheduler and worker connector code on CPU, with no model.

For tests and benchmarks of connectors inside vLLM: the model is opt-125m's
``config.json`` alone (no weights, no tokenizer, no network); the KV transfer
config selects :class:`~kvconnector_core.integrations.vllm.KVConnectorAdapter`.

Primitives: :func:`make_vllm_config`, :func:`model_dir`, :func:`adapter_extra_config`,
:data:`ADAPTER`.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)

__all__ = ["ADAPTER", "adapter_extra_config", "make_vllm_config", "model_dir"]

ADAPTER: dict[str, str] = {"kv_connector": "KVConnectorAdapter",
                           "kv_connector_module_path": "kvconnector_core.integrations.vllm"}
"""The KVTransferConfig fields that select the adapter."""


def adapter_extra_config(name: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """``kv_connector_extra_config`` naming a kvconnector connector and its settings."""
    return {"kvconnector": {"name": name, "extra_config": extra or {}}}


_OPT_125M = {
    "architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 768,
    "num_attention_heads": 12, "num_hidden_layers": 12, "ffn_dim": 3072,
    "word_embed_proj_dim": 768, "max_position_embeddings": 2048, "vocab_size": 50272,
    "torch_dtype": "float16", "bos_token_id": 2, "eos_token_id": 2, "pad_token_id": 1,
    "do_layer_norm_before": True, "activation_function": "relu",
}
_MODEL_DIR: str | None = None


def model_dir() -> str:
    """A directory holding only opt-125m's config.json (made once per process)."""
    global _MODEL_DIR
    if _MODEL_DIR is None:
        _MODEL_DIR = tempfile.mkdtemp(prefix="kvc-vllm-model-")
        with open(os.path.join(_MODEL_DIR, "config.json"), "w") as f:
            json.dump(_OPT_125M, f)
    return _MODEL_DIR


def make_vllm_config(extra_config: dict[str, Any] | None, *, block_size: int = 16,
                     max_num_seqs: int = 8, max_num_batched_tokens: int = 256,
                     max_model_len: int = 512, hma: bool | None = None,
                     load_failure_policy: str = "recompute",
                     kv_transfer: dict[str, Any] | None = None,
                     kv_events: bool = False) -> VllmConfig:
    """A CPU VllmConfig with the adapter selected (``hma=None`` is vLLM's default, auto).

    ``kv_transfer`` overrides KVTransferConfig fields (e.g. another connector);
    ``kv_events`` enables KV cache events (``kv_events_config``, null publisher): without
    it vLLM, and so the wrapped connector, builds none.
    """
    model = ModelConfig(model=model_dir(), dtype="float16", trust_remote_code=True,
                        skip_tokenizer_init=True, max_model_len=max_model_len)
    sched = SchedulerConfig(max_num_seqs=max_num_seqs,
                            max_num_batched_tokens=max_num_batched_tokens,
                            max_model_len=max_model_len, enable_chunked_prefill=True,
                            is_encoder_decoder=False, disable_hybrid_kv_cache_manager=(
                                None if hma is None else not hma))
    ktc = KVTransferConfig(**{**ADAPTER, "kv_role": "kv_both",
                              "kv_connector_extra_config": extra_config or {},
                              "kv_load_failure_policy": load_failure_policy,
                              **(kv_transfer or {})})
    events = KVEventsConfig(enable_kv_cache_events=True, publisher="null") if kv_events else None
    return VllmConfig(model_config=model, scheduler_config=sched,
                      cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
                      kv_transfer_config=ktc, device_config=DeviceConfig("cpu"),
                      kv_events_config=events)
