"""``kvconnector events``: subscribe to a KV event stream (ours or vLLM's) and print it.

One line per batch: ``seq``, timestamp, and each event with its medium and hashes.
Gaps in the sequence are filled from the replay endpoint. ``--json`` prints one JSON
object per batch instead (``--raw`` adds the msgpack payload as hex).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from kvconnector_core.errors import ConfigError

if TYPE_CHECKING:  # the subscriber imports zmq: only when the command runs
    from kvconnector_core.event_publisher import EventSubscriber, ReceivedBatch

__all__ = ["HELP", "add_arguments", "default_replay_endpoint", "main"]

HELP = ("Subscribe to a KV event publisher (kvconnector's or vLLM's) and print the event "
        "batches.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the options of ``kvconnector events``."""
    from kvconnector_core.event_publisher import DEFAULT_ENDPOINT

    parser.add_argument("--endpoint", default=DEFAULT_ENDPOINT,
                        help=f"PUB endpoint to connect to (default {DEFAULT_ENDPOINT})")
    parser.add_argument("--replay-endpoint", metavar="ENDPOINT", default=None,
                        help="replay endpoint used to fill gaps (default: the PUB port + 1 "
                             "on a tcp endpoint; 'none' for no replay)")
    parser.add_argument("--topic", default="", help="topic prefix (default: all)")
    parser.add_argument("--from-seq", type=int, default=None, metavar="N",
                        help="replay from sequence number N before the live stream")
    parser.add_argument("--count", type=int, default=None, metavar="N",
                        help="exit after printing N batches")
    parser.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                        help="exit when no batch arrives for this long")
    parser.add_argument("--json", action="store_true", help="print one JSON object per batch")
    parser.add_argument("--raw", action="store_true", help="with --json: add the payload as hex")


_MAX_PORT = 65535


def default_replay_endpoint(endpoint: str) -> str | None:
    """The replay endpoint paired with a tcp PUB ``endpoint``: the next port (None otherwise).

    Raises:
        ConfigError: ``endpoint``'s port is the last one (65535): no next port.
    """
    head, sep, port = endpoint.rpartition(":")
    if endpoint.startswith("tcp://") and sep and port.isdigit():
        if int(port) == _MAX_PORT:  # a port above it is refused as invalid by the publisher
            msg = (f"endpoint {endpoint!r}: the replay endpoint is the next port, and there is "
                   f"none after {port}; use a port below {_MAX_PORT}")
            raise ConfigError(msg)
        return f"{head}:{int(port) + 1}"
    return None


def _describe(event: object) -> str:
    kind = type(event).__name__
    medium = getattr(event, "medium", None)
    hashes = getattr(event, "block_hashes", None)
    text = kind + (f"[{medium}]" if medium else "")
    if hashes is not None:
        shown = ", ".join(f"{h:016x}" if isinstance(h, int) else h.hex() for h in hashes[:4])
        more = f", ... ({len(hashes)} blocks)" if len(hashes) > 4 else ""
        text += f" {shown}{more}"
    return text


def _check_args(args: argparse.Namespace) -> str | None:
    """The usage error in ``--count`` / ``--timeout``, if any."""
    if args.count is not None and args.count < 1:
        return (f"--count {args.count} is out of range; valid: 1 or more (or leave it out to "
                "print until interrupted)")
    if args.timeout is not None and not args.timeout > 0:
        return (f"--timeout {args.timeout} is out of range; valid: seconds > 0 (or leave it "
                "out to wait forever)")
    return None


def _subscriber(args: argparse.Namespace) -> EventSubscriber:
    """The subscriber the flags ask for (the replay endpoint defaults to the next port).

    Raises:
        ConfigError: a bad endpoint, or no port after it for the replay endpoint.
    """
    from kvconnector_core.event_publisher import EventSubscriber

    replay = args.replay_endpoint
    if replay is None:
        replay = default_replay_endpoint(args.endpoint)
    elif replay.lower() == "none":
        replay = None
    return EventSubscriber(args.endpoint, replay, topic=args.topic, from_seq=args.from_seq)


def _print_batch(args: argparse.Namespace, received: ReceivedBatch) -> bool:
    """Print one received batch as the flags ask; False when it cannot be decoded (said
    on stderr)."""
    import msgspec

    try:
        batch = received.decode()
    except msgspec.DecodeError as exc:
        print(f"seq {received.seq}: undecodable batch ({exc})", file=sys.stderr)
        return False
    if args.json:
        line = {"seq": received.seq, "replayed": received.replayed,
                "batch": msgspec.to_builtins(batch)}
        if args.raw:
            line["payload"] = received.payload.hex()
        print(json.dumps(line), flush=True)
        return True
    tag = " (replayed)" if received.replayed else ""
    print(f"seq {received.seq}{tag} ts={batch.ts:.6f} {len(batch.events)} events", flush=True)
    for event in batch.events:
        print(f"  {_describe(event)}", flush=True)
    return True


def _follow(args: argparse.Namespace, sub: EventSubscriber) -> None:
    """Print batches until ``--count`` of them were printed or ``--timeout`` passed with
    none (forever without either)."""
    printed = 0
    while args.count is None or printed < args.count:
        got = False
        for received in sub.receive(timeout=args.timeout):
            got = True
            if not _print_batch(args, received):
                continue
            printed += 1
            if args.count is not None and printed >= args.count:
                break
        if not got and args.timeout is not None:
            break


def main(args: argparse.Namespace) -> int:
    """Run ``kvconnector events``; see :data:`HELP`."""
    problem = _check_args(args)
    if problem:
        print(f"kvconnector events: error: {problem}", file=sys.stderr)
        return 2
    try:
        sub = _subscriber(args)
    except ConfigError as exc:
        print(f"kvconnector events: error: {exc}", file=sys.stderr)
        return 2
    try:
        with sub:
            _follow(args, sub)
    except KeyboardInterrupt:
        pass
    if sub.missed:
        print(f"kvconnector events: {sub.missed} batches were missed (not in the replay buffer)",
              file=sys.stderr)
    return 0
