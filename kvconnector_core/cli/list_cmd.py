"""``kvconnector list``: every connector the registry finds, and every plugin that failed.

Prints a table (name, aliases, class, distribution, version, status), then a
"conflicts" section for every name two classes claim (such a name does not
resolve; both claimants are named, since either may be the legitimate one), a
"failed to load" section naming each broken plugin's entry point,
distribution and error, and the plugins skipped by
``KVCONNECTOR_PLUGINS_ALLOW`` / ``_DENY``. A row whose name is claimed twice
has status ``CONFLICT (unusable)``; one with only a clashing alias names it.
Exit code 1 when a plugin failed to load or a name is conflicted (a
broken install must not look healthy to a script), else 0; ``--json``
prints the same data as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["HELP", "add_arguments", "collect", "main"]

HELP = ("List installed connectors (name, class, distribution, version) and plugins that "
        "failed to load.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--json`` and ``--strict``."""
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.add_argument("--strict", action="store_true",
                        help="kept for old scripts: a failed plugin now always exits with status 2")


def collect(registry: Any = None) -> dict[str, Any]:
    """Return the listing as plain data.

    Returns:
        ``{"connectors": [...], "conflicts": [...], "cache_policies": [...], "errors":
        [...], "skipped": [...]}``; ``errors`` includes the cache-policy plugins that
        failed.
        Each connector has ``conflicted_names`` (its names that do not resolve because
        another class claims them) and ``usable`` (False when its own name is one).
        Each conflict has the ``name``, the registered ``holder`` (class,
        entry point, distribution), the ``claimant`` plugin that clashed with it, and
        the ``error`` naming both. ``errors`` holds the other plugin failures.

    Args:
        registry: a ConnectorRegistry; default: the default registry (loads the plugins).
    """
    from kvconnector_core.errors import DuplicateConnectorError
    from kvconnector_core.plugins.registry import get_registry

    reg = registry if registry is not None else get_registry()
    connectors, holders = _connectors(reg)
    policies, policy_errors = _cache_policies()
    return {
        "connectors": connectors,
        "conflicts": _conflicts(reg, holders),
        "cache_policies": policies,
        "errors": [
            {"entry_point": f.plugin.entry_point, "distribution": f.plugin.distribution,
             "version": f.plugin.version, "error": f.message}
            for f in reg.errors if not isinstance(f.error, DuplicateConnectorError)
        ] + policy_errors,
        "skipped": [
            {"entry_point": p.entry_point, "distribution": p.distribution, "reason": reason}
            for p, reason in reg.skipped
        ],
    }


def _cache_policies() -> tuple[list[dict[str, str]], list[dict[str, Any]]]:
    """The offload tier's cache policies (name, class, plugin) and the policy plugins
    that failed, as rows of ``errors``."""
    from connectors.offload.manager import registry as policies

    rows = [{"name": name, "class": f"{cls.__module__}.{cls.__qualname__}",
             "plugin": policies.policy_sources()[name]}
            for name in policies.available_cache_policies()
            for cls in [policies.get_cache_policy(name)]]
    errors = [{"entry_point": f"{e.plugin} (cache policy plugin {e.value})",
               "distribution": None, "version": None, "error": e.error}
              for e in policies.policy_plugin_errors()]
    return rows, errors


def _policy_table(policies: list[dict[str, str]]) -> str:
    rows = [["NAME", "CLASS", "PLUGIN"]]
    rows += [[p["name"], p["class"], p["plugin"]] for p in policies]
    return "\ncache policies (offload cache_policy):\n" + _table(rows) + "\n"


def _connectors(reg: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every registry entry as plain data, and the entry holding each conflicted name."""
    connectors = []
    holders: dict[str, Any] = {}
    for e in reg.entries():
        conflicted = [n for n in (e.name, *e.aliases) if n not in reg]
        for n in conflicted:
            holders[n] = e
        connectors.append(
            {"name": e.name, "aliases": list(e.aliases), "class": e.class_path,
             "distribution": e.distribution, "version": e.version, "entry_point": e.source,
             "conflicted_names": conflicted, "usable": e.name not in conflicted})
    return connectors, holders


def _conflicts(reg: Any, holders: dict[str, Any]) -> list[dict[str, Any]]:
    """Each conflicted name with its holder, the plugin that clashed with it and the error."""
    from kvconnector_core.errors import DuplicateConnectorError

    conflicts = []
    for name, holder in sorted(holders.items()):
        try:
            reg.get(name)
        except DuplicateConnectorError as exc:
            message = str(exc)
        else:  # pragma: no cover - a name not in the registry always fails to resolve
            continue
        claimant = next((f.plugin for f in reg.errors
                         if isinstance(f.error, DuplicateConnectorError)
                         and f.message == message), None)
        conflicts.append({
            "name": name,
            "holder": {"class": holder.class_path, "entry_point": holder.source,
                       "distribution": holder.distribution, "version": holder.version},
            "claimant": None if claimant is None else {
                "entry_point": claimant.entry_point, "distribution": claimant.distribution,
                "version": claimant.version},
            "error": message,
        })
    return conflicts


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _origin(entry_point: str, distribution: str | None) -> str:
    """``entry point (distribution)``, as the text sections name a plugin."""
    return f"{entry_point} ({distribution or 'unknown distribution'})"


def _text(data: dict[str, Any]) -> str:
    """The listing as the table and its sections (conflicts, failed, skipped)."""
    rows = [["NAME", "ALIASES", "CLASS", "DISTRIBUTION", "VERSION", "STATUS"]]
    rows += [[c["name"], ",".join(c["aliases"]) or "-", c["class"], c["distribution"] or "-",
              c["version"] or "-", _status(c)] for c in data["connectors"]]
    lines = [_table(rows) if data["connectors"] else "no connectors found"]
    lines.append(_policy_table(data["cache_policies"]).rstrip("\n"))
    if data["conflicts"]:
        lines.append("\nconflicts (these names do not resolve until one claimant is removed):")
        for c in data["conflicts"]:
            holder, claimant = c["holder"], c["claimant"]
            other = (_origin(claimant["entry_point"], claimant["distribution"]) if claimant
                     else "another class")
            lines.append(f"  {c['name']!r}: {holder['class']} from "
                         f"{_origin(holder['entry_point'], holder['distribution'])} vs {other}: "
                         f"{c['error']}")
    if data["errors"]:
        lines.append("\nfailed to load:")
        lines += [f"  {_origin(e['entry_point'], e['distribution'])}: {e['error']}"
                  for e in data["errors"]]
    if data["skipped"]:
        lines.append("\nskipped:")
        lines += [f"  {_origin(s['entry_point'], s['distribution'])}: {s['reason']}"
                  for s in data["skipped"]]
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace, registry: Any = None) -> int:
    """Print the listing; return 2 when a plugin failed or a name is conflicted, else 0."""
    data = collect(registry)
    if getattr(args, "json", False):
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
    else:
        sys.stdout.write(_text(data))
    if data["errors"] or data["conflicts"]:
        print(f"kvconnector list: {len(data['errors'])} plugin(s) failed to load, "
              f"{len(data['conflicts'])} conflicted name(s); see above", file=sys.stderr)
        return 2
    return 0


def _status(connector: dict[str, Any]) -> str:
    if not connector["usable"]:
        return "CONFLICT (unusable)"
    if connector["conflicted_names"]:
        return "ok; alias conflict: " + ",".join(connector["conflicted_names"])
    return "ok"
