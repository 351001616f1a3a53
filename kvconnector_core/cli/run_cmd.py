"""``kvconnector run``: run a workload through the engine and report what the connector did.

Runs the workload with the connector, then (unless ``--no-baseline``) without any
connector, and checks that both generated identical tokens; the exit code is 1 when they
differ, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the command imports torch only when it runs
    from kvconnector_core.cli.run_watch import RunWatch
    from kvconnector_core.engine.engine import EngineConfig, RunResult
    from kvconnector_core.engine.workloads import Trace
    from kvconnector_core.worker.model import ModelConfig

from kvconnector_core.cli._trace_args import add_trace_format_arguments

__all__ = ["HELP", "add_arguments", "main"]

HELP = ("Run a workload through the engine with a connector and compare its outputs with a run "
        "without it.")

DEFAULT_WORKLOAD = "mixed"
DEFAULT_CONNECTOR = "cpu_offload"
# Small enough that the default workload evicts GPU blocks, so the connector matters.
DEFAULT_NUM_GPU_BLOCKS = 64
MAX_NUM_BATCHED_TOKENS = 256
MAX_NUM_SEQS = 8
# Room past the longest request, so its last tokens never meet the max_model_len cap.
_MODEL_LEN_HEADROOM = 16
MAX_MODEL_LEN = 2**20  # EngineConfig's bound (the integer model is exact up to it)
MAX_NUM_GPU_BLOCKS = 2**24
"""Largest ``--num-gpu-blocks`` (a bound, not a promise that memory suffices)."""
MAX_NUM_CPU_BLOCKS = 2**26
"""Largest ``--cpu-blocks`` (a bound, not a promise that memory suffices)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the options of ``kvconnector run``."""
    from kvconnector_core.cli import run_watch
    from kvconnector_core.engine.workload_sizes import describe_workloads

    src = parser.add_mutually_exclusive_group()
    src.add_argument("--workload", metavar="NAME",
                     help=f"built-in workload: {describe_workloads()} "
                          f"(default {DEFAULT_WORKLOAD!r})")
    src.add_argument("--trace", metavar="FILE",
                     help="JSONL trace file, one request per line: arrival (engine steps), "
                          "prompt_token_ids (ids in [0, vocab)), max_new_tokens, optional "
                          "cache_salt and request_id; or a Mooncake trace (docs/offload.md)")
    add_trace_format_arguments(parser)
    conn = parser.add_mutually_exclusive_group()
    conn.add_argument("--connector", metavar="NAME",
                      help=f"registered connector name (default {DEFAULT_CONNECTOR!r} if "
                           "installed; 'none' for no connector)")
    conn.add_argument("--config", metavar="FILE", help="connector config JSON file")
    parser.add_argument("--model", metavar="NAME|FILE", default=None,
                        help="model preset (tiny, tiny-hybrid, tiny-chunked, tiny-two-windows, "
                             "llama-3-8b, gpt-oss-20b, gpt-oss-120b, llama-4-style; default "
                             "tiny) or a model-config JSON file")
    parser.add_argument("--reserve-full-output", action="store_true",
                        help="admit a request only if its whole output fits (default: its "
                             "current tokens, as vLLM 0.33)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--json", action="store_true",
                        help="print the report as JSON (with a per-step timeline)")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="draw per-step hit rate and bytes moved per tier (needs matplotlib: "
                             "pip install 'kvconnector[plot]')")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the no-connector run and the output comparison")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    parser.add_argument("--num-gpu-blocks", type=int, default=None, metavar="N",
                        help=f"GPU block pool size (default {DEFAULT_NUM_GPU_BLOCKS}, or more "
                             "when the workload's longest request needs more)")
    parser.add_argument("--tier", action="append", default=[], metavar="SPEC",
                        help="with the default cpu_offload connector: a secondary tier behind "
                             "the CPU tier, 'disk:PATH' or 'redis:URL' (or the redis:// URL "
                             "alone; repeat for more, in "
                             "order). Two runs with the same tier share it: the second serves "
                             "the first one's prefixes (see docs/tiers.md)")
    parser.add_argument("--cpu-blocks", type=int, default=None, metavar="N",
                        help="with the default cpu_offload connector: CPU tier size in chunks "
                             "(default 4x the GPU pool)")
    parser.add_argument("--publish-events", metavar="ENDPOINT", nargs="?", const="default",
                        default=None,
                        help="publish the connector run's KV events over ZeroMQ in vLLM's "
                             "wire format (default endpoint tcp://127.0.0.1:5557, replay on "
                             "the next port); read them with `kvconnector events`")
    parser.add_argument("--kv-events", action="store_true",
                        help="build and count the connector run's KV events (the report's "
                             "'KV events' row); on with --publish-events, off otherwise (as "
                             "in vLLM, events cost time only when someone consumes them)")
    run_watch.add_arguments(parser)


def _check_sources(args: argparse.Namespace) -> str | None:
    """The usage error in ``--workload`` / ``--trace`` / ``--num-gpu-blocks``, if any."""
    from kvconnector_core.engine.workloads import WORKLOADS

    if args.workload is not None and not args.workload.strip():
        return f"--workload needs a name; valid workloads: {', '.join(sorted(WORKLOADS))}"
    if args.trace is not None:
        path = Path(args.trace)
        if not path.exists():
            return f"--trace {args.trace}: no such file"
        if not path.is_file():
            return f"--trace {args.trace} is not a file; give a JSONL file, one request per line"
    if args.num_gpu_blocks is not None and not 1 <= args.num_gpu_blocks <= MAX_NUM_GPU_BLOCKS:
        return (f"--num-gpu-blocks {args.num_gpu_blocks} is out of range; valid: 1 to "
                f"{MAX_NUM_GPU_BLOCKS}")
    if args.cpu_blocks is not None and not 1 <= args.cpu_blocks <= MAX_NUM_CPU_BLOCKS:
        return f"--cpu-blocks {args.cpu_blocks} is out of range; valid: 1 to {MAX_NUM_CPU_BLOCKS}"
    return None


def _fail(msg: str) -> int:
    print(f"kvconnector run: error: {msg}", file=sys.stderr)
    return 2


class _UsageError(Exception):
    """A usage error found while preparing the runs (exit code 2, message on stderr)."""


def _connector_name(args: argparse.Namespace) -> str | None:
    """The registered connector name the flags select (None: no connector).

    Raises:
        ConfigError: ``--tier`` / ``--cpu-blocks`` with ``--connector none``.
    """
    from kvconnector_core.errors import ConfigError
    from kvconnector_core.plugins.registry import get_registry

    name = args.connector
    if name is None:
        registry = get_registry()
        if DEFAULT_CONNECTOR not in registry and registry.conflict(DEFAULT_CONNECTOR) is None:
            return None  # not installed; a name claimed twice is an error (later), not absent
        return DEFAULT_CONNECTOR
    if name.lower() == "none":
        if args.tier or args.cpu_blocks is not None:
            msg = f"--tier and --cpu-blocks need the {DEFAULT_CONNECTOR} connector, not 'none'"
            raise ConfigError(msg)
        return None
    return str(name)


def _connector_config(args: argparse.Namespace, num_gpu_blocks: int) -> Any:
    """The connector config the flags ask for (None for no connector).

    Without ``--config``, the connector's own demo settings (e.g. a CPU tier sized
    against the GPU pool), from the same :class:`DemoOptions` for every connector: a
    connector refuses the options it cannot honour.
    """
    from kvconnector_core.connector.config import KVConnectorConfig, load_connector_config
    from kvconnector_core.connector.demo import DemoOptions, demo_extra_config
    from kvconnector_core.errors import ConfigError, UnknownConnectorError
    from kvconnector_core.plugins.registry import get_registry

    if args.config:
        if args.tier or args.cpu_blocks is not None:
            msg = "--tier and --cpu-blocks go with --connector; in a --config file use extra_config"
            raise ConfigError(msg)
        return load_connector_config(args.config)
    name = _connector_name(args)
    if name is None:
        return None
    try:
        cls = get_registry().get(name)
    except UnknownConnectorError as exc:
        # The registry's message (the same as in configs and MultiConnector children).
        raise UnknownConnectorError(f"--connector: {exc}; or 'none' for no connector") from exc
    options = DemoOptions(connector=name, num_gpu_blocks=num_gpu_blocks,
                          cpu_blocks=args.cpu_blocks, tiers=tuple(args.tier))
    return KVConnectorConfig(name=name, extra_config=demo_extra_config(cls, options))


def _publisher(args: argparse.Namespace) -> Any:
    """The event publisher settings ``--publish-events`` asks for (None: no publishing)."""
    if args.publish_events is None:
        return None
    from kvconnector_core.cli.events_cmd import default_replay_endpoint
    from kvconnector_core.event_publisher import EventPublisherConfig

    if args.publish_events == "default":
        return EventPublisherConfig()
    return EventPublisherConfig(endpoint=args.publish_events,
                                replay_endpoint=default_replay_endpoint(args.publish_events))


def _check_device(args: argparse.Namespace) -> str | None:
    """The usage error in ``--device``, if any; on CPU, one torch thread unless the
    environment sets ``OMP_NUM_THREADS``."""
    import torch

    from kvconnector_core.engine.engine import DEVICES

    if args.device not in DEVICES:
        return f"unknown device {args.device!r}; valid devices: {', '.join(DEVICES)}"
    if args.device == "cuda" and not torch.cuda.is_available():
        return ("--device cuda: no CUDA device is available (torch.cuda.is_available() "
                "is False); use --device cpu")
    if args.device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # The model's tensors are tiny: one thread is faster and immune to busy cores.
        torch.set_num_threads(1)
    return None


def _load_trace(args: argparse.Namespace, vocab_size: int) -> Trace:
    """The workload or trace the flags name.

    Raises:
        _UsageError: the trace has no requests.
    """
    from kvconnector_core.engine._trace import load_trace
    from kvconnector_core.engine.workloads import get_workload

    if args.trace is not None:
        trace = load_trace(args.trace, args.trace_format, vocab_size=vocab_size,
                           tokens_per_id=args.tokens_per_id, limit=args.limit,
                           sample=args.sample, seed=args.seed)
    else:
        trace = get_workload(DEFAULT_WORKLOAD if args.workload is None else args.workload,
                             args.seed)
    if not trace.requests:
        raise _UsageError(f"trace {args.trace} has no requests (the file is empty or blank)")
    return trace


def _max_model_len(trace: Trace) -> tuple[int, int]:
    """The longest request's tokens and the runs' ``max_model_len`` (with headroom).

    Raises:
        _UsageError: the longest request is beyond the engine's bound.
    """
    longest = max(len(r.prompt_token_ids) + r.max_new_tokens for r in trace)
    max_model_len = longest + _MODEL_LEN_HEADROOM
    if max_model_len > MAX_MODEL_LEN:
        raise _UsageError(f"the longest request of {trace.name!r} has {longest} tokens (prompt "
                          f"+ max_new_tokens); the engine supports at most "
                          f"{MAX_MODEL_LEN - _MODEL_LEN_HEADROOM}")
    return longest, max_model_len


def _num_gpu_blocks(args: argparse.Namespace, trace: Trace, sizing: EngineConfig,
                    longest: int) -> int:
    """The GPU pool size: ``--num-gpu-blocks``, or the default grown to fit the workload.

    Raises:
        _UsageError: ``--num-gpu-blocks`` cannot hold the longest request.
    """
    min_blocks = sizing.min_num_gpu_blocks
    if args.num_gpu_blocks is None:
        # Room for the longest request plus one step's worth of blocks, so another
        # request can make progress next to it.
        return max(DEFAULT_NUM_GPU_BLOCKS,
                   min_blocks + -(-MAX_NUM_BATCHED_TOKENS // sizing.block_size))
    if args.num_gpu_blocks < min_blocks:
        raise _UsageError(
            f"--num-gpu-blocks {args.num_gpu_blocks} is too small: the longest request of "
            f"{trace.name!r} has {longest} tokens (prompt + max_new_tokens); with "
            f"{_MODEL_LEN_HEADROOM} tokens of headroom the pool must hold one sequence of "
            f"{sizing.max_model_len} tokens in {sizing.block_size}-token blocks plus the null "
            f"block, which needs --num-gpu-blocks {min_blocks} or more")
    return int(args.num_gpu_blocks)


def _runs(args: argparse.Namespace, model: ModelConfig, trace: Trace, watch: RunWatch
          ) -> list[tuple[str, EngineConfig]]:
    """The runs to make, labelled: with the connector, then the baseline (if any).

    Raises:
        _UsageError: the trace or the pool size does not fit the engine.
        KVConnectorError: a bad connector choice or config.
    """
    from kvconnector_core.engine.engine import EngineConfig

    longest, max_model_len = _max_model_len(trace)
    sizing = EngineConfig(model=model, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                          max_model_len=max_model_len)
    num_gpu_blocks = _num_gpu_blocks(args, trace, sizing, longest)
    connector = _connector_config(args, num_gpu_blocks)
    base = dict(model=model, num_gpu_blocks=num_gpu_blocks,
                max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, max_num_seqs=MAX_NUM_SEQS,
                device=args.device, max_model_len=max_model_len,
                reserve_full_output=args.reserve_full_output)
    runs = [("connector" if connector else "no connector",
             EngineConfig(**base, connector=connector, kv_events_publisher=_publisher(args),
                          enable_kv_cache_events=watch.kv_events(args.kv_events)))]
    if not args.no_baseline and connector is not None:
        runs.append(("baseline", EngineConfig(**base)))
    return runs


def _run_all(args: argparse.Namespace) -> list[RunResult]:
    """Run the workload once per run the flags ask for; the results in that order.

    Raises:
        _UsageError, KVConnectorError, OSError: see :func:`main`.
    """
    from kvconnector_core.cli.run_watch import RunWatch
    from kvconnector_core.engine.engine import Engine
    from kvconnector_core.engine.models import DEFAULT_MODEL, get_model

    model = get_model(DEFAULT_MODEL if args.model is None else args.model)
    trace = _load_trace(args, model.vocab_size)
    watch = RunWatch.from_args(args)
    runs = _runs(args, model, trace, watch)
    watch.announce(trace, args.device, len(runs))
    results = []
    for label, config in runs:
        with Engine(config) as engine, watch.progress(engine, trace, label) as progress:
            results.append(engine.run(trace, progress=progress))
    watch.finish()
    return results


def _report(args: argparse.Namespace, result: RunResult, baseline: RunResult | None) -> int:
    """Plot (``--plot``), print the report and return the exit code."""
    from kvconnector_core.engine.report import compare_outputs, format_report, report_dict

    if args.plot:
        from kvconnector_core.engine.timeline import plot_timeline

        try:
            plot_timeline(result, args.plot)
        except ImportError as exc:
            return _fail(str(exc))
        except OSError as exc:
            return _fail(f"--plot {args.plot}: {exc.strerror or exc}")
    if args.json:
        import json

        print(json.dumps(report_dict(result, baseline), indent=2))
    else:
        print(format_report(result, baseline))
    if baseline is not None and not compare_outputs(result, baseline).identical:
        return 1
    return 0


def main(args: argparse.Namespace) -> int:
    """Run ``kvconnector run``; see :data:`HELP`."""
    from kvconnector_core.errors import KVConnectorError

    problem = _check_device(args) or _check_sources(args)
    if problem:
        return _fail(problem)
    try:
        results = _run_all(args)
    except (_UsageError, KVConnectorError) as exc:
        return _fail(str(exc))
    except OSError as exc:  # the trace file vanished or cannot be read
        return _fail(f"--trace {args.trace}: {exc.strerror or exc}")
    return _report(args, results[0], results[1] if len(results) > 1 else None)
