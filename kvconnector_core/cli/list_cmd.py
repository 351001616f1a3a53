"""``kvconnector list``: every connector the registry finds, and every plugin that failed.

Prints a table (name, aliases, class, distribution, version), then a "failed to
load" section naming each broken plugin's entry point, distribution and
error, and the plugins skipped by ``KVCONNECTOR_PLUGINS_ALLOW`` / ``_DENY``.
Exit code 0 even when a plugin failed, unless ``--strict``; ``--json`` prints
the same data as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["HELP", "add_arguments", "collect", "main"]

HELP = "List installed connectors (name, class, distribution, version) and plugins that failed to load."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--json`` and ``--strict``."""
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.add_argument("--strict", action="store_true", help="exit with status 1 if any plugin failed to load")


def collect(registry: Any = None) -> dict[str, Any]:
    """Return the listing as plain data: ``{"connectors": [...], "errors": [...], "skipped": [...]}``.

    Args:
        registry: a ConnectorRegistry; default: the default registry (loads the plugins).
    """
    from kvconnector_core.connector.registry import get_registry

    reg = registry if registry is not None else get_registry()
    return {
        "connectors": [
            {"name": e.name, "aliases": list(e.aliases), "class": e.class_path,
             "distribution": e.distribution, "version": e.version, "entry_point": e.source}
            for e in reg.entries()
        ],
        "errors": [
            {"entry_point": f.plugin.entry_point, "distribution": f.plugin.distribution,
             "version": f.plugin.version, "error": f.message}
            for f in reg.errors
        ],
        "skipped": [
            {"entry_point": p.entry_point, "distribution": p.distribution, "reason": reason}
            for p, reason in reg.skipped
        ],
    }


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def main(args: argparse.Namespace, registry: Any = None) -> int:
    """Print the listing; return 1 under ``--strict`` when a plugin failed, else 0."""
    data = collect(registry)
    out = sys.stdout
    if getattr(args, "json", False):
        out.write(json.dumps(data, indent=2) + "\n")
    else:
        rows = [["NAME", "ALIASES", "CLASS", "DISTRIBUTION", "VERSION"]]
        rows += [[c["name"], ",".join(c["aliases"]) or "-", c["class"], c["distribution"] or "-",
                  c["version"] or "-"] for c in data["connectors"]]
        out.write(_table(rows) + "\n" if data["connectors"] else "no connectors found\n")
        if data["errors"]:
            out.write("\nfailed to load:\n")
            for e in data["errors"]:
                out.write(f"  {e['entry_point']} ({e['distribution'] or 'unknown distribution'}): {e['error']}\n")
        if data["skipped"]:
            out.write("\nskipped:\n")
            for s in data["skipped"]:
                out.write(f"  {s['entry_point']} ({s['distribution'] or 'unknown distribution'}): {s['reason']}\n")
    return 1 if getattr(args, "strict", False) and data["errors"] else 0
