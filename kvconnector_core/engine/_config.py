"""The engine's settings: :class:`EngineConfig` (imported from ``engine``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvconnector_core.connector.config import KVConnectorConfig
from kvconnector_core.errors import ConfigError
from kvconnector_core.event_publisher import EventPublisherConfig
from kvconnector_core.kv_cache.kv_cache_spec import (
    KVCacheConfig,
    get_kv_cache_config,
    kv_cache_bytes_per_block,
)
from kvconnector_core.worker.model import ModelConfig

__all__ = ["DEVICES", "EngineConfig"]

DEVICES = ("cpu", "cuda")
"""Valid values of :attr:`EngineConfig.device`."""

# Exactness of the integer model needs fewer than 2**21 keys per attention (see model.py).
_MAX_MODEL_LEN_LIMIT = 2**20


@dataclass(frozen=True)
class EngineConfig:
    """Everything an :class:`Engine` needs.

    Attributes:
        model: the model (layers, sizes, seed).
        num_gpu_blocks: blocks in the GPU pool (block 0 is the null block).
        block_size: tokens per block (also the hash and scheduler block size).
        max_num_batched_tokens: token budget of one step (prefills are chunked to fit).
        max_num_seqs: most requests running at once.
        max_model_len: longest sequence (prompt + output) a request may reach.
        enable_prefix_caching: reuse cached prefix blocks in the GPU pool.
        enable_kv_cache_events: record KV events (counted in the metrics); None (the
            default): only when ``kv_events_publisher`` is set. Off, neither the block
            pool nor the connector builds any (as vLLM 0.33 without ``kv_events_config``).
        device: ``"cpu"`` or ``"cuda"``.
        connector: the connector to create (both roles), or None.
        load_failure_policy: ``"recompute"`` or ``"fail"``; None takes the connector
            config's policy (``"recompute"`` without a connector).
        kv_events_publisher: publish each step's KV events over ZeroMQ in vLLM's wire
            format (see :mod:`kvconnector_core.event_publisher`); None publishes nothing.
        reserve_full_output: admit a request only when its whole output fits (fewer
            preemptions, fewer requests at once); default False counts the tokens a
            request has now, as vLLM 0.33 does (``docs/admission.md``).
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    num_gpu_blocks: int = 256
    block_size: int = 16
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 32
    max_model_len: int = 2048
    enable_prefix_caching: bool = True
    enable_kv_cache_events: bool | None = None
    device: str = "cpu"
    connector: KVConnectorConfig | None = None
    load_failure_policy: str | None = None
    kv_events_publisher: EventPublisherConfig | None = None
    reserve_full_output: bool = False

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            msg = f"EngineConfig.device={self.device!r}; valid devices: {', '.join(DEVICES)}"
            raise ConfigError(msg)
        for name in ("num_gpu_blocks", "block_size", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                msg = f"EngineConfig.{name} must be >= 1, got {getattr(self, name)!r}"
                raise ConfigError(msg)
        if not 2 <= self.max_model_len <= _MAX_MODEL_LEN_LIMIT:
            msg = (f"EngineConfig.max_model_len={self.max_model_len}; must be in "
                   f"[2, {_MAX_MODEL_LEN_LIMIT}] (the integer model is exact up to that length)")
            raise ConfigError(msg)
        if isinstance(self.connector, dict):
            object.__setattr__(self, "connector", KVConnectorConfig.from_dict(self.connector))
        if self.enable_kv_cache_events is False and self.kv_events_publisher is not None:
            msg = ("EngineConfig.kv_events_publisher is set but enable_kv_cache_events=False; "
                   "valid: True or None (on with a publisher)")
            raise ConfigError(msg)

    @property
    def kv_events_enabled(self) -> bool:
        """Whether KV events are built: ``enable_kv_cache_events``, or a publisher when None."""
        if self.enable_kv_cache_events is None:
            return self.kv_events_publisher is not None
        return self.enable_kv_cache_events

    @property
    def effective_load_failure_policy(self) -> str:
        """The policy the scheduler gets."""
        if self.load_failure_policy is not None:
            return self.load_failure_policy
        return self.connector.load_failure_policy if self.connector is not None else "recompute"

    @property
    def min_num_gpu_blocks(self) -> int:
        """The smallest ``num_gpu_blocks`` that holds one request of ``max_model_len`` tokens
        (the null block included), as :meth:`kv_cache_config` checks it."""
        specs = set(self.model.kv_cache_specs(self.block_size).values())
        return 1 + sum(s.max_admission_blocks_per_request(self.max_num_batched_tokens,
                                                          self.max_model_len) for s in specs)

    def kv_cache_config(self) -> KVCacheConfig:
        """The KV cache layout: the model's specs grouped, ``num_gpu_blocks`` blocks.

        Raises:
            ConfigError: the pool cannot hold one request of ``max_model_len`` tokens.
        """
        specs = self.model.kv_cache_specs(self.block_size)
        bytes_per_block = kv_cache_bytes_per_block(specs)
        try:
            return get_kv_cache_config(specs, self.num_gpu_blocks * bytes_per_block,
                                       self.max_model_len, self.max_num_batched_tokens)
        except ConfigError as exc:
            msg = (f"num_gpu_blocks={self.num_gpu_blocks} is too small for max_model_len="
                   f"{self.max_model_len} with block_size={self.block_size}; it must be at "
                   f"least {self.min_num_gpu_blocks} ({exc})")
            raise ConfigError(msg) from None
