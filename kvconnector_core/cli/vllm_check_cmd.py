"""``kvconnector vllm-check``: check a connector under vLLM 0.33's own scheduler, on a CPU.

Builds :class:`~kvconnector_core.testing.vllm.VllmRig` from the ``--kv-transfer-config`` a
user gives ``vllm serve`` (any vLLM connector; kvconnector's through the adapter), runs a
workload in each layout asked for, and prints one report per layout: requests, hit tokens,
bytes loaded, layer-blocks checked, wrong bytes (the first bad block named), leaked blocks,
requests held when idle, exceptions escaping. Exit 1 on any damage, 2 on a usage or config
error (one line on stderr, no traceback).

Fault specs (``--faults``), for a kvconnector connector behind the adapter: ``HOOK`` (raises
on every call), ``HOOK=RATE`` (at that rate), ``HOOK@STEP`` (once, at that step),
``load_errors=RATE`` (loads fail, reported by block), ``store_errors=RATE``, ``late=STEPS``
(completions reported up to that many steps late), ``seed=N``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

__all__ = ["HELP", "add_arguments", "main", "parse_faults"]

HELP = ("Check a connector under vLLM 0.33's own scheduler on CPU (no GPU, no model): every "
        "loaded block and prefix-cache hit byte-checked, leaks counted.")

DEFAULT_WORKLOAD = "randomized"
_RANDOMIZED_REQUESTS = 48
_MODEL_LEN_CAP = 2048  # the stub model config's max_position_embeddings
_SETTING_KEYS = {"load_errors": "load_failure_rate", "store_errors": "store_failure_rate",
                 "late": "completion_delay_steps", "seed": "seed"}
_SETTING_SPECS = ("load_errors=RATE", "store_errors=RATE", "late=STEPS", "seed=N")


class UsageError(Exception):
    """A usage or config error: one line, exit 2."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the options of ``kvconnector vllm-check``."""
    parser.add_argument("--kv-transfer-config", required=True, metavar="JSON_OR_FILE",
                        help="what you give `vllm serve --kv-transfer-config`: JSON text or a "
                             "JSON file")
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--workload", metavar="NAME",
                     help=f"{DEFAULT_WORKLOAD!r} (default: requests on shared prefixes, vLLM's "
                          "prefix cache dropped every 16, so hits come from the connector) or a "
                          "kvconnector workload (chat, documents, private, mixed)")
    src.add_argument("--trace", metavar="FILE",
                     help="JSONL trace, one request per line (kvconnector run's format)")
    parser.add_argument("--layouts", nargs="+", default=["LBHNC"], metavar="LAYOUT",
                        help="KV cache layouts to check in (LBHNC LBNHC LHBNC BLHNC BLNHC BHLNC, "
                             "or 'all'; default LBHNC)")
    parser.add_argument("--faults", nargs="+", default=[], metavar="SPEC",
                        help="faults for a kvconnector connector: HOOK, HOOK=RATE, HOOK@STEP, "
                             "load_errors=RATE, store_errors=RATE, late=STEPS, seed=N")
    parser.add_argument("--workers", type=int, default=1, metavar="N",
                        help="worker connectors (TP ranks; default 1)")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="vLLM's AsyncScheduler (step N+1 planned before step N's output)")
    parser.add_argument("--num-gpu-blocks", type=int, default=None, metavar="N",
                        help="GPU block pool size (default: small, so blocks are evicted)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    parser.add_argument("--max-steps", type=int, default=20_000, metavar="N",
                        help="step budget; requests unfinished after it are damage")
    parser.add_argument("--json", action="store_true", help="print the reports as JSON")


def parse_faults(specs: list[str]) -> dict[str, Any] | None:
    """``--faults`` specs as ``FaultSettings`` fields (None when there are none).

    Raises:
        UsageError: a spec that names no hook or setting, or a bad number.
    """
    from kvconnector_core.testing.fault_settings import FAULT_HOOKS

    if not specs:
        return None
    fields: dict[str, Any] = {}
    raise_in: list[dict[str, Any]] = []
    for spec in specs:
        name, sep, value = spec.partition("=")
        name, at, step = name.partition("@")
        try:
            if name in _SETTING_KEYS and sep and not at:
                key = _SETTING_KEYS[name]
                fields[key] = (int(value) if key in ("completion_delay_steps", "seed")
                               else float(value))
            elif name in FAULT_HOOKS:
                fault: dict[str, Any] = {"hook": name}
                if sep:
                    fault["rate"] = float(value)
                if at:
                    fault["at_step"] = int(step)
                raise_in.append(fault)
            else:
                valid = ", ".join(sorted(FAULT_HOOKS))
                msg = (f"--faults {spec!r} names no hook or setting; valid: HOOK, HOOK=RATE or "
                       f"HOOK@STEP with HOOK one of {valid}; or {', '.join(_SETTING_SPECS)}")
                raise UsageError(msg)
        except ValueError:
            msg = f"--faults {spec!r}: {value or step!r} is not a number"
            raise UsageError(msg) from None
    return {**fields, "raise_in": raise_in}


def _layouts(names: list[str], valid: tuple[str, ...]) -> list[str]:
    if names == ["all"]:
        return list(valid)
    for name in names:
        if name not in valid:
            msg = f"--layouts: unknown layout {name!r}; valid: {', '.join(valid)} or all"
            raise UsageError(msg)
    return names


def _import_rig() -> Any:
    """The rig package (vLLM's loggers quieted first)."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    try:
        import kvconnector_core.testing.vllm as rig_pkg
    except ImportError as exc:
        raise UsageError(str(exc).replace("kvconnector_core.testing.vllm", "vllm-check")) from None
    return rig_pkg


def _trace(args: argparse.Namespace) -> Any:
    """The trace to replay (None for the rig's randomized workload)."""
    from kvconnector_core.engine.workloads import get_workload, load_trace_jsonl

    if args.trace is not None:
        if not os.path.isfile(args.trace):
            msg = f"--trace {args.trace}: no such file"
            raise UsageError(msg)
        return load_trace_jsonl(args.trace, vocab_size=50_272)
    if args.workload in (None, DEFAULT_WORKLOAD):
        return None
    return get_workload(args.workload, args.seed)


def _rig_kwargs(args: argparse.Namespace, trace: Any) -> dict[str, Any]:
    longest = max((len(r.prompt_token_ids) + r.max_new_tokens for r in trace), default=0) \
        if trace is not None else 256
    max_model_len = min(_MODEL_LEN_CAP, max(512, longest + 16))
    if longest + 16 > _MODEL_LEN_CAP:
        msg = (f"the longest request has {longest} tokens; the rig's model takes at most "
               f"{_MODEL_LEN_CAP - 16}")
        raise UsageError(msg)
    if args.workers < 1:
        msg = f"--workers {args.workers}: give 1 or more"
        raise UsageError(msg)
    blocks = args.num_gpu_blocks or (24 if trace is None else max_model_len // 16 + 24)
    return {"num_workers": args.workers, "async_scheduling": args.async_scheduling,
            "num_gpu_blocks": blocks, "max_model_len": max_model_len, "raise_on_wrong": False,
            **({"max_num_seqs": 6, "max_num_batched_tokens": 64} if trace is None else {})}


def _build(rig_pkg: Any, config: dict[str, Any], layout: str, kwargs: dict[str, Any]) -> Any:
    """A rig, or UsageError naming what vLLM or the connector rejected."""
    try:
        return rig_pkg.VllmRig.from_kv_transfer_config(config, layout=layout, **kwargs)
    except Exception as exc:  # noqa: BLE001 - vLLM rejects configs with many exception types
        msg = f"the kv-transfer-config was rejected ({type(exc).__name__}): {_one_line(exc)}"
        if "kv_connector_module_path" not in config:
            msg = f"{msg[:300]}; {_known_connectors()}"
        raise UsageError(msg[:600]) from None


def _known_kvconnector(config: dict[str, Any]) -> None:
    """An installed kvconnector connector named by the adapter's config (one named by
    ``module_path`` is imported by the adapter later).

    Raises:
        UnknownConnectorError: no connector of that name is installed (the message lists
            the installed ones).
    """
    from kvconnector_core.connector import get_registry
    from kvconnector_core.testing.kv_transfer_config import is_adapter

    extra = config.get("kv_connector_extra_config")
    inner = extra.get("kvconnector") if is_adapter(config) and isinstance(extra, dict) else None
    if isinstance(inner, dict) and "module_path" not in inner and isinstance(
            inner.get("name"), str):
        get_registry().get(inner["name"])


def _known_connectors() -> str:
    """What a config may name without a module path: vLLM's registered connectors."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    names = sorted(KVConnectorFactory._registry)  # noqa: SLF001 - vLLM lists them nowhere else
    return f"vLLM's connectors: {', '.join(names)} (others by kv_connector_module_path)"


def _got(value: object) -> str:
    return f" (got {value!r})" if isinstance(value, str | int | float) else ""


def _one_line(exc: Exception) -> str:
    """An exception's message on one line (pydantic's errors as ``field: message``)."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            return "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}"
                             + _got(e.get("input")) for e in errors())
        except (TypeError, AttributeError):
            pass
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return "; ".join(line for line in lines if not line.startswith("For further information"))


def _check_one(rig_pkg: Any, config: dict[str, Any], layout: str, args: argparse.Namespace,
               trace: Any) -> Any:
    rig = _build(rig_pkg, config, layout, _rig_kwargs(args, trace))
    try:
        if trace is None:
            rig_pkg.randomized(rig, args.seed, _RANDOMIZED_REQUESTS, run=False, strict_reset=False)
        else:
            rig_pkg.run_trace(rig, trace, max_steps=args.max_steps)
    except Exception as exc:  # noqa: BLE001 - escaping into vLLM is what is reported
        return rig_pkg.RigReport(connector=rig.describe_connector(), layout=layout,
                                 exceptions=[f"{type(exc).__name__}: {exc}"[:300]])
    return rig.check(args.max_steps)


def _run(args: argparse.Namespace) -> int:
    from kvconnector_core.errors import KVConnectorError
    from kvconnector_core.testing import kv_transfer_config as configs

    # Input errors first: importing vLLM prints its own notices before any message.
    faults = parse_faults(args.faults)
    layouts = _layouts(args.layouts, configs.LAYOUTS)
    try:
        config = configs.parse_kv_transfer_config(args.kv_transfer_config)
        if faults is not None:
            config = configs.with_faults(config, faults)
        trace = _trace(args)
        _known_kvconnector(config)
    except KVConnectorError as exc:
        raise UsageError(str(exc)) from None
    rig_pkg = _import_rig()
    reports = [_check_one(rig_pkg, config, layout, args, trace) for layout in layouts]
    if args.json:
        print(json.dumps([r.to_dict() for r in reports], indent=2))
    else:
        print("\n\n".join(r.format() for r in reports))
    return 0 if all(r.ok for r in reports) else 1


def main(args: argparse.Namespace) -> int:
    """Run ``kvconnector vllm-check``; see :data:`HELP`."""
    logging.getLogger("kvconnector_core").setLevel(logging.ERROR)  # contained faults log
    try:
        return _run(args)
    except UsageError as exc:
        print(f"kvconnector vllm-check: error: {exc}", file=sys.stderr)
        return 2
