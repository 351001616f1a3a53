"""Publish KV cache events over ZeroMQ in vLLM 0.33's wire format, and subscribe to them.

Routers (llm-d, Dynamo) read vLLM's event stream to send each request to the engine
that holds its prefix; this module lets them read ours unchanged.

Wire format (vLLM 0.33, ``vllm/distributed/kv_events.py``):

- PUB socket, one message per engine step: ``[topic, seq, payload]`` where ``seq`` is
  an 8-byte big-endian sequence number starting at 0 and ``payload`` a msgpack
  :class:`~kvconnector_core.kv_events.KVEventBatch`.
- ROUTER replay socket: a DEALER sends ``[b"", start_seq]`` (8 bytes big-endian) and gets
  back one ``[b"", topic, seq, payload]`` per buffered batch with ``seq >= start_seq``,
  then the end marker ``[b"", b"", END_SEQ, b""]`` (``END_SEQ`` is -1, signed).

Publishing never blocks the engine step: :meth:`ZmqEventPublisher.publish` puts the
batch on a bounded queue (a full queue drops the batch and counts it), and a background
thread encodes, sends and keeps the last ``buffer_steps`` batches for replay. The
default endpoints bind loopback only (``127.0.0.1``); binding another interface must be
asked for explicitly.

Primitives: EventPublisherConfig, ZmqEventPublisher, EventSubscriber, ReceivedBatch.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Self

import msgspec

from kvconnector_core.errors import ConfigError
from kvconnector_core.kv_events import KVEventBatch, decode_event_batch

if TYPE_CHECKING:
    import zmq

__all__ = [
    "DEFAULT_ENDPOINT",
    "DEFAULT_REPLAY_ENDPOINT",
    "END_SEQ",
    "EventPublisherConfig",
    "EventSubscriber",
    "ReceivedBatch",
    "ZmqEventPublisher",
]

logger = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"
DEFAULT_REPLAY_ENDPOINT = "tcp://127.0.0.1:5558"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""Sequence frame that ends a replay (vLLM's ``ZmqEventPublisher.END_SEQ``)."""

_POLL_S = 0.05  # how often the publisher thread looks at the replay socket when idle


_MAX_PORT = 65535


def _check_endpoint(name: str, endpoint: str) -> None:
    if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        msg = (f"{name}={endpoint!r} is not a ZeroMQ endpoint; expected tcp://HOST:PORT "
               "(e.g. tcp://127.0.0.1:5557), ipc://PATH or inproc://NAME")
        raise ConfigError(msg)
    if endpoint.startswith("tcp://"):
        # ZeroMQ takes any integer port modulo 2**16 (99999 binds 34463, -5 binds 65531),
        # so a mistyped port would silently publish where no subscriber looks.
        port = endpoint.rpartition(":")[2] if endpoint.count(":") >= 2 else ""
        if port != "*" and not (port.isdigit() and int(port) <= _MAX_PORT):
            msg = (f"{name}={endpoint!r} has no valid port ({port or 'none'!s}); expected "
                   f"tcp://HOST:PORT with PORT 1-{_MAX_PORT}, or * or 0 for any free port")
            raise ConfigError(msg)


class EventPublisherConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Settings of a :class:`ZmqEventPublisher`.

    Attributes:
        endpoint: PUB endpoint to bind. Loopback by default; ``tcp://*:PORT`` or
            ``tcp://0.0.0.0:PORT`` publishes to the network, so it must be asked for.
        replay_endpoint: ROUTER endpoint for replay requests, or None for no replay.
        topic: topic frame of every message (subscribers filter on its prefix).
        buffer_steps: batches kept for replay (the oldest are dropped first).
        max_queue_size: batches waiting to be sent; more are dropped and counted.
        hwm: ZeroMQ send high-water mark of the PUB socket.
    """

    endpoint: str = DEFAULT_ENDPOINT
    replay_endpoint: str | None = DEFAULT_REPLAY_ENDPOINT
    topic: str = ""
    buffer_steps: int = 10_000
    max_queue_size: int = 10_000
    hwm: int = 100_000

    def __post_init__(self) -> None:
        _check_endpoint("endpoint", self.endpoint)
        if self.replay_endpoint is not None:
            _check_endpoint("replay_endpoint", self.replay_endpoint)
            if self.replay_endpoint == self.endpoint and not self.endpoint.endswith(":*"):
                msg = f"replay_endpoint must differ from endpoint (both {self.endpoint!r})"
                raise ConfigError(msg)
        for name in ("buffer_steps", "max_queue_size", "hwm"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                msg = f"EventPublisherConfig.{name} must be a positive int, got {value!r}"
                raise ConfigError(msg)


class ZmqEventPublisher:
    """Sends :class:`KVEventBatch` es on a PUB socket and serves replays; never blocks.

    The sockets are created and bound in the constructor (so a taken port fails here,
    with the endpoint named), then handed to one background thread that owns them.

    Attributes:
        endpoint: the bound PUB endpoint (a ``:*`` port resolved to the real one).
        replay_endpoint: the bound replay endpoint, or None.
        dropped: batches dropped because the queue was full.
        sent: batches sent on the PUB socket so far.
    """

    def __init__(self, config: EventPublisherConfig | None = None) -> None:
        import zmq

        self.config = config or EventPublisherConfig()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(self.config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=self.config.buffer_steps)
        self._topic = self.config.topic.encode()
        self._seq = itertools.count()
        # Each counter has one writer (dropped: the engine thread; sent: the publisher
        # thread), so no lock is needed.
        self.dropped = 0
        self.sent = 0
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, self.config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self.endpoint = self._bind(self._pub, self.config.endpoint)
            self.replay_endpoint = None
            if self.config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                # A full replay plus its end marker must fit in the send queue.
                self._replay.setsockopt(zmq.SNDHWM, 2 * (self.config.buffer_steps + 1))
                self._replay.setsockopt(zmq.LINGER, 0)
                self.replay_endpoint = self._bind(self._replay, self.config.replay_endpoint)
        except Exception:
            self._close_sockets()
            raise
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()

    @staticmethod
    def _bind(sock: zmq.Socket[bytes], endpoint: str) -> str:
        import zmq

        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            hint = " (is the port taken?)" if exc.errno == zmq.EADDRINUSE else ""
            msg = f"cannot bind KV event endpoint {endpoint!r}: {exc}{hint}"
            raise ConfigError(msg) from exc
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def publish(self, batch: KVEventBatch) -> bool:
        """Queue ``batch`` for sending; return False (and count it) if the queue is full.

        Never blocks: a subscriber or a network slower than the engine loses batches
        (the sequence numbers show the gap) instead of slowing the step.
        """
        if self._closed:
            msg = "publish() after shutdown(): the KV event publisher is closed"
            raise ConfigError(msg)
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1
            return False
        return True

    def drain(self, timeout: float = 10.0) -> bool:
        """Wait until every batch queued so far is sent; False if ``timeout`` ran out first."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True

    def shutdown(self, timeout: float = 2.0) -> None:
        """Send what is queued (for at most ``timeout`` seconds), stop the thread, close."""
        if self._closed:
            return
        self._closed = True
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass  # the thread also stops on _closed once the queue drains
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._close_sockets()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------ publisher thread
    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            try:
                batch = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if self._closed:
                    return
                continue
            if batch is None:
                self._queue.task_done()
                return
            seq = next(self._seq)
            payload = encoder.encode(batch)
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except Exception:
                # The batch stays in the replay buffer; a subscriber sees the gap and asks.
                logger.exception("KV event publisher: sending batch %d failed", seq)
            self._buffer.append((seq, payload))
            self.sent += 1
            self._queue.task_done()

    def _serve_replay(self) -> None:
        assert self._replay is not None  # noqa: S101 - narrows the type: the thread serves replay only when it is on
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV event publisher: ignoring a malformed replay request of %d frames",
                           len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart(
                    (client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))


@dataclass(frozen=True, slots=True)
class ReceivedBatch:
    """One batch as a subscriber got it.

    Attributes:
        seq: its sequence number.
        payload: the raw msgpack bytes.
        replayed: True if it came from the replay socket (it was missed live).
    """

    seq: int
    payload: bytes
    replayed: bool

    def decode(self) -> KVEventBatch:
        """Decode the payload with kvconnector's event structs."""
        return decode_event_batch(self.payload)


class EventSubscriber:
    """Receives batches in sequence order, filling gaps from the replay socket.

    Args:
        endpoint: PUB endpoint to connect to.
        replay_endpoint: replay endpoint, or None (gaps are then only logged).
        topic: topic prefix to subscribe to.
        from_seq: first sequence number wanted; None starts from whatever arrives first.
        replay_timeout: seconds to wait for a replay answer.
    """

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, *, topic: str = "",
                 from_seq: int | None = None, replay_timeout: float = 5.0) -> None:
        import zmq

        _check_endpoint("endpoint", endpoint)
        if replay_endpoint is not None:
            _check_endpoint("replay_endpoint", replay_endpoint)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        try:
            self._sub.connect(endpoint)
        except zmq.ZMQError as exc:  # e.g. a ``*`` port, which only a publisher can bind
            self._sub.close(linger=0)
            msg = f"cannot connect to KV event endpoint {endpoint!r}: {exc}"
            raise ConfigError(msg) from exc
        self._replay_endpoint = replay_endpoint
        self._replay_timeout_ms = int(replay_timeout * 1000)
        self.next_seq = from_seq
        self.missed = 0  # batches neither received live nor replayable

    def close(self) -> None:
        """Close the socket."""
        self._sub.close(linger=0)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def receive(self, timeout: float | None = None) -> Iterator[ReceivedBatch]:
        """Yield the next live batch, preceded by replays of any gap before it.

        Yields nothing when no batch arrives within ``timeout`` seconds (None waits).
        Batches older than ``next_seq`` (already seen through a replay) are skipped.
        """
        if not self._sub.poll(None if timeout is None else int(timeout * 1000)):
            return
        _topic, seq_bytes, payload = self._sub.recv_multipart()
        seq = int.from_bytes(seq_bytes, "big")
        if self.next_seq is not None and seq < self.next_seq:
            return
        if self.next_seq is not None and seq > self.next_seq:
            yield from self.replay(self.next_seq, seq)
        self.next_seq = seq + 1
        yield ReceivedBatch(seq, payload, replayed=False)

    def replay(self, first: int, stop: int) -> Iterator[ReceivedBatch]:
        """Yield batches ``first .. stop-1`` from the replay socket (those still buffered),
        counting the others in :attr:`missed`."""
        import zmq

        got = first
        if self._replay_endpoint is not None:
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            try:
                dealer.connect(self._replay_endpoint)
                dealer.send_multipart((b"", first.to_bytes(8, "big")))
                while dealer.poll(self._replay_timeout_ms):
                    _, _topic, seq_bytes, payload = dealer.recv_multipart()
                    if seq_bytes == END_SEQ:
                        break
                    seq = int.from_bytes(seq_bytes, "big")
                    if got <= seq < stop:
                        if seq > got:
                            self.missed += seq - got
                        got = seq + 1
                        yield ReceivedBatch(seq, payload, replayed=True)
                else:
                    logger.warning("no replay answer from %s within %d ms",
                                   self._replay_endpoint, self._replay_timeout_ms)
            finally:
                dealer.close(linger=0)
        if got < stop:
            self.missed += stop - got
