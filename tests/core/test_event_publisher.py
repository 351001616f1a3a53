"""The ZeroMQ KV event publisher: vLLM 0.33's wire format, replay, bounded buffers, CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import _vllm033_events
import msgspec
import pytest

zmq = pytest.importorskip("zmq", reason="pyzmq is missing: pip install -e '.[test]'")

from kvconnector_core.errors import ConfigError  # noqa: E402
from kvconnector_core.event_publisher import (  # noqa: E402
    EventPublisherConfig,
    EventSubscriber,
    ZmqEventPublisher,
)
from kvconnector_core.kv_events import BlockRemoved, BlockStored, KVEventBatch  # noqa: E402

ANY_PORT = EventPublisherConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")


# vLLM 0.33's event structs, replicated independently of ours (see _vllm033_events), so the
# test decodes our bytes the way a vLLM consumer would.
VLLM_DECODER = msgspec.msgpack.Decoder(_vllm033_events.KVEventBatch)


def _batch(k: int) -> KVEventBatch:
    return KVEventBatch(ts=float(k), events=[
        BlockStored(block_hashes=[1000 + k], parent_block_hash=None, token_ids=[k] * 4,
                    block_size=4, lora_id=None, medium="DISK", lora_name=None, group_idx=0),
        BlockRemoved(block_hashes=[2000 + k], medium="CPU"),
    ])


class _StalledPublisher(ZmqEventPublisher):
    """A publisher whose thread waits for ``gate``: the queue fills as if the network stalled."""

    def __init__(self, config: EventPublisherConfig, gate: threading.Event) -> None:
        self.gate = gate
        super().__init__(config)

    def _run(self) -> None:
        self.gate.wait()
        super()._run()


def test_default_endpoints_bind_loopback_only():
    config = EventPublisherConfig()
    assert config.endpoint.startswith("tcp://127.0.0.1:")
    assert config.replay_endpoint is not None and config.replay_endpoint.startswith("tcp://127.0.0.1:")


@pytest.mark.parametrize(("kwargs", "fragment"), [
    ({"endpoint": "127.0.0.1:5557"}, "not a ZeroMQ endpoint"),
    ({"endpoint": "tcp://127.0.0.1:5", "replay_endpoint": "tcp://127.0.0.1:5"}, "must differ"),
    ({"buffer_steps": 0}, "buffer_steps must be a positive int, got 0"),
    ({"endpoint": "tcp://127.0.0.1:65536"}, "no valid port"),
])
def test_bad_config_names_the_value(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment):
        EventPublisherConfig(**kwargs)


def test_the_highest_port_is_valid():
    assert EventPublisherConfig(endpoint="tcp://127.0.0.1:65535").endpoint.endswith(":65535")


def test_taken_port_is_a_config_error_naming_the_endpoint():
    with ZmqEventPublisher(ANY_PORT) as first:
        with pytest.raises(ConfigError, match="cannot bind KV event endpoint"):
            ZmqEventPublisher(EventPublisherConfig(endpoint=first.endpoint, replay_endpoint=None))


def test_subscriber_in_another_process_replays_the_gap_and_decodes_as_vllm():
    with ZmqEventPublisher(ANY_PORT) as pub:
        for k in range(5):  # published before anyone listens: the subscriber must replay them
            pub.publish(_batch(k))
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys; from kvconnector_core.cli import main; sys.exit(main())",
                "events",
                "--endpoint",
                pub.endpoint,
                "--replay-endpoint",
                pub.replay_endpoint,
                "--from-seq",
                "0",
                "--count",
                "10",
                "--json",
                "--raw",
                "--timeout",
                "60",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        k = 5
        # PUB/SUB has no join handshake: keep publishing until the subscriber has its 10.
        while proc.poll() is None and k < 2000:
            pub.publish(_batch(k))
            k += 1
            time.sleep(0.02)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert [line["seq"] for line in lines] == list(range(10))
    assert all(line["replayed"] for line in lines[:5])
    for line in lines:
        decoded = VLLM_DECODER.decode(bytes.fromhex(line["payload"]))
        stored, removed = decoded.events
        assert isinstance(stored, _vllm033_events.BlockStored) and isinstance(
            removed, _vllm033_events.BlockRemoved
        )
        assert stored.block_hashes == [1000 + line["seq"]]
        assert (stored.medium, stored.block_size, stored.group_idx) == ("DISK", 4, 0)
        assert removed.block_hashes == [2000 + line["seq"]] and removed.medium == "CPU"
        assert decoded.ts == float(line["seq"])


def test_replay_is_bounded_by_buffer_steps_and_counts_what_is_lost():
    config = msgspec.structs.replace(ANY_PORT, buffer_steps=3)
    with ZmqEventPublisher(config) as pub:
        for k in range(6):
            pub.publish(_batch(k))
        assert pub.drain(30)  # all sent before anyone listens
        sub = EventSubscriber(pub.endpoint, pub.replay_endpoint, from_seq=0)
        got = []
        k = 6
        while not got and k < 2000:
            pub.publish(_batch(k))
            k += 1
            got = list(sub.receive(timeout=0.05))
        sub.close()
    live = got[-1]
    assert not live.replayed and live.decode().ts == float(live.seq)
    # The buffer holds the last 3 batches, the live one included: only 2 before it replay,
    # and everything older is counted as missed.
    assert [b.seq for b in got[:-1]] == [live.seq - 2, live.seq - 1]
    assert all(b.replayed for b in got[:-1])
    assert sub.missed == live.seq - 2


def test_a_replay_ends_on_the_publishers_end_marker_and_counts_the_batches_it_lacks(caplog):
    """Asked for 0..7 while 3..5 are buffered: 3..5 come back, 0..2 and 6..7 are missed,
    and the answer ends on the end marker (not on the reply timeout)."""
    config = msgspec.structs.replace(ANY_PORT, buffer_steps=3)
    with ZmqEventPublisher(config) as pub:
        for k in range(6):
            pub.publish(_batch(k))
        assert pub.drain(30)
        with (
            EventSubscriber(pub.endpoint, pub.replay_endpoint, replay_timeout=30.0) as sub,
            caplog.at_level("WARNING", logger="kvconnector_core.event_publisher"),
        ):
            got = list(sub.replay(0, 8))
    assert [(b.seq, b.replayed) for b in got] == [(3, True), (4, True), (5, True)]
    assert sub.missed == 5
    assert not caplog.records


def test_live_batches_come_once_each_in_order():
    with ZmqEventPublisher(ANY_PORT) as pub:
        sub = EventSubscriber(pub.endpoint, pub.replay_endpoint)
        got: list = []
        k = 0
        while len(got) < 4 and k < 4000:
            pub.publish(_batch(k))
            k += 1
            got += sub.receive(timeout=0.05)
        sub.close()
    seqs = [b.seq for b in got]
    assert len(seqs) >= 4 and seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert sub.next_seq == seqs[-1] + 1


def test_publish_never_blocks_a_full_queue_drops_and_counts():
    gate = threading.Event()
    config = msgspec.structs.replace(ANY_PORT, max_queue_size=2)
    pub = _StalledPublisher(config, gate)
    try:
        results = [pub.publish(_batch(k)) for k in range(5)]
        assert results == [True, True, False, False, False]
        assert pub.dropped == 3
    finally:
        gate.set()
        pub.shutdown()
    assert pub.sent == 2


def test_publish_after_shutdown_is_an_error():
    pub = ZmqEventPublisher(ANY_PORT)
    pub.shutdown()
    with pytest.raises(ConfigError, match="after shutdown"):
        pub.publish(_batch(0))


def test_engine_publishes_every_step_with_events():
    from kvconnector_core.engine.engine import Engine, EngineConfig

    config = EngineConfig(num_gpu_blocks=64, max_model_len=256, kv_events_publisher=ANY_PORT)
    with Engine(config) as engine:
        pub = engine.event_publisher
        with EventSubscriber(pub.endpoint, pub.replay_endpoint, from_seq=0) as sub:
            prompt = list(range(1, 40))
            engine.add_request(prompt, 2)
            while engine.has_unfinished_requests():
                engine.step()
            deadline = time.monotonic() + 30
            while pub.sent == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            # One more batch, live, that reveals the gap: a new prompt, so that it surely has
            # events (the same prompt again may hit the prefix cache and publish nothing).
            engine.add_request(list(range(100, 139)), 2)
            while engine.has_unfinished_requests():
                engine.step()
            received = []
            while time.monotonic() < deadline and not any(not b.replayed for b in received):
                received += sub.receive(timeout=0.1)
    events = [e for b in received for e in b.decode().events]
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert stored and all(e.medium == "GPU" and e.block_size == 16 for e in stored)
    assert sum(len(e.block_hashes) for e in stored) >= 2  # the 39-token prompt fills 2 blocks
    assert [b.seq for b in received] == list(range(len(received)))
