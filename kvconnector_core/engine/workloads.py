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
- :func:`mixed` -- the three above, merged by arrival (the default of ``kvconnector run``).
- :data:`WORKLOADS`, :func:`get_workload` -- named defaults.
- :func:`load_trace_jsonl`, :func:`dump_trace_jsonl` -- one request per JSON line.
"""

from __future__ import annotations

import functools
import heapq
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated

import msgspec

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
]

_NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0)]
_TokenId = Annotated[int, msgspec.Meta(ge=0)]
_PositiveInt = Annotated[int, msgspec.Meta(ge=1)]


class TraceRequest(msgspec.Struct, forbid_unknown_fields=True):
    """One request of a trace.

    Attributes:
        arrival: engine step at which the request is added (``>= 0``; see module doc).
        prompt_token_ids: the prompt (at least one token, ids ``>= 0``).
        max_new_tokens: tokens to generate (``>= 1``); our model has no EOS, so every
            request generates exactly this many.
        cache_salt: isolates the request's prefix-cache entries from other salts.
        request_id: unique id; ``None`` lets the engine assign ``req-<index>``.
    """

    arrival: _NonNegativeFloat
    prompt_token_ids: Annotated[list[_TokenId], msgspec.Meta(min_length=1)]
    max_new_tokens: _PositiveInt
    cache_salt: str | None = None
    request_id: str | None = None


class Trace(msgspec.Struct):
    """A named list of requests, sorted by arrival.

    Attributes:
        name: what generated the trace (workload name or file name).
        requests: the requests, sorted by ``arrival`` (stable for ties).
    """

    name: str
    requests: list[TraceRequest]

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[TraceRequest]:
        return iter(self.requests)

    @property
    def num_prompt_tokens(self) -> int:
        """Total number of prompt tokens over all requests."""
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        """Total number of tokens the trace asks to generate."""
        return sum(r.max_new_tokens for r in self.requests)


class TraceFormatError(ConfigError):
    """A trace file (or trace value) is malformed.

    Attributes:
        path: the file, if any.
        line_number: 1-based line of the bad record, if known.
        field: the offending field path (e.g. ``$.max_new_tokens``), if known.
    """

    def __init__(self, msg: str, *, path: str | None = None, line_number: int | None = None,
                 field: str | None = None) -> None:
        super().__init__(msg)
        self.path = path
        self.line_number = line_number
        self.field = field


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


def _check_positive(**values: int) -> None:
    for key, value in values.items():
        if value < 1:
            msg = f"{key} must be >= 1, got {value!r}"
            raise ConfigError(msg)


def _check_non_negative(**values: float) -> None:
    for key, value in values.items():
        if value < 0:
            msg = f"{key} must be >= 0, got {value!r}"
            raise ConfigError(msg)


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    # choices() maps random() to an index with a fixed formula, so the sequence is the
    # same on every Python >= 3.6; it is also ~5x faster than calling randrange per token.
    return rng.choices(range(vocab), k=n)


def _sorted_trace(name: str, requests: list[TraceRequest]) -> Trace:
    # sort() is stable, so ties keep generation order (deterministic).
    requests.sort(key=lambda r: r.arrival)
    return Trace(name=name, requests=requests)


def multi_turn_chat(
    seed: int = 0,
    num_users: int = 8,
    turns: int = 4,
    system_prompt_len: int = 256,
    user_turn_len: int = 32,
    max_new_tokens: int = 16,
    vocab: int = 1000,
    *,
    user_interval: float = 2.0,
    turn_interval: float = 40.0,
    jitter: float = 0.0,
    name: str = "chat",
) -> Trace:
    """Multi-turn chat: every user shares one system prompt; conversations grow.

    Turn ``t`` of user ``u`` has prompt ``system + (user_1 + answer_1) + ... + user_t``,
    i.e. the previous turn's prompt, then that turn's answer, then new user tokens. The
    generator cannot know what the model will answer (the model is deterministic but not
    simulated here), so each "answer" is ``max_new_tokens`` synthetic tokens drawn from the
    same RNG. The prefix-cache consequence is the same as in real chat: a turn re-uses the
    previous turn's whole prompt, but not the tokens the engine generated.

    Args:
        seed: RNG seed.
        num_users: number of conversations.
        turns: turns per conversation.
        system_prompt_len: tokens of the shared system prompt (0 for none).
        user_turn_len: new user tokens per turn.
        max_new_tokens: tokens generated per turn (and length of each synthetic answer).
        vocab: token ids are drawn from ``[0, vocab)``.
        user_interval: steps between the first turns of consecutive users.
        turn_interval: steps between consecutive turns of one user.
        jitter: each arrival gets ``uniform(0, jitter)`` extra steps.
        name: name of the returned trace.

    Returns:
        ``num_users * turns`` requests with ids ``chat-u<user>-t<turn>``, sorted by arrival.

    Raises:
        ConfigError: a size is out of range.
    """
    _check_positive(num_users=num_users, turns=turns, user_turn_len=user_turn_len,
                    max_new_tokens=max_new_tokens, vocab=vocab)
    _check_non_negative(system_prompt_len=system_prompt_len, user_interval=user_interval,
                        turn_interval=turn_interval, jitter=jitter)
    rng = random.Random(seed)
    system = _tokens(rng, system_prompt_len, vocab)
    requests: list[TraceRequest] = []
    for user in range(num_users):
        # Extend one growing list and snapshot it per turn: O(total tokens), which keeps a
        # 1000-request / 1M-token trace well under a second.
        conversation = list(system)
        for turn in range(turns):
            if turn:
                conversation += _tokens(rng, max_new_tokens, vocab)  # synthetic answer
            conversation += _tokens(rng, user_turn_len, vocab)
            arrival = user * user_interval + turn * turn_interval
            if jitter:
                arrival += rng.uniform(0.0, jitter)
            requests.append(TraceRequest(
                arrival=arrival, prompt_token_ids=conversation.copy(),
                max_new_tokens=max_new_tokens, request_id=f"chat-u{user}-t{turn}",
            ))
    return _sorted_trace(name, requests)


def repeated_documents(
    seed: int = 0,
    num_docs: int = 6,
    doc_len: int = 384,
    questions_per_doc: int = 4,
    question_len: int = 24,
    max_new_tokens: int = 16,
    vocab: int = 1000,
    *,
    arrival_interval: float = 3.0,
    name: str = "documents",
) -> Trace:
    """Documents asked about repeatedly: each request is ``document + question``.

    All questions are shuffled together (one RNG), so asks of the same document are spread
    over time with other documents in between -- a document's blocks may have been evicted
    from the GPU pool by the time it is asked about again, which is what a connector is for.

    Args:
        seed: RNG seed.
        num_docs: number of distinct documents.
        doc_len: tokens per document.
        questions_per_doc: requests per document.
        question_len: tokens per question.
        max_new_tokens: tokens generated per request.
        vocab: token ids are drawn from ``[0, vocab)``.
        arrival_interval: steps between consecutive requests.
        name: name of the returned trace.

    Returns:
        ``num_docs * questions_per_doc`` requests with ids ``doc-d<doc>-q<question>``.

    Raises:
        ConfigError: a size is out of range.
    """
    _check_positive(num_docs=num_docs, doc_len=doc_len, questions_per_doc=questions_per_doc,
                    question_len=question_len, max_new_tokens=max_new_tokens, vocab=vocab)
    _check_non_negative(arrival_interval=arrival_interval)
    rng = random.Random(seed)
    docs = [_tokens(rng, doc_len, vocab) for _ in range(num_docs)]
    order = [(d, q) for d in range(num_docs) for q in range(questions_per_doc)]
    rng.shuffle(order)
    requests = [
        TraceRequest(
            arrival=i * arrival_interval,
            prompt_token_ids=docs[d] + _tokens(rng, question_len, vocab),
            max_new_tokens=max_new_tokens, request_id=f"doc-d{d}-q{q}",
        )
        for i, (d, q) in enumerate(order)
    ]
    return _sorted_trace(name, requests)


def private_prefixes(
    seed: int = 0,
    num_users: int = 6,
    prefix_len: int = 256,
    requests_per_user: int = 3,
    suffix_len: int = 32,
    max_new_tokens: int = 16,
    vocab: int = 1000,
    *,
    identical_prefix_tokens: bool = False,
    arrival_interval: float = 3.0,
    name: str = "private",
) -> Trace:
    """Many users, each with a private prefix isolated by ``cache_salt``.

    Every request of user ``u`` is ``prefix_u + suffix`` with ``cache_salt="user-<u>"``:
    the prefix is reused within the user and must never be served across users. With
    ``identical_prefix_tokens`` every user gets the *same* prefix tokens, so only the salt
    keeps them apart (a test of salting in the prefix cache and in connectors).

    Args:
        seed: RNG seed.
        num_users: number of users.
        prefix_len: tokens of each user's prefix.
        requests_per_user: requests per user.
        suffix_len: fresh tokens per request.
        max_new_tokens: tokens generated per request.
        vocab: token ids are drawn from ``[0, vocab)``.
        identical_prefix_tokens: give every user the same prefix tokens.
        arrival_interval: steps between consecutive requests.
        name: name of the returned trace.

    Returns:
        ``num_users * requests_per_user`` requests with ids ``priv-u<user>-r<request>``,
        users interleaved round-robin.

    Raises:
        ConfigError: a size is out of range.
    """
    _check_positive(num_users=num_users, prefix_len=prefix_len,
                    requests_per_user=requests_per_user, suffix_len=suffix_len,
                    max_new_tokens=max_new_tokens, vocab=vocab)
    _check_non_negative(arrival_interval=arrival_interval)
    rng = random.Random(seed)
    shared = _tokens(rng, prefix_len, vocab) if identical_prefix_tokens else None
    prefixes = [shared if shared is not None else _tokens(rng, prefix_len, vocab)
                for _ in range(num_users)]
    requests: list[TraceRequest] = []
    for r in range(requests_per_user):
        for u in range(num_users):
            requests.append(TraceRequest(
                arrival=len(requests) * arrival_interval,
                prompt_token_ids=prefixes[u] + _tokens(rng, suffix_len, vocab),
                max_new_tokens=max_new_tokens, cache_salt=f"user-{u}",
                request_id=f"priv-u{u}-r{r}",
            ))
    return _sorted_trace(name, requests)


def mixed(seed: int = 0, vocab: int = 1000, *, scale: int = 1, name: str = "mixed") -> Trace:
    """Chat, documents and private prefixes together, merged by arrival.

    The three parts use seeds derived from ``seed`` and keep their id prefixes (``chat-``,
    ``doc-``, ``priv-``), so ids stay unique.

    Args:
        seed: RNG seed.
        vocab: token ids are drawn from ``[0, vocab)``.
        scale: multiplies the number of users/documents of each part.
        name: name of the returned trace.

    Returns:
        The merged trace.

    Raises:
        ConfigError: ``scale`` is below 1.
    """
    _check_positive(scale=scale)
    parts = [
        multi_turn_chat(seed * 3 + 0, num_users=4 * scale, turns=3, system_prompt_len=192,
                        user_turn_len=32, max_new_tokens=12, vocab=vocab,
                        user_interval=3.0, turn_interval=45.0),
        repeated_documents(seed * 3 + 1, num_docs=4 * scale, doc_len=320, questions_per_doc=3,
                           question_len=24, max_new_tokens=12, vocab=vocab,
                           arrival_interval=4.0),
        private_prefixes(seed * 3 + 2, num_users=4 * scale, prefix_len=192,
                         requests_per_user=2, suffix_len=24, max_new_tokens=12, vocab=vocab,
                         identical_prefix_tokens=True, arrival_interval=5.0),
    ]
    merged = list(heapq.merge(*(p.requests for p in parts), key=lambda r: r.arrival))
    return Trace(name=name, requests=merged)


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
    "mixed": functools.partial(mixed, name="mixed"),
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


_line_decoder = msgspec.json.Decoder(TraceRequest)
_line_encoder = msgspec.json.Encoder()


def _field_of(message: str) -> str | None:
    # msgspec ends validation messages with "- at `$.field[3]`".
    marker = " - at `"
    idx = message.rfind(marker)
    return message[idx + len(marker):-1] if idx >= 0 and message.endswith("`") else None


def load_trace_jsonl(path: str | Path, vocab_size: int | None = None) -> Trace:
    """Read a trace: one JSON object per line with the fields of :class:`TraceRequest`.

    Blank lines are skipped. Requests are sorted by arrival; the trace is named after the
    file's stem.

    Args:
        path: the ``.jsonl`` file.
        vocab_size: if given, every prompt token id must lie in ``[0, vocab_size)``.

    Returns:
        The trace.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        TraceFormatError: a line is not valid JSON, misses or mistypes a field, has an
            unknown field, reuses a ``request_id`` (the message names both lines), or has
            a token id outside ``[0, vocab_size)``; the message names the file, the
            1-based line number and the field.
    """
    path = Path(path)
    requests: list[TraceRequest] = []
    seen_ids: dict[str, int] = {}
    with path.open("rb") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                req = _line_decoder.decode(line)
            except msgspec.ValidationError as exc:
                field = _field_of(str(exc))
                msg = f"{path}:{line_number}: invalid trace request: {exc}"
                raise TraceFormatError(msg, path=str(path), line_number=line_number,
                                       field=field) from None
            except msgspec.DecodeError as exc:
                msg = f"{path}:{line_number}: not a JSON object: {exc}"
                raise TraceFormatError(msg, path=str(path), line_number=line_number) from None
            if req.request_id is not None:
                if req.request_id in seen_ids:
                    msg = (f"{path}:{line_number}: duplicate request_id {req.request_id!r} "
                           f"(first used on line {seen_ids[req.request_id]}) - at "
                           "`$.request_id`")
                    raise TraceFormatError(msg, path=str(path), line_number=line_number,
                                           field="$.request_id")
                seen_ids[req.request_id] = line_number
            if vocab_size is not None:
                bad = next((i for i, t in enumerate(req.prompt_token_ids)
                            if not 0 <= t < vocab_size), None)
                if bad is not None:
                    field = f"$.prompt_token_ids[{bad}]"
                    msg = (f"{path}:{line_number}: token id {req.prompt_token_ids[bad]} is outside "
                           f"the model vocabulary; valid token ids are 0..{vocab_size - 1} - at "
                           f"`{field}`")
                    raise TraceFormatError(msg, path=str(path), line_number=line_number,
                                           field=field)
            requests.append(req)
    return _sorted_trace(path.stem, requests)


def dump_trace_jsonl(trace: Trace | list[TraceRequest], path: str | Path) -> None:
    """Write a trace as JSONL (one :class:`TraceRequest` per line), readable by
    :func:`load_trace_jsonl`.

    Args:
        trace: a :class:`Trace` or a plain list of requests.
        path: destination file (overwritten).
    """
    requests = trace.requests if isinstance(trace, Trace) else trace
    with Path(path).open("wb") as f:
        for req in requests:
            f.write(_line_encoder.encode(req))
            f.write(b"\n")
