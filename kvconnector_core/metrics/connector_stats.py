"""Connector stats (flattened, dotted keys) to the ``connector``-scope series.

A connector's ``get_kv_connector_stats`` returns per-step deltas, flattened by the engine
and by the vLLM adapter into dotted keys: ``bytes_loaded``, a tier's ``disk_loads``, a
MultiConnector's ``children.<child>.bytes_loaded`` and ``hook_errors.<child>.<hook>``.
:func:`record_connector_stats` turns one batch of such deltas into series updates, labelling
each number with the connector (or MultiConnector child) that reported it; a wrapper's own
sums of its children's standard keys are skipped, so nothing is counted twice.

Primitives: :func:`record_connector_stats`, :func:`owner_of`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from kvconnector_core.metrics.series import MetricSet

__all__ = ["owner_of", "record_connector_stats"]

_CHILDREN = "children."
_HOOK_ERRORS = "hook_errors."
_QUARANTINED = "quarantined"
_TRANSFER = {"bytes_loaded": ("kvconnector_transfer_bytes_total", "load"),
             "bytes_stored": ("kvconnector_transfer_bytes_total", "store"),
             "load_seconds": ("kvconnector_transfer_seconds", "load"),
             "store_seconds": ("kvconnector_transfer_seconds", "store")}
# A secondary tier's counters (connectors.tiers): "<medium>_<stat>".
_TIER_KEY = re.compile(r"^([a-z0-9]+)_(stores_dropped|store_failures|load_failures|"
                       r"lookup_failures|bytes_loaded|bytes_stored|stores|loads|lookups)$")
_TIER_SERIES: dict[str, tuple[str, dict[str, str]]] = {
    "loads": ("kvconnector_tier_loads_total", {}),
    "stores": ("kvconnector_tier_stores_total", {}),
    "lookups": ("kvconnector_tier_lookups_total", {}),
    "bytes_loaded": ("kvconnector_tier_transfer_bytes_total", {"direction": "load"}),
    "bytes_stored": ("kvconnector_tier_transfer_bytes_total", {"direction": "store"}),
    "load_failures": ("kvconnector_tier_failures_total", {"operation": "load"}),
    "store_failures": ("kvconnector_tier_failures_total", {"operation": "store"}),
    "lookup_failures": ("kvconnector_tier_failures_total", {"operation": "lookup"}),
    "stores_dropped": ("kvconnector_tier_stores_dropped_total", {}),
}


def owner_of(key: str, connector: str) -> tuple[str, str, str]:
    """Split a flattened stats key into ``(wrapper path, owner, rest)``.

    ``children.<a>.children.<b>.x`` is owned by child ``b`` (the innermost), with the
    wrapper path ``children.<a>.children.<b>.`` and the rest ``x``; a key without
    ``children.`` is owned by ``connector``.
    """
    path, owner = "", connector
    while key.startswith(_CHILDREN):
        label, sep, rest = key[len(_CHILDREN):].partition(".")
        if not sep:
            break
        path, owner, key = f"{path}{_CHILDREN}{label}.", label, rest
    return path, owner, key


def _wrappers(keys: Sequence[str]) -> set[str]:
    """The wrapper paths (``""`` for the top) that have children in ``keys``."""
    out: set[str] = set()
    for key in keys:
        path = ""
        while key.startswith(_CHILDREN):
            out.add(path)
            label, _, key = key[len(_CHILDREN):].partition(".")
            path = f"{path}{_CHILDREN}{label}."
    return out


def _record_hook_error(metrics: MetricSet, base: Sequence[object], owner: str, rest: str,
                       value: float) -> None:
    """``hook_errors.<child>.<hook>`` (or a plain hook name) -> errors or quarantines."""
    child, _, hook = rest.rpartition(".")
    labels = {"connector": child or owner}
    if hook == _QUARANTINED:
        metrics.inc("kvconnector_quarantines_total", base, labels, value)
    else:
        metrics.inc("kvconnector_hook_errors_total", base, {**labels, "hook": hook}, value)


def _record_counter(metrics: MetricSet, base: Sequence[object], owner: str, rest: str,
                    value: float, stat_prefix: str) -> None:
    labels = {"connector": owner}
    transfer = _TRANSFER.get(rest)
    if transfer is not None:
        name, direction = transfer
        if name.endswith("_seconds"):
            if value > 0:
                metrics.observe(name, base, {**labels, "direction": direction}, value)
        else:
            metrics.inc(name, base, {**labels, "direction": direction}, value)
        return
    if rest.startswith(_HOOK_ERRORS):
        _record_hook_error(metrics, base, owner, rest[len(_HOOK_ERRORS):], value)
        return
    tier = _TIER_KEY.match(rest)
    if tier is not None:
        name, extra = _TIER_SERIES[tier.group(2)]
        metrics.inc(name, base, {**labels, "tier": tier.group(1), **extra}, value)
        return
    metrics.inc("kvconnector_connector_stat_total", base,
                {**labels, "stat": stat_prefix + rest}, value)


def record_connector_stats(metrics: MetricSet, base: Sequence[object], connector: str,
                           counters: Mapping[str, float], gauges: Mapping[str, float], *,
                           stat_prefix: str = "") -> None:
    """Record one batch of a connector's stats deltas and its latest levels.

    Args:
        metrics: the series (``connector`` scope).
        base: values of ``metrics.base_labels`` (vLLM's per-engine labels).
        connector: the connector's name: the label of numbers not owned by a child.
        counters: flattened counter deltas (see the module docstring).
        gauges: flattened levels (the keys under ``gauges``, without that segment).
        stat_prefix: put before the ``stat`` label of numbers without a series of their
            own (the engine passes ``"scheduler."`` for the scheduler side's stats).
    """
    wrappers = _wrappers([*counters, *gauges])
    for key, value in counters.items():
        path, owner, rest = owner_of(key, connector)
        if path in wrappers and rest in _TRANSFER:
            continue  # a wrapper's sum of its children's numbers
        _record_counter(metrics, base, owner, rest, value, stat_prefix)
    for key, value in gauges.items():
        _, owner, rest = owner_of(key, connector)
        metrics.set("kvconnector_connector_gauge", base,
                    {"connector": owner, "stat": stat_prefix + rest}, value)
