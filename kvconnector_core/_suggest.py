"""Did-you-mean hints for error messages: the valid name closest to a bad one.

Primitives: :func:`nearest`, :func:`did_you_mean`.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["did_you_mean", "nearest"]


def nearest(bad: str, valid: Iterable[str]) -> str | None:
    """The valid name most like ``bad`` (case-insensitive), or None when none is close."""
    by_lower = {v.lower(): v for v in valid}
    match = difflib.get_close_matches(bad.lower(), list(by_lower), n=1, cutoff=0.6)
    return by_lower[match[0]] if match else None


def did_you_mean(bad: str, valid: Iterable[str]) -> str:
    """``" (did you mean 'x'?)"`` for the nearest valid name, or ``""``."""
    close = nearest(bad, valid)
    return f" (did you mean {close!r}?)" if close is not None else ""
