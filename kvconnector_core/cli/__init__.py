"""The ``kvconnector`` command line.

Each subcommand lives in its own module, which exposes ``HELP`` (one line),
``add_arguments(parser)`` and ``main(args) -> int``. Modules are imported only
when their subcommand runs, so ``kvconnector list`` does not pay for torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

__all__ = ["main"]

# name -> module path; order is the order shown in --help.
_SUBCOMMANDS: dict[str, str] = {
    "run": "kvconnector_core.cli.run_cmd",
    "list": "kvconnector_core.cli.list_cmd",
    "events": "kvconnector_core.cli.events_cmd",
    "simulate": "kvconnector_core.cli.simulate_cmd",
    "vllm-check": "kvconnector_core.cli.vllm_check_cmd",
}


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvconnector",
        description=("KV-cache connector framework: run a workload through the engine, "
                     "list connectors, watch KV events."),
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_path in _SUBCOMMANDS.items():
        module = importlib.import_module(module_path)
        sp = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(sp)
        sp.set_defaults(_handler=module.main)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvconnector`` console script."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "_handler", None)
    if handler is None:
        parser.print_help()
        return 2
    return int(handler(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
