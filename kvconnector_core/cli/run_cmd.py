"""``kvconnector run``: run a workload through the engine and report what the connector did.

Runs the workload with the connector, then (unless ``--no-baseline``) without any
connector, and checks that both generated identical tokens; the exit code is 1 when they
differ, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

__all__ = ["HELP", "add_arguments", "main"]

HELP = "Run a workload through the engine with a connector and compare its outputs with a run without it."

DEFAULT_WORKLOAD = "mixed"
DEFAULT_CONNECTOR = "cpu_offload"
# Small enough that the default workload evicts GPU blocks, so the connector matters.
DEFAULT_NUM_GPU_BLOCKS = 64
MAX_NUM_BATCHED_TOKENS = 256
MAX_NUM_SEQS = 8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the options of ``kvconnector run``."""
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--workload", metavar="NAME",
                     help=f"built-in workload (default {DEFAULT_WORKLOAD!r})")
    src.add_argument("--trace", metavar="FILE", help="JSONL trace file (one request per line)")
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
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the no-connector run and the output comparison")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    parser.add_argument("--num-gpu-blocks", type=int, default=None, metavar="N",
                        help=f"GPU block pool size (default {DEFAULT_NUM_GPU_BLOCKS}, or more "
                             "when the workload's longest request needs more)")


def _fail(msg: str) -> int:
    print(f"kvconnector run: error: {msg}", file=sys.stderr)
    return 2


def _connector_config(args: argparse.Namespace, num_gpu_blocks: int) -> Any:
    """The connector config the flags ask for (None for no connector)."""
    from kvconnector_core.connector.config import KVConnectorConfig, load_connector_config
    from kvconnector_core.connector.registry import get_registry

    if args.config:
        return load_connector_config(args.config)
    registry = get_registry()
    name = args.connector
    if name is None:
        if DEFAULT_CONNECTOR not in registry:
            return None
        name = DEFAULT_CONNECTOR
    if name.lower() == "none":
        return None
    from kvconnector_core.errors import UnknownConnectorError

    try:
        cls = registry.get(name)
    except UnknownConnectorError as exc:
        # The registry lists canonical names; configs and this flag accept aliases too.
        known = ", ".join(
            e.name + (f" (aliases: {', '.join(e.aliases)})" if e.aliases else "")
            for e in registry.entries())
        msg = f"unknown connector {name!r}; valid connectors: {known or 'none'} or 'none'"
        if registry.errors:
            msg += " (some plugins failed to load; see `kvconnector list`)"
        raise UnknownConnectorError(msg) from exc
    extra: dict[str, Any] = {}
    if DEFAULT_CONNECTOR in registry and cls is registry.get(DEFAULT_CONNECTOR):
        # The CPU tier needs a size: four times the GPU pool.
        extra = {"num_cpu_blocks": 4 * num_gpu_blocks}
    return KVConnectorConfig(name=name, extra_config=extra)


def main(args: argparse.Namespace) -> int:
    """Run ``kvconnector run``; see :data:`HELP`."""
    import torch
    from tqdm import tqdm

    from kvconnector_core.engine.engine import DEVICES, Engine, EngineConfig
    from kvconnector_core.engine.models import DEFAULT_MODEL, get_model
    from kvconnector_core.engine.report import compare_outputs, format_report, report_dict
    from kvconnector_core.engine.workloads import get_workload, load_trace_jsonl
    from kvconnector_core.errors import KVConnectorError

    if args.device not in DEVICES:
        return _fail(f"unknown device {args.device!r}; valid devices: {', '.join(DEVICES)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        return _fail("--device cuda: no CUDA device is available (torch.cuda.is_available() "
                     "is False); use --device cpu")
    if args.device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # The model's tensors are tiny: one thread is faster and immune to busy cores.
        torch.set_num_threads(1)
    try:
        model = get_model(args.model or DEFAULT_MODEL)
        vocab = model.vocab_size
        trace = (load_trace_jsonl(args.trace, vocab_size=vocab) if args.trace
                 else get_workload(args.workload or DEFAULT_WORKLOAD, args.seed))
        if not trace.requests:
            return _fail(f"trace {args.trace} has no requests (the file is empty or blank)")
        max_model_len = max(512, 16 + max(len(r.prompt_token_ids) + r.max_new_tokens
                                          for r in trace))
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
                         f"request of {trace.name!r} needs max_model_len={max_model_len}, which "
                         f"needs --num-gpu-blocks {min_blocks} or more")
        else:
            num_gpu_blocks = args.num_gpu_blocks
        connector = _connector_config(args, num_gpu_blocks)
        base = dict(model=model, num_gpu_blocks=num_gpu_blocks,
                    max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, max_num_seqs=MAX_NUM_SEQS,
                    device=args.device, max_model_len=max_model_len,
                    reserve_full_output=args.reserve_full_output)
        runs = [("connector" if connector else "no connector", EngineConfig(**base, connector=connector))]
        if not args.no_baseline and connector is not None:
            runs.append(("baseline", EngineConfig(**base)))
        results = []
        for label, config in runs:
            with Engine(config) as engine, tqdm(total=len(trace), desc=f"{trace.name} ({label})",
                                                unit="req", file=sys.stderr, leave=False) as bar:
                results.append(engine.run(trace, progress=bar.update))
    except (KVConnectorError, FileNotFoundError) as exc:
        return _fail(str(exc))
    result = results[0]
    baseline = results[1] if len(results) > 1 else None
    if args.json:
        import json

        print(json.dumps(report_dict(result, baseline), indent=2))
    else:
        print(format_report(result, baseline))
    if baseline is not None and not compare_outputs(result, baseline).identical:
        return 1
    return 0
