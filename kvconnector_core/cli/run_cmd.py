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
from typing import Any

from kvconnector_core.cli._trace_args import add_trace_format_arguments

__all__ = ["HELP", "add_arguments", "main"]

HELP = "Run a workload through the engine with a connector and compare its outputs with a run without it."

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
    from kvconnector_core.engine.workloads import WORKLOADS

    src = parser.add_mutually_exclusive_group()
    src.add_argument("--workload", metavar="NAME",
                     help=f"built-in workload: {', '.join(sorted(WORKLOADS))} "
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


def _connector_config(args: argparse.Namespace, num_gpu_blocks: int) -> Any:
    """The connector config the flags ask for (None for no connector)."""
    from kvconnector_core.connector.config import KVConnectorConfig, load_connector_config
    from kvconnector_core.connector.registry import get_registry
    from kvconnector_core.errors import ConfigError

    if args.config:
        if args.tier or args.cpu_blocks is not None:
            msg = "--tier and --cpu-blocks go with --connector; in a --config file use extra_config"
            raise ConfigError(msg)
        return load_connector_config(args.config)
    registry = get_registry()
    name = args.connector
    if name is None:
        if DEFAULT_CONNECTOR not in registry and registry.conflict(DEFAULT_CONNECTOR) is None:
            return None  # not installed; a name claimed twice is an error (below), not absent
        name = DEFAULT_CONNECTOR
    if name.lower() == "none":
        if args.tier or args.cpu_blocks is not None:
            msg = f"--tier and --cpu-blocks need the {DEFAULT_CONNECTOR} connector, not 'none'"
            raise ConfigError(msg)
        return None
    from kvconnector_core.errors import UnknownConnectorError

    try:
        cls = registry.get(name)
    except UnknownConnectorError as exc:
        # The registry's message (the same as in configs and MultiConnector children).
        raise UnknownConnectorError(f"--connector: {exc}; or 'none' for no connector") from exc
    # The connector's own demo settings (e.g. a CPU tier sized against the GPU pool); the
    # default connector also takes --cpu-blocks and --tier (the CLI knows none of its keys).
    if DEFAULT_CONNECTOR in registry and cls is registry.get(DEFAULT_CONNECTOR):
        # mypy: the default connector's demo_extra_config takes these extra keywords (the ignore)
        extra = cls.demo_extra_config(num_gpu_blocks, cpu_blocks=args.cpu_blocks,  # type: ignore[call-arg]
                                      tiers=args.tier)
    elif args.tier or args.cpu_blocks is not None:
        msg = f"--tier and --cpu-blocks need the {DEFAULT_CONNECTOR} connector, not {name!r}"
        raise ConfigError(msg)
    else:
        extra = cls.demo_extra_config(num_gpu_blocks)
    return KVConnectorConfig(name=name, extra_config=extra)


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


def main(args: argparse.Namespace) -> int:
    """Run ``kvconnector run``; see :data:`HELP`."""
    import torch
    from tqdm import tqdm

    from kvconnector_core.engine._trace import load_trace
    from kvconnector_core.engine.engine import DEVICES, Engine, EngineConfig
    from kvconnector_core.engine.models import DEFAULT_MODEL, get_model
    from kvconnector_core.engine.report import compare_outputs, format_report, report_dict
    from kvconnector_core.engine.workloads import get_workload
    from kvconnector_core.errors import KVConnectorError

    if args.device not in DEVICES:
        return _fail(f"unknown device {args.device!r}; valid devices: {', '.join(DEVICES)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        return _fail("--device cuda: no CUDA device is available (torch.cuda.is_available() "
                     "is False); use --device cpu")
    if args.device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # The model's tensors are tiny: one thread is faster and immune to busy cores.
        torch.set_num_threads(1)
    problem = _check_sources(args)
    if problem:
        return _fail(problem)
    try:
        model = get_model(DEFAULT_MODEL if args.model is None else args.model)
        vocab = model.vocab_size
        trace = (load_trace(args.trace, args.trace_format, vocab_size=vocab,
                            tokens_per_id=args.tokens_per_id, limit=args.limit,
                            sample=args.sample, seed=args.seed) if args.trace is not None
                 else get_workload(DEFAULT_WORKLOAD if args.workload is None else args.workload,
                                   args.seed))
        if not trace.requests:
            return _fail(f"trace {args.trace} has no requests (the file is empty or blank)")
        longest = max(len(r.prompt_token_ids) + r.max_new_tokens for r in trace)
        max_model_len = longest + _MODEL_LEN_HEADROOM
        if max_model_len > MAX_MODEL_LEN:
            return _fail(f"the longest request of {trace.name!r} has {longest} tokens (prompt + "
                         f"max_new_tokens); the engine supports at most "
                         f"{MAX_MODEL_LEN - _MODEL_LEN_HEADROOM}")
        sizing = EngineConfig(model=model, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                              max_model_len=max_model_len)
        min_blocks = sizing.min_num_gpu_blocks
        if args.num_gpu_blocks is None:
            # Room for the longest request plus one step's worth of blocks, so another
            # request can make progress next to it.
            num_gpu_blocks = max(DEFAULT_NUM_GPU_BLOCKS,
                                 min_blocks + -(-MAX_NUM_BATCHED_TOKENS // sizing.block_size))
        elif args.num_gpu_blocks < min_blocks:
            return _fail(f"--num-gpu-blocks {args.num_gpu_blocks} is too small: the longest "
                         f"request of {trace.name!r} has {longest} tokens (prompt + "
                         f"max_new_tokens); with {_MODEL_LEN_HEADROOM} tokens of headroom the "
                         f"pool must hold one sequence of {max_model_len} tokens in "
                         f"{sizing.block_size}-token blocks plus the null block, which needs "
                         f"--num-gpu-blocks {min_blocks} or more")
        else:
            num_gpu_blocks = args.num_gpu_blocks
        connector = _connector_config(args, num_gpu_blocks)
        base = dict(model=model, num_gpu_blocks=num_gpu_blocks,
                    max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, max_num_seqs=MAX_NUM_SEQS,
                    device=args.device, max_model_len=max_model_len,
                    reserve_full_output=args.reserve_full_output)
        runs = [("connector" if connector else "no connector",
                 EngineConfig(**base, connector=connector, kv_events_publisher=_publisher(args),
                              enable_kv_cache_events=True if args.kv_events else None))]
        if not args.no_baseline and connector is not None:
            runs.append(("baseline", EngineConfig(**base)))
        results = []
        for label, config in runs:
            with Engine(config) as engine, tqdm(total=len(trace), desc=f"{trace.name} ({label})",
                                                unit="req", file=sys.stderr, leave=False) as bar:
                results.append(engine.run(trace, progress=bar.update))
    except KVConnectorError as exc:
        return _fail(str(exc))
    except OSError as exc:  # the trace file vanished or cannot be read
        return _fail(f"--trace {args.trace}: {exc.strerror or exc}")
    result = results[0]
    baseline = results[1] if len(results) > 1 else None
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
