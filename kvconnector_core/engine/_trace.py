"""A trace's records and its JSONL form (re-exported by ``workloads``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import msgspec

from kvconnector_core.errors import ConfigError

__all__ = ["Trace", "TraceFormatError", "TraceRequest", "dump_trace_jsonl", "load_trace_jsonl"]

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
