"""A generation request as the scheduler and the KV cache manager see it."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from typing import Any

from kvconnector_core.errors import ConfigError
from kvconnector_core.kv_cache.hashing import BlockHash, hash_request_tokens

__all__ = ["LoRARequestRef", "Request", "RequestStatus", "lora_name_of"]


class LoRARequestRef:
    """The LoRA adapter of a request, shaped like vLLM's ``LoRARequest`` where connectors read it.

    Attributes:
        lora_name: the adapter's name.
    """

    __slots__ = ("lora_name",)

    def __init__(self, lora_name: str) -> None:
        self.lora_name = lora_name

    def __repr__(self) -> str:
        return f"LoRARequestRef({self.lora_name!r})"


def lora_name_of(request: object) -> str | None:
    """The LoRA adapter name of a kvconnector or vLLM request, or None.

    Connectors run in both engines, and vLLM's ``Request`` has ``lora_request``
    (None or an object with ``lora_name``) but no ``lora_name``: read it through
    this function (or ``request.lora_request``), never ``request.lora_name``.
    """
    lora = getattr(request, "lora_request", None)
    return None if lora is None else lora.lora_name


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request. Values above ``PREEMPTED`` are finished states."""

    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        """Whether ``status`` is one of the finished states."""
        return status > RequestStatus.PREEMPTED


class Request:
    """One generation request: its tokens, progress and chained block hashes.

    ``block_hashes`` always holds the hash of every *full* block of
    ``all_token_ids`` (blocks of ``hash_block_size`` tokens); it grows as
    output tokens are appended, so the prefix cache can reuse generated text
    in later turns.

    Args:
        request_id: unique id.
        prompt_token_ids: the prompt; must not be empty.
        max_tokens: number of tokens to generate (>= 1).
        cache_salt: per-tenant salt; requests with different salts never share blocks.
        lora_name: LoRA adapter name, part of every block hash.
        hash_block_size: tokens per hashed block; None disables hashing.
        arrival_time: when the request arrived (engine steps or seconds).
        eos_token_id: stop when this token is sampled (None: length-capped only).

    Raises:
        ConfigError: empty prompt or ``max_tokens < 1``.
    """

    __slots__ = (
        "request_id", "prompt_token_ids", "output_token_ids", "all_token_ids", "max_tokens",
        "cache_salt", "lora_name", "hash_block_size", "arrival_time", "eos_token_id",
        "status", "num_computed_tokens", "num_preemptions", "block_hashes",
        "num_external_computed_tokens", "kv_transfer_params",
        "stop_reason",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        hash_block_size: int | None = None,
        arrival_time: float = 0.0,
        eos_token_id: int | None = None,
    ) -> None:
        if len(prompt_token_ids) == 0:
            raise ConfigError(
                f"request {request_id!r}: prompt_token_ids is empty; give at least one token")
        if max_tokens < 1:
            raise ConfigError(f"request {request_id!r}: max_tokens={max_tokens}; must be >= 1")
        self.request_id = request_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.max_tokens = max_tokens
        self.cache_salt = cache_salt
        self.lora_name = lora_name
        self.hash_block_size = hash_block_size
        self.arrival_time = arrival_time
        self.eos_token_id = eos_token_id
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.num_external_computed_tokens = 0
        self.kv_transfer_params: dict[str, Any] | None = None
        self.stop_reason: str | None = None
        self.block_hashes: list[BlockHash] = []
        self._update_block_hashes()

    @property
    def lora_request(self) -> LoRARequestRef | None:
        """The LoRA adapter as vLLM's ``Request.lora_request`` exposes it (None without one)."""
        return None if self.lora_name is None else LoRARequestRef(self.lora_name)

    def _update_block_hashes(self) -> None:
        if self.hash_block_size is None:
            return
        if len(self.all_token_ids) // self.hash_block_size > len(self.block_hashes):
            self.block_hashes.extend(
                hash_request_tokens(
                    self.all_token_ids,
                    self.hash_block_size,
                    lora_name=self.lora_name,
                    cache_salt=self.cache_salt,
                    existing=self.block_hashes,
                )
            )

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens so far."""
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the prompt."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Number of generated tokens so far."""
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        """Append generated token(s) and extend ``block_hashes`` accordingly."""
        if isinstance(token_ids, int):
            token_ids = (token_ids,)
        for tok in token_ids:
            self.output_token_ids.append(tok)
            self.all_token_ids.append(tok)
        self._update_block_hashes()

    def is_finished(self) -> bool:
        """Whether the request reached a finished state."""
        return RequestStatus.is_finished(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, status={self.status.name})"
        )
