"""The trace-format options shared by ``kvconnector run`` and ``kvconnector simulate``.

Primitives: :func:`add_trace_format_arguments`, :func:`positive_int`, :func:`fraction`.
"""

from __future__ import annotations

import argparse

__all__ = ["add_trace_format_arguments", "fraction", "positive_int"]


def positive_int(text: str) -> int:
    """argparse type: an integer ``>= 1``."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        msg = f"{text!r} is not a positive integer"
        raise argparse.ArgumentTypeError(msg)
    return value


def fraction(text: str) -> float:
    """argparse type: a number in ``(0, 1]``."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0.0 < value <= 1.0:
        msg = f"{text!r} is not a fraction in (0, 1]"
        raise argparse.ArgumentTypeError(msg)
    return value


def add_trace_format_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--trace-format``, ``--tokens-per-id``, ``--limit`` and ``--sample``."""
    parser.add_argument("--trace-format", choices=("auto", "jsonl", "mooncake"), default="auto",
                        help="format of --trace: kvconnector's JSONL, Mooncake's (timestamp, "
                             "input_length, output_length, hash_ids), or detected (default)")
    parser.add_argument("--tokens-per-id", type=positive_int, default=512, metavar="N",
                        help="Mooncake: tokens each hash id becomes (default 512, the trace's "
                             "own; lengths are scaled by N/512)")
    parser.add_argument("--limit", type=positive_int, default=None, metavar="N",
                        help="use only the first N requests of the trace")
    parser.add_argument("--sample", type=fraction, default=None, metavar="F",
                        help="keep each request of the trace with probability F (seeded)")
