"""Deterministic synthetic workloads (traces) and their JSONL form.

A *trace* is a list of requests, each with an arrival time, prompt tokens and a number of
tokens to generate. **Arrival is measured in engine steps**: the engine adds a request
before the first step whose index is ``>= arrival`` (so ``arrival=0`` means "before the
first step"). Fractions are allowed and simply round up to the next step.

Every generator draws from its own ``random.Random(seed)`` (never the global RNG), takes
all sizes as parameters and returns the same trace for the same arguments on every
machine. Token ids are drawn uniformly from ``[0, vocab)``.

Primitives:

- :class:`TraceRequest`, :class:`Trace` -- the records.
- :func:`multi_turn_chat` -- users sharing one system prompt, each conversation growing
  turn by turn (prefix reuse within a conversation and across users).
- :func:`repeated_documents` -- documents asked about several times, interleaved.
- :func:`private_prefixes` -- per-user prefixes salted with ``cache_salt`` (no sharing
  across users, even for identical tokens).
- :func:`repeated_prompts` -- prompts sent again unchanged (full-prompt hits that end
  part-way into a block).
- :func:`mixed` -- the three above (and optionally repeated prompts), merged by arrival;
  as the named workload ``mixed`` (the default of ``kvconnector run``) with the repeats.
- :data:`WORKLOADS`, :func:`get_workload` -- named defaults.
- :func:`load_trace_jsonl`, :func:`dump_trace_jsonl` -- one request per JSON line.

The records and the JSONL form live in ``_trace``, the generators in ``_synthetic``; this
module re-exports them and holds the named workloads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from kvconnector_core.engine._synthetic import (
    mixed,
    multi_turn_chat,
    private_prefixes,
    repeated_documents,
    repeated_prompts,
)
from kvconnector_core.engine._trace import (
    Trace,
    TraceFormatError,
    TraceRequest,
    dump_trace_jsonl,
    load_trace_jsonl,
)
from kvconnector_core.errors import ConfigError

__all__ = [
    "WORKLOADS",
    "Trace",
    "TraceFormatError",
    "TraceRequest",
    "UnknownWorkloadError",
    "dump_trace_jsonl",
    "get_workload",
    "load_trace_jsonl",
    "mixed",
    "multi_turn_chat",
    "private_prefixes",
    "repeated_documents",
    "repeated_prompts",
]


class UnknownWorkloadError(ConfigError):
    """No workload is registered under the requested name.

    Attributes:
        name: the requested name.
        known: the valid names.
    """

    def __init__(self, name: str, known: list[str]) -> None:
        from kvconnector_core._suggest import did_you_mean

        super().__init__(f"unknown workload {name!r}{did_you_mean(name, known)}; "
                         f"valid workloads: {', '.join(known)}")
        self.name = name
        self.known = known


def _chat_large(seed: int = 0) -> Trace:
    # The compare-with-vLLM benchmark trace: 100 users x 10 turns = 1000 requests; prompt
    # tokens = 100 * (10 * (512 + 64) + 45 * (64 + 96)) = 1,296,000.
    return multi_turn_chat(seed, num_users=100, turns=10, system_prompt_len=512,
                           user_turn_len=64, max_new_tokens=96, vocab=32000,
                           user_interval=1.0, turn_interval=100.0, name="chat_large")


#: Named workloads: name -> ``factory(seed) -> Trace``. ``mixed`` is the default of
#: ``kvconnector run``; ``chat_large`` (1000 requests, ~1.3M prompt tokens) is for benchmarks.
WORKLOADS: dict[str, Callable[[int], Trace]] = {
    "chat": functools.partial(multi_turn_chat, name="chat"),
    "documents": functools.partial(repeated_documents, name="documents"),
    "private": functools.partial(private_prefixes, name="private"),
    "mixed": functools.partial(mixed, full_prompt_hits=True, name="mixed"),
    "chat_large": _chat_large,
}


def get_workload(name: str, seed: int = 0) -> Trace:
    """Build a named workload.

    Args:
        name: a key of :data:`WORKLOADS`.
        seed: RNG seed.

    Returns:
        The trace.

    Raises:
        UnknownWorkloadError: ``name`` is not a key of :data:`WORKLOADS` (the message lists
            the valid names).
    """
    factory = WORKLOADS.get(name)
    if factory is None:
        raise UnknownWorkloadError(name, sorted(WORKLOADS))
    return factory(seed)
