"""A trace's records, its JSONL form, and Mooncake's public trace format.

Primitives:
    TraceRequest / Trace / TraceFormatError   the records and the format error
    load_trace_jsonl / dump_trace_jsonl       kvconnector's own JSONL
    MooncakeRecord / read_mooncake            Mooncake's FAST'25 format, line by line
    mooncake_to_trace / mooncake_prompt_length
                                              its expansion into token prompts
    detect_trace_format / load_trace          either format, detected or named

Mooncake's format (``kvcache-ai/Mooncake``, ``FAST25-release/traces/``): one JSON object
per line with ``timestamp`` (ms), ``input_length``, ``output_length`` and ``hash_ids``
(one id per 512-token block; equal ids mean equal blocks with equal prefixes).
Expansion (:func:`mooncake_to_trace`):

- a hash id becomes ``tokens_per_id`` tokens (default 512, Mooncake's block), each a
  deterministic function of the id and its offset, so equal ids give equal blocks and
  a chain of ids shares its prefix;
- the prompt is its ids' tokens, its last block cut to what ``input_length`` leaves for
  it, scaled by ``tokens_per_id / 512`` (at least one token); ``output_length`` is
  scaled the same way (at least one token). With ``tokens_per_id=16`` a 12,000-token
  prompt becomes 375 tokens with the same block structure;
- ``timestamp`` becomes the arrival step ``timestamp / ms_per_step`` (default 1000 ms
  per step);
- ``limit`` keeps the first N requests, ``sample`` keeps each with that probability
  (seeded), to scale a trace down.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from kvconnector_core.errors import ConfigError

__all__ = [
    "MOONCAKE_BLOCK_TOKENS",
    "MooncakeRecord",
    "Trace",
    "TraceFormatError",
    "TraceRequest",
    "detect_trace_format",
    "dump_trace_jsonl",
    "load_trace",
    "load_trace_jsonl",
    "mooncake_prompt_length",
    "mooncake_to_trace",
    "read_mooncake",
]

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per hash id in Mooncake's traces."""

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


def _sorted_trace(name: str, requests: list[TraceRequest]) -> Trace:
    # sort() is stable, so ties keep generation order (deterministic).
    requests.sort(key=lambda r: r.arrival)
    return Trace(name=name, requests=requests)


_line_decoder = msgspec.json.Decoder(TraceRequest)
_line_encoder = msgspec.json.Encoder()


def _field_of(message: str) -> str | None:
    # msgspec ends validation messages with "- at `$.field[3]`".
    marker = " - at `"
    idx = message.rfind(marker)
    return message[idx + len(marker):-1] if idx >= 0 and message.endswith("`") else None


_UTF8_BOM = b"\xef\xbb\xbf"


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
            unknown field, has an empty ``request_id`` or reuses one (the message names both
            lines), or has a token id outside ``[0, vocab_size)``; the message names the file, the
            1-based line number and the field.
    """
    path = Path(path)
    requests: list[TraceRequest] = []
    seen_ids: dict[str, int] = {}
    with path.open("rb") as f:
        for line_number, line in enumerate(f, start=1):
            if line_number == 1 and line.startswith(_UTF8_BOM):
                line = line[len(_UTF8_BOM):]  # some editors start UTF-8 files with a BOM
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
                if not req.request_id.strip():
                    msg = (f"{path}:{line_number}: request_id is empty; give a non-blank id or "
                           "leave the field out (the engine then assigns one) - at `$.request_id`")
                    raise TraceFormatError(msg, path=str(path), line_number=line_number,
                                           field="$.request_id")
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


# --------------------------------------------------------------------------- Mooncake
_NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]


class MooncakeRecord(msgspec.Struct, forbid_unknown_fields=True):
    """One request of a Mooncake trace.

    Attributes:
        timestamp: arrival in milliseconds from the start of the trace.
        input_length: prompt tokens.
        output_length: generated tokens.
        hash_ids: one id per 512-token block of the prompt, head first.
        line_number: the 1-based line it was read from (0 if built in code).
    """

    timestamp: _NonNegativeFloat
    input_length: _PositiveInt
    output_length: _NonNegativeInt
    hash_ids: Annotated[list[_NonNegativeInt], msgspec.Meta(min_length=1)]
    line_number: int = 0


_mooncake_decoder = msgspec.json.Decoder(MooncakeRecord)


def _decode_mooncake(path: Path, line_number: int, line: bytes) -> MooncakeRecord:
    try:
        rec = _mooncake_decoder.decode(line)
    except msgspec.ValidationError as exc:
        msg = f"{path}:{line_number}: invalid Mooncake request: {exc}"
        raise TraceFormatError(msg, path=str(path), line_number=line_number,
                               field=_field_of(str(exc))) from None
    except msgspec.DecodeError as exc:
        msg = f"{path}:{line_number}: not a JSON object: {exc}"
        raise TraceFormatError(msg, path=str(path), line_number=line_number) from None
    rec.line_number = line_number
    return rec


def read_mooncake(path: str | Path, *, limit: int | None = None, sample: float | None = None,
                  seed: int = 0) -> list[MooncakeRecord]:
    """Read a Mooncake trace file, in file order.

    Args:
        path: the ``.jsonl`` file.
        limit: keep at most this many requests (after sampling).
        sample: keep each request with this probability (``(0, 1]``, seeded).
        seed: seed of the sampling.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        TraceFormatError: a line is not JSON, misses, mistypes or adds a field; the
            message names the file, the 1-based line number and the field.
    """
    path = Path(path)
    rng = random.Random(seed)
    out: list[MooncakeRecord] = []
    with path.open("rb") as f:
        for line_number, line in enumerate(f, start=1):
            if line_number == 1 and line.startswith(_UTF8_BOM):
                line = line[len(_UTF8_BOM):]
            if not line.strip():
                continue
            rec = _decode_mooncake(path, line_number, line)
            if sample is not None and rng.random() >= sample:
                continue
            out.append(rec)
            if limit is not None and len(out) >= limit:
                break
    return out


def mooncake_prompt_length(rec: MooncakeRecord, tokens_per_id: int = 512) -> int:
    """The prompt length of ``rec`` expanded at ``tokens_per_id`` tokens per hash id: its
    ids' tokens, the last block cut to what ``input_length`` leaves it, scaled."""
    n = len(rec.hash_ids)
    last_fill = rec.input_length - MOONCAKE_BLOCK_TOKENS * (n - 1)
    last = min(tokens_per_id, max(1, round(last_fill * tokens_per_id / MOONCAKE_BLOCK_TOKENS)))
    return tokens_per_id * (n - 1) + last


def _id_tokens(hash_id: int, n: int, vocab_size: int) -> list[int]:
    # A cheap deterministic mix of (id, offset): equal ids give equal tokens.
    base = (hash_id * 0x9E3779B1 + 0x7F4A7C15) & 0xFFFFFFFF
    return [((base + j * 0x85EBCA77) * 0xC2B2AE3D >> 7) % vocab_size for j in range(n)]


def mooncake_to_trace(records: list[MooncakeRecord], name: str, *, tokens_per_id: int = 512,
                      ms_per_step: float = 1000.0, vocab_size: int = 32000) -> Trace:
    """Expand Mooncake records into a :class:`Trace` (see the module doc for the rules).

    Args:
        records: from :func:`read_mooncake`.
        name: the trace's name.
        tokens_per_id: tokens each hash id becomes (512 keeps the trace's lengths).
        ms_per_step: milliseconds of ``timestamp`` per engine step.
        vocab_size: token ids are drawn from ``[0, vocab_size)``.
    """
    scale = tokens_per_id / MOONCAKE_BLOCK_TOKENS
    requests: list[TraceRequest] = []
    cache: dict[int, list[int]] = {}
    for rec in records:
        ids = rec.hash_ids
        last = mooncake_prompt_length(rec, tokens_per_id) - tokens_per_id * (len(ids) - 1)
        prompt: list[int] = []
        for hash_id in ids:
            toks = cache.get(hash_id)
            if toks is None:
                toks = cache[hash_id] = _id_tokens(hash_id, tokens_per_id, vocab_size)
            prompt += toks
        del prompt[len(prompt) - tokens_per_id + last:]
        requests.append(TraceRequest(
            arrival=rec.timestamp / ms_per_step, prompt_token_ids=prompt,
            max_new_tokens=max(1, round(rec.output_length * scale)),
            request_id=f"mc-{rec.line_number}" if rec.line_number else None))
    return _sorted_trace(name, requests)


TraceFormat = Literal["auto", "jsonl", "mooncake"]


def detect_trace_format(path: str | Path) -> Literal["jsonl", "mooncake"]:
    """``"mooncake"`` when the first non-blank line has ``hash_ids``, else ``"jsonl"``."""
    with Path(path).open("rb") as f:
        for line in f:
            if line.strip():
                return "mooncake" if b'"hash_ids"' in line else "jsonl"
    return "jsonl"


def load_trace(path: str | Path, fmt: TraceFormat = "auto", *, vocab_size: int | None = None,
               tokens_per_id: int = 512, limit: int | None = None,
               sample: float | None = None, seed: int = 0) -> Trace:
    """Read a trace in kvconnector's JSONL or Mooncake's format.

    Args:
        path: the file.
        fmt: ``"jsonl"``, ``"mooncake"``, or ``"auto"`` (:func:`detect_trace_format`).
        vocab_size: the model's vocabulary (checked for JSONL, drawn from for Mooncake).
        tokens_per_id: Mooncake only: tokens per hash id.
        limit: keep the first N requests.
        sample: keep each request with this probability (seeded by ``seed``).
        seed: seed of the sampling.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        TraceFormatError: a malformed line (file, line number and field named).
    """
    if fmt == "auto":
        fmt = detect_trace_format(path)
    if fmt == "mooncake":
        records = read_mooncake(path, limit=limit, sample=sample, seed=seed)
        return mooncake_to_trace(records, Path(path).stem, tokens_per_id=tokens_per_id,
                                 vocab_size=vocab_size or 32000)
    trace = load_trace_jsonl(path, vocab_size=vocab_size)
    if sample is not None:
        rng = random.Random(seed)
        trace.requests = [r for r in trace.requests if rng.random() < sample]
    if limit is not None:
        del trace.requests[limit:]
    return trace
