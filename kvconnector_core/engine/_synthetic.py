"""The synthetic workload generators; ``workloads`` documents them and names the defaults."""

from __future__ import annotations

import heapq
import random

from kvconnector_core.engine._trace import Trace, TraceRequest, _sorted_trace
from kvconnector_core.errors import ConfigError

__all__ = ["mixed", "multi_turn_chat", "private_prefixes", "repeated_documents", "repeated_prompts"]


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


def repeated_prompts(
    seed: int = 0,
    prompt_lens: tuple[int, ...] = (64, 128, 88),
    repeats: int = 2,
    max_new_tokens: int = 4,
    vocab: int = 1000,
    *,
    arrival_interval: float = 2.0,
    repeat_interval: float = 20.0,
    name: str = "repeats",
) -> Trace:
    """Prompts sent again unchanged: full-prompt hits.

    A repeated prompt is served from the cache up to its last token, so the hit of a
    block-aligned prompt (the defaults 64 and 128 are multiples of the 16-token block; 88
    is not) ends part-way into its last block, at ``len - 1``: a connector that skips the
    block a hit ends in part-way leaves that block unloaded, and the outputs differ from a
    run without it.

    Args:
        seed: RNG seed.
        prompt_lens: one prompt per length.
        repeats: how many times each prompt is sent (the first one stores it).
        max_new_tokens: tokens generated per request.
        vocab: token ids are drawn from ``[0, vocab)``.
        arrival_interval: steps between the prompts' first requests.
        repeat_interval: steps between the sends of one prompt.
        name: name of the returned trace.

    Returns:
        ``len(prompt_lens) * repeats`` requests with ids ``rep-p<prompt>-r<send>``.

    Raises:
        ConfigError: a size is out of range.
    """
    _check_positive(repeats=repeats, max_new_tokens=max_new_tokens, vocab=vocab,
                    num_prompts=len(prompt_lens), shortest_prompt=min(prompt_lens, default=1))
    _check_non_negative(arrival_interval=arrival_interval, repeat_interval=repeat_interval)
    rng = random.Random(seed)
    requests = [
        TraceRequest(arrival=p * arrival_interval + r * repeat_interval,
                     prompt_token_ids=prompt, max_new_tokens=max_new_tokens,
                     request_id=f"rep-p{p}-r{r}")
        for p, prompt in enumerate([_tokens(rng, n, vocab) for n in prompt_lens])
        for r in range(repeats)
    ]
    return _sorted_trace(name, requests)


def mixed(seed: int = 0, vocab: int = 1000, *, scale: int = 1, full_prompt_hits: bool = False,
          name: str = "mixed") -> Trace:
    """Chat, documents and private prefixes (and repeated prompts) together, merged by arrival.

    The parts use seeds derived from ``seed`` and keep their id prefixes (``chat-``,
    ``doc-``, ``priv-``, ``rep-``), so ids stay unique. With ``full_prompt_hits`` (the
    named workload ``mixed``, the default of ``kvconnector run``), :func:`repeated_prompts`
    adds full-prompt hits that end part-way into a block, so that run catches a connector
    that skips that block.

    Args:
        seed: RNG seed.
        vocab: token ids are drawn from ``[0, vocab)``.
        scale: multiplies the number of users/documents of each part (and the repeats).
        full_prompt_hits: add :func:`repeated_prompts` (off by default, so the traces
            benchmarks derive from this generator stay as they were).
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
    if full_prompt_hits:
        parts.append(repeated_prompts(seed * 3 + 3, repeats=2 * scale, vocab=vocab))
    merged = list(heapq.merge(*(p.requests for p in parts), key=lambda r: r.arrival))
    return Trace(name=name, requests=merged)
