"""Odd input to ``kvconnector run`` / ``kvconnector events``: ports ZeroMQ would wrap
silently, redis URLs given bare to ``--tier``, a misspelt MultiConnector key, a UTF-8 BOM
in a trace, a one-child MultiConnector under a preemption storm, max_new_tokens 0 / 1.

Each either runs cleanly or fails with exit 2 and a message naming the bad value and
what would be valid, never a traceback.
"""

from __future__ import annotations

import json

import pytest
import torch

from connectors.offload.connector import _run_tier_settings
from kvconnector_core.cli import main
from kvconnector_core.cli.events_cmd import default_replay_endpoint
from kvconnector_core.engine.workloads import load_trace_jsonl
from kvconnector_core.errors import ConfigError
from kvconnector_core.event_publisher import EventPublisherConfig, EventSubscriber


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)  # run_cmd sets one thread on CPU


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _trace(path, requests) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in requests))
    return str(path)


# ---------------------------------------------------------------- event endpoints


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:99999", "tcp://127.0.0.1:-5",
                                      "tcp://127.0.0.1:65536", "tcp://127.0.0.1:abc",
                                      "tcp://127.0.0.1"])
def test_publisher_refuses_a_port_zeromq_would_wrap_or_reject(endpoint):
    """ZeroMQ binds port 99999 as 34463 (mod 2**16): the config refuses it, naming the range."""
    with pytest.raises(
        ConfigError, match=r"no valid port .*PORT 1-65535, or \* or 0 for any free port"
    ):
        EventPublisherConfig(endpoint=endpoint, replay_endpoint=None)


@pytest.mark.parametrize(
    "endpoint",
    [
        "tcp://127.0.0.1:5557",
        "tcp://*:65535",
        "tcp://[::1]:1",
        "tcp://127.0.0.1:*",
        "tcp://127.0.0.1:0",
        "ipc:///tmp/x",
        "inproc://x",
    ],
)
def test_publisher_accepts_valid_endpoints(endpoint):
    assert EventPublisherConfig(endpoint=endpoint, replay_endpoint=None).endpoint == endpoint


def test_run_with_a_wrapping_port_fails_before_running(capsys):
    code, _out, err = run_cli(
        capsys, "run", "--publish-events", "tcp://127.0.0.1:99999", "--no-baseline"
    )
    assert code == 2
    assert "endpoint='tcp://127.0.0.1:99999' has no valid port (99999)" in err
    assert "Traceback" not in err


def test_last_port_has_no_replay_port(capsys):
    """The replay endpoint is the next port: 65535 has none, a config error (not a bind
    failure as 'tcp://...:65536 ... is the port taken?')."""
    with pytest.raises(ConfigError, match="none after 65535; use a port below 65535"):
        default_replay_endpoint("tcp://127.0.0.1:65535")
    assert default_replay_endpoint("tcp://127.0.0.1:65534") == "tcp://127.0.0.1:65535"
    code, _out, err = run_cli(
        capsys, "events", "--endpoint", "tcp://127.0.0.1:65535", "--timeout", "0.1"
    )
    assert code == 2 and "none after 65535" in err


def test_subscriber_to_a_wildcard_port_is_a_config_error(capsys):
    """Only a publisher can bind ``*``; connecting to it raised a bare ZMQError."""
    with pytest.raises(
        ConfigError, match=r"cannot connect to KV event endpoint 'tcp://127.0.0.1:\*'"
    ):
        EventSubscriber("tcp://127.0.0.1:*")
    code, _out, err = run_cli(
        capsys, "events", "--endpoint", "tcp://127.0.0.1:*", "--timeout", "0.1"
    )
    assert code == 2 and "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--count", "0"], "--count 0 is out of range; valid: 1 or more"),
        (["--count", "-1"], "--count -1 is out of range"),
        (["--timeout", "-1"], "--timeout -1.0 is out of range; valid: seconds > 0"),
        (["--timeout", "nan"], "--timeout nan is out of range"),
    ],
)
def test_events_refuses_counts_and_timeouts_that_never_print_or_never_end(capsys, argv, needle):
    """--count -1 (would exit 0 at once) and --timeout -1 (would wait forever) are refused."""
    code, _out, err = run_cli(capsys, "events", "--endpoint", "tcp://127.0.0.1:5", *argv)
    assert code == 2
    assert needle in err


def test_bind_failure_hints_at_a_taken_port_only_when_it_is(capsys):
    code, _out, err = run_cli(
        capsys, "run", "--publish-events", "ipc:///nonexistent-dir/x", "--no-baseline"
    )
    assert code == 2
    assert "cannot bind KV event endpoint 'ipc:///nonexistent-dir/x'" in err
    assert "port taken" not in err


# ---------------------------------------------------------------- tiers, MultiConnector


def test_tier_accepts_a_bare_redis_url():
    """`--tier redis://h:p` keeps its URL (not url='//h:p' and an error about the scheme)."""
    for url in ("redis://127.0.0.1:6379/0", "rediss://h:1"):
        assert _run_tier_settings(url)["url"] == url
        assert _run_tier_settings(f"redis:{url}")["url"] == url
    with pytest.raises(ConfigError, match="expected disk:PATH or redis:redis://HOST:PORT"):
        _run_tier_settings("bogus:x")


def test_multiconnector_names_a_misspelt_key(tmp_path, capsys):
    """extra_config 'connectorz' is named as an unknown key with the nearest valid one."""
    config = tmp_path / "multi.json"
    config.write_text(
        json.dumps(
            {
                "name": "MultiConnector",
                "extra_config": {
                    "connectorz": [{"name": "cpu_offload", "extra_config": {"num_cpu_blocks": 8}}]
                },
            }
        )
    )
    code, _out, err = run_cli(capsys, "run", "--config", str(config), "--no-baseline")
    assert code == 2
    assert (
        "MultiConnector: unknown extra_config key 'connectorz' (did you mean "
        "'connectors'?); valid keys: connectors, loader_policy"
    ) in err


def test_one_child_multiconnector_under_a_preemption_storm(tmp_path, capsys):
    """Thirty long requests at once on the smallest pool, one CPU chunk behind a
    one-child MultiConnector: many preemptions, outputs identical to the baseline."""
    import random

    rng = random.Random(1)
    trace = _trace(
        tmp_path / "storm.jsonl",
        [
            {
                "arrival": 0,
                "prompt_token_ids": [rng.randrange(1000) for _ in range(rng.randint(100, 300))],
                "max_new_tokens": 60,
            }
            for _ in range(30)
        ],
    )
    config = tmp_path / "multi.json"
    config.write_text(
        json.dumps(
            {
                "name": "MultiConnector",
                "extra_config": {
                    "connectors": [{"name": "cpu_offload", "extra_config": {"num_cpu_blocks": 1}}]
                },
            }
        )
    )
    code, out, err = run_cli(
        capsys, "run", "--trace", trace, "--config", str(config), "--num-gpu-blocks", "25"
    )
    assert code == 0, err
    assert "30 finished / 30" in out
    assert "outputs identical to baseline: yes" in out
    preemptions = int(
        next(line for line in out.splitlines() if line.startswith("preemptions")).split()[1]
    )
    assert preemptions >= 5
    assert "Traceback" not in err and "Warning" not in err


# ---------------------------------------------------------------- traces


def test_trace_with_a_utf8_bom_loads(tmp_path):
    """Some editors start a UTF-8 file with a BOM; it loads (no 'invalid character (byte 0)')."""
    path = tmp_path / "bom.jsonl"
    line = json.dumps({"arrival": 0, "prompt_token_ids": [1, 2, 3], "max_new_tokens": 2})
    path.write_bytes(b"\xef\xbb\xbf" + line.encode() + b"\n" + line.encode() + b"\n")
    trace = load_trace_jsonl(path)
    assert [r.prompt_token_ids for r in trace.requests] == [[1, 2, 3], [1, 2, 3]]


def test_a_bom_after_the_first_line_is_still_an_error(tmp_path):
    from kvconnector_core.engine.workloads import TraceFormatError

    path = tmp_path / "bom2.jsonl"
    line = json.dumps({"arrival": 0, "prompt_token_ids": [1], "max_new_tokens": 2}).encode()
    path.write_bytes(line + b"\n\xef\xbb\xbf" + line + b"\n")
    with pytest.raises(TraceFormatError, match=":2: not a JSON object"):
        load_trace_jsonl(path)


def test_max_new_tokens_zero_is_refused_and_one_runs(tmp_path, capsys):
    zero = _trace(
        tmp_path / "zero.jsonl", [{"arrival": 0, "prompt_token_ids": [1] * 20, "max_new_tokens": 0}]
    )
    code, _out, err = run_cli(capsys, "run", "--trace", zero)
    assert code == 2
    assert "zero.jsonl:1: invalid trace request: Expected `int` >= 1 - at `$.max_new_tokens`" in err
    one = _trace(
        tmp_path / "one.jsonl",
        [
            {"arrival": i, "prompt_token_ids": [i + 1] * (20 + i), "max_new_tokens": 1}
            for i in range(5)
        ],
    )
    code, out, err = run_cli(capsys, "run", "--trace", one, "--cpu-blocks", "1")
    assert code == 0, err
    assert "5 finished / 5" in out and "output tokens                         5" in out
    assert "outputs identical to baseline: yes" in out
