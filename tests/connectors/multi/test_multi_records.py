"""MultiConnector's shared records and helpers: setup fan-out, error deltas, stats sums and
the worker report folded over workers."""

from __future__ import annotations

import pytest

from connectors.multi import MultiKVConnectorWorkerMetadata
from connectors.multi.fanout import aggregate_stats, call_each, new_hook_errors
from connectors.offload.records import OffloadWorkerMetadata
from kvconnector_core.errors import ConnectorHookError, InvariantError


def test_call_each_runs_every_call_then_raises_the_first_failure() -> None:
    ran: list[int] = []

    def call(i: int, fail: bool):
        def run() -> None:
            ran.append(i)
            if fail:
                raise ConnectorHookError(f"child {i} failed", f"child{i}", "register_kv_caches")
        return run

    with pytest.raises(ConnectorHookError, match="child 1 failed"):
        call_each([call(0, False), call(1, True), call(2, True), call(3, False)])
    assert ran == [0, 1, 2, 3]


class _Guard:
    def __init__(self, label: str, errors: dict[str, int]) -> None:
        self.label, self.errors = label, errors


def test_hook_errors_are_reported_as_deltas_since_the_last_report() -> None:
    guard = _Guard("a", {"save_kv_layer": 2})
    reported: dict[str, int] = {}
    assert new_hook_errors([guard], reported) == {"a.save_kv_layer": 2}
    assert new_hook_errors([guard], reported) == {}  # nothing new
    guard.errors["save_kv_layer"] = 5
    assert new_hook_errors([guard], reported) == {"a.save_kv_layer": 3}


def test_stats_sum_float_and_int_standard_keys() -> None:
    stats = aggregate_stats(
        {"a": {"load_seconds": 0.25, "bytes_loaded": 3}, "b": {"load_seconds": 0.5}}, {})
    assert stats is not None
    assert stats["load_seconds"] == 0.75 and stats["bytes_loaded"] == 3


def test_worker_reports_fold_child_by_child_over_workers() -> None:
    """Each worker reports its shard; folded, a child's record is kept where only one
    worker had one, and a child failed if it failed on any worker."""
    a = OffloadWorkerMetadata(done_job_ids=[1])
    mine = MultiKVConnectorWorkerMetadata((None, a), loads_failed=(1,), step=4)
    theirs = MultiKVConnectorWorkerMetadata((a, None), loads_failed=(0,), stores_failed=(1,),
                                            step=5)
    folded = mine.aggregate(theirs)
    assert folded == MultiKVConnectorWorkerMetadata((a, a), loads_failed=(0, 1),
                                                    stores_failed=(1,), step=5)
    assert theirs.aggregate(mine) == folded
    with pytest.raises(InvariantError, match="1 and 2 children"):
        MultiKVConnectorWorkerMetadata((None,)).aggregate(mine)
