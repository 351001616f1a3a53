"""The guard retries a report the connector raised on once per step, never in a loop: a
connector that keeps raising must not hold the engine inside one call (a ``continue`` for the
``break`` in the redelivery loop would)."""

from __future__ import annotations

import pytest

from kvconnector_core.connector.guard import GuardedScheduler
from kvconnector_core.connector.metadata import KVConnectorOutput

from test_guard import Probe


@pytest.mark.timeout(20)  # were it to loop on a connector that always raises: fail fast
def test_a_report_the_connector_keeps_raising_on_is_retried_once_per_step():
    probe = Probe()
    guard = GuardedScheduler(probe)
    probe.fail["update_connector_output"] = 3
    reports = [KVConnectorOutput(finished_sending={f"r{i}"}) for i in range(4)]
    delivered = []
    for report in reports:
        guard.update_connector_output(report)
        delivered.append([arg for hook, arg in probe.calls if hook == "update_connector_output"])
    first = reports[0]
    # one try of the oldest report per call while it raises, then everything in order
    assert delivered == [[first], [first] * 2, [first] * 3, [first] * 4 + reports[1:]]
    assert guard.errors == {"update_connector_output": 3}
