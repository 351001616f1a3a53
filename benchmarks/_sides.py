"""The two implementations the benchmark drivers run on (re-exported by ``_drivers``, whose
docstring says how a :class:`Side` keeps both sides' work identical)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["BLOCK_SIZE", "SPECS", "KvconnectorSide", "Side", "VllmSide", "configure"]

BLOCK_SIZE = 16
"""Tokens per KV block (and per hashed block) in every workload (see :func:`configure`)."""

_MAX_MODEL_LEN = 8192
_SPEC = "full"
_WINDOW = 1024  # sliding window of the "sliding" and "hybrid" specs, in tokens

SPECS = ("full", "sliding", "hybrid")
"""Attention layouts the manager workload can run: one full-attention group, one
sliding-window group, or a full group plus a sliding-window group (hybrid)."""


def configure(*, block_size: int = 16, max_model_len: int = 8192, spec: str = "full",
              window: int = 1024) -> None:
    """Set the workload shape for sides constructed afterwards (both sides alike).

    Args:
        block_size: tokens per KV block and per hashed block.
        max_model_len: the managers' maximum sequence length (prompt + output).
        spec: one of :data:`SPECS`.
        window: sliding window in tokens (``"sliding"`` / ``"hybrid"``).

    Raises:
        ValueError: a value out of range, naming the valid ones.
    """
    global BLOCK_SIZE, _MAX_MODEL_LEN, _SPEC, _WINDOW
    if spec not in SPECS:
        raise ValueError(f"unknown spec {spec!r}; valid: {', '.join(SPECS)}")
    if block_size < 1 or max_model_len < block_size or window < 1:
        raise ValueError(f"need block_size >= 1, max_model_len >= block_size, window >= 1; got "
                         f"{block_size}, {max_model_len}, {window}")
    BLOCK_SIZE, _MAX_MODEL_LEN, _SPEC, _WINDOW = block_size, max_model_len, spec, window


def _groups(group_cls: Any, full: Any, sliding: Any) -> list[Any]:
    # The configured layout as KV cache groups of one implementation's classes.
    if _SPEC == "full":
        return [group_cls(["layer.0"], full)]
    if _SPEC == "sliding":
        return [group_cls(["layer.0"], sliding)]
    return [group_cls(["layer.0"], full), group_cls(["layer.1"], sliding)]


class Side:
    """One implementation under test: constructors and the calls whose shapes differ.

    Attributes:
        name: short label used in tables (``"kvconnector"`` or ``"vllm"``).
    """

    name = "?"

    def new_pool(self, num_blocks: int, *, events: bool = False) -> Any:
        """A block pool with prefix caching enabled."""
        raise NotImplementedError

    def new_request(self, request_id: str, prompt: list[int], max_tokens: int) -> Any:
        """A request whose prompt block hashes (``BLOCK_SIZE`` tokens) are computed."""
        raise NotImplementedError

    def new_manager(self, num_blocks: int, *, events: bool = False) -> Any:
        """A single-group full-attention KV cache manager over ``num_blocks`` blocks."""
        raise NotImplementedError

    def get_computed_blocks(self, manager: Any, request: Any) -> tuple[Any, int]:
        """``(blocks, num_computed_tokens)`` of the manager's prefix-cache lookup."""
        raise NotImplementedError

    def set_status(self, request: Any, status: str) -> None:
        """Set ``request.status`` to the implementation's ``RUNNING`` / ``PREEMPTED``."""
        raise NotImplementedError

    def block_hasher(self) -> Callable[[bytes | None, Sequence[int]], bytes]:
        """``f(parent, tokens) -> hash`` with the implementation's default hash."""
        raise NotImplementedError

    def event_codec(self) -> tuple[Any, Callable[[Any], bytes], Callable[[bytes], Any]]:
        """``(events module, encode, decode)`` for KV event batches."""
        raise NotImplementedError

    def offload_keys(self, chains: list[list[bytes]]) -> list[list[Any]]:
        """The implementation's offload keys for each chain, built before any timing.

        Both connectors build a request's keys once, when it arrives, not per lookup.
        """
        return chains

    def offload_runner(self, num_blocks: int, policy: str) -> Callable[..., int]:
        """A fresh CPU offloading manager, wrapped as ``run(keys, req_id, local=0) -> hits``.

        ``keys`` come from :meth:`offload_keys`. ``run`` performs one request's offload
        protocol the way the implementation's own connector drives its manager: the first
        ``local`` keys are GPU prefix-cache hits; look up the leading ready keys after them,
        pin and release them as a load, record the use, store the rest (keys already held
        are skipped by the manager).
        """
        raise NotImplementedError


class KvconnectorSide(Side):
    """kvconnector's core (``kvconnector_core``) and CPU offload manager."""

    name = "kvconnector"

    def __init__(self) -> None:
        from kvconnector_core.request import Request, RequestStatus

        self._Request = Request
        self._status = {"RUNNING": RequestStatus.RUNNING, "PREEMPTED": RequestStatus.PREEMPTED}

    def new_pool(self, num_blocks: int, *, events: bool = False) -> Any:
        from kvconnector_core.kv_cache.block_pool import BlockPool

        return BlockPool(num_blocks, True, BLOCK_SIZE, enable_kv_cache_events=events)

    def new_request(self, request_id: str, prompt: list[int], max_tokens: int) -> Any:
        return self._Request(request_id, prompt, max_tokens, hash_block_size=BLOCK_SIZE)

    def new_manager(self, num_blocks: int, *, events: bool = False) -> Any:
        from kvconnector_core.kv_cache.kv_cache_manager import KVCacheManager
        from kvconnector_core.kv_cache.kv_cache_spec import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            SlidingWindowSpec,
        )

        full = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=8, head_size=128)
        sliding = SlidingWindowSpec(block_size=BLOCK_SIZE, num_kv_heads=8, head_size=128,
                                    sliding_window=_WINDOW)
        config = KVCacheConfig(num_blocks=num_blocks,
                               kv_cache_groups=_groups(KVCacheGroupSpec, full, sliding))
        return KVCacheManager(config, _MAX_MODEL_LEN, _MAX_MODEL_LEN,
                              scheduler_block_size=BLOCK_SIZE, hash_block_size=BLOCK_SIZE,
                              enable_caching=True, enable_kv_cache_events=events)

    def get_computed_blocks(self, manager: Any, request: Any) -> tuple[Any, int]:
        return manager.get_computed_blocks(request)

    def set_status(self, request: Any, status: str) -> None:
        request.status = self._status[status]

    def block_hasher(self) -> Callable[[bytes | None, Sequence[int]], bytes]:
        from kvconnector_core.kv_cache.hashing import hash_block_tokens

        return hash_block_tokens

    def event_codec(self) -> tuple[Any, Callable[[Any], bytes], Callable[[bytes], Any]]:
        from kvconnector_core import kv_events

        return kv_events, kv_events.encode_event_batch, kv_events.decode_event_batch

    def offload_runner(self, num_blocks: int, policy: str) -> Callable[..., int]:
        from connectors.offload.manager import CPUOffloadingManager, RequestAccess

        m = CPUOffloadingManager(num_blocks, cache_policy=policy)

        def run(keys: list[bytes], req_id: str, local: int = 0) -> int:
            # As OffloadingConnector does: load the leading ready keys after the GPU hit
            # (update_state_after_alloc; a use now), offer for storing the keys after the
            # load, or all of them when nothing loads (build_connector_meta: held keys are
            # a use, the others are stored), and commit the recency of every key it
            # loaded, stored or offered when it finishes (request_finished).
            access = RequestAccess(position={k: i + 1 for i, k in enumerate(keys)})
            hits = m.lookup(keys[local:])
            loaded = keys[local:local + hits]
            if hits:
                m.prepare_load(loaded, access)
                m.complete_load(loaded)
            out = m.prepare_store(keys[local + hits:] if hits else keys, access)
            if out is not None and out.keys_to_store:
                m.complete_store(out.keys_to_store)
            if access.seen:
                m.finish_request(sorted(access.seen, key=access.position.__getitem__),
                                 access.reused, access.stored_only)
            return hits

        return run


class VllmSide(Side):
    """vLLM 0.33's pure-Python core (``vllm.v1.core``, ``vllm.v1.kv_offload``).

    Importing vLLM takes seconds; construct this once, outside any timed loop.
    Block hashes use vLLM's default ``sha256`` (pickle + SHA-256) with its default
    ``NONE_HASH`` seed.

    Raises:
        ImportError: vLLM is not installed.
    """

    name = "vllm"

    def __init__(self) -> None:
        import torch
        from vllm.distributed import kv_events
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core import kv_cache_utils
        from vllm.v1.request import Request, RequestStatus

        kv_cache_utils.init_none_hash(sha256)
        self._torch = torch
        self._kv_cache_utils = kv_cache_utils
        self._sha256 = sha256
        self._kv_events = kv_events
        self._Request = Request
        self._SamplingParams = SamplingParams
        self._hasher = kv_cache_utils.get_request_block_hasher(BLOCK_SIZE, sha256)
        self._status = {"RUNNING": RequestStatus.RUNNING, "PREEMPTED": RequestStatus.PREEMPTED}

    def new_pool(self, num_blocks: int, *, events: bool = False) -> Any:
        from vllm.v1.core.block_pool import BlockPool

        return BlockPool(num_blocks, True, BLOCK_SIZE, enable_kv_cache_events=events)

    def new_request(self, request_id: str, prompt: list[int], max_tokens: int) -> Any:
        return self._Request(request_id, prompt, self._SamplingParams(max_tokens=max_tokens),
                             None, arrival_time=0.0, block_hasher=self._hasher)

    def new_manager(self, num_blocks: int, *, events: bool = False) -> Any:
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            SlidingWindowSpec,
        )

        dtype = self._torch.bfloat16
        full = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=8, head_size=128, dtype=dtype)
        sliding = SlidingWindowSpec(block_size=BLOCK_SIZE, num_kv_heads=8, head_size=128,
                                    dtype=dtype, sliding_window=_WINDOW)
        config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                               kv_cache_groups=_groups(KVCacheGroupSpec, full, sliding))
        return KVCacheManager(config, _MAX_MODEL_LEN, BLOCK_SIZE, BLOCK_SIZE,
                              enable_caching=True, enable_kv_cache_events=events)

    def get_computed_blocks(self, manager: Any, request: Any) -> tuple[Any, int]:
        blocks, num_computed, _shared_prefix_boundary = manager.get_computed_blocks(request)
        return blocks, num_computed

    def set_status(self, request: Any, status: str) -> None:
        request.status = self._status[status]

    def block_hasher(self) -> Callable[[bytes | None, Sequence[int]], bytes]:
        hash_block_tokens = self._kv_cache_utils.hash_block_tokens
        sha256 = self._sha256

        def f(parent: bytes | None, tokens: Sequence[int]) -> bytes:
            return hash_block_tokens(sha256, parent, tokens, None)

        return f

    def event_codec(self) -> tuple[Any, Callable[[Any], bytes], Callable[[bytes], Any]]:
        import msgspec

        # What vLLM's ZmqEventPublisher and its consumers use.
        encoder = msgspec.msgpack.Encoder()
        decoder = msgspec.msgpack.Decoder(type=self._kv_events.KVEventBatch)
        return self._kv_events, encoder.encode, decoder.decode

    def offload_keys(self, chains: list[list[bytes]]) -> list[list[bytes]]:
        """Each hash with the 4-byte KV cache group index appended, as vLLM's connector keys."""
        group = (0).to_bytes(4, "big")
        return [[k + group for k in keys] for keys in chains]

    def offload_runner(self, num_blocks: int, policy: str) -> Callable[..., int]:
        from vllm.v1.kv_offload.base import LookupResult, ReqContext
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

        m = CPUOffloadingManager(num_blocks, cache_policy=policy)
        hit = LookupResult.HIT
        block_size = BLOCK_SIZE

        def run(okeys: list[bytes], req_id: str, local: int = 0) -> int:
            # vLLM 0.33's offloading connector: per-request context with each key's token
            # position, per-key lookups after the GPU hit, recency committed at request
            # finish (no touch).
            ctx = ReqContext(req_id=req_id)
            m.on_new_request(ctx)
            for i, k in enumerate(okeys):
                ctx.set_offload_key_position(k, (i + 1) * block_size)
            hits = 0
            for k in okeys[local:]:
                if m.lookup(k, ctx) is not hit:
                    break
                hits += 1
            if hits:
                loaded = okeys[local:local + hits]
                m.prepare_load(loaded, ctx)
                m.complete_load(loaded, ctx)
            # CHUNK_LEVEL (the default): after a load, storing starts after the loaded
            # chunks; without one it starts at chunk 0 (GPU-hit chunks are offered).
            out = m.prepare_store(okeys[local + hits:] if hits else okeys, ctx)
            if out is not None and out.keys_to_store:
                m.complete_store(out.keys_to_store, ctx)
            m.on_request_finished(ctx)
            return hits

        return run
