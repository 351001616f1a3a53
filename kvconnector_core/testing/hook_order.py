"""The reference order of a connector's worker hooks, and a recorder to check a caller keeps it.

Primitives: :data:`WORKER_STEP_HOOKS`, :func:`check_hook_order`, :func:`record_calls`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvconnector_core.connector.base import KVConnectorBase_V1

__all__ = ["WORKER_STEP_HOOKS", "check_hook_order", "record_calls"]

WORKER_STEP_HOOKS: tuple[str, ...] = (
    "bind_connector_metadata",
    "handle_preemptions",
    "start_load_kv",
    "wait_for_save",
    "get_transfer_results",
    "get_block_ids_with_load_errors",
    "get_kv_connector_stats",
    "build_connector_worker_meta",
    "clear_connector_metadata",
)
"""The worker hooks of one step without a forward, in the reference order (KVConnectorBase_V1)."""


def check_hook_order(calls: Sequence[str], expected: Sequence[str]) -> None:
    """Assert that ``calls`` is exactly ``expected``, naming the first hook out of place.

    Raises:
        AssertionError: the sequences differ.
    """
    for i, (got, want) in enumerate(zip(calls, expected)):
        assert got == want, (
            f"hook order violated at call {i}: got {got!r}, the reference order wants {want!r} "
            f"(calls: {list(calls)})")
    assert len(calls) == len(expected), (
        f"{len(calls)} hook calls where the reference order has {len(expected)}: {list(calls)}")


def record_calls(conn: KVConnectorBase_V1, hooks: Sequence[str]) -> list[str]:
    """Record the outermost calls of ``hooks`` on ``conn`` (instance attributes shadow its methods).

    Calls a hook makes to another recorded hook of its own (the default
    ``get_transfer_results`` calls ``get_finished``) are not recorded: only the
    order the caller used matters.
    """
    calls: list[str] = []
    depth = [0]
    for hook in hooks:
        original = getattr(conn, hook)

        @functools.wraps(original)
        def recorded(*args: Any, _hook: str = hook, _original: Any = original,
                     **kwargs: Any) -> Any:
            if depth[0] == 0:
                calls.append(_hook)
            depth[0] += 1
            try:
                return _original(*args, **kwargs)
            finally:
                depth[0] -= 1

        setattr(conn, hook, recorded)
    return calls
