"""The scheduler: request batching, admission, connector hooks, failed-load recovery.

Importing this package does not import torch.

Primitives:

- :class:`Scheduler` -- plans engine steps (:mod:`.scheduler`).
- :class:`SchedulerStats` -- what the scheduler did (:mod:`.stats`).
- :data:`LOAD_FAILURE_POLICIES` -- valid ``load_failure_policy`` values.
- The records crossing the scheduler/worker boundary (:mod:`.output`).
"""

from kvconnector_core.scheduler.output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    yield_req_data,
)
from kvconnector_core.scheduler.scheduler import LOAD_FAILURE_POLICIES, Scheduler
from kvconnector_core.scheduler.stats import SchedulerStats

__all__ = [
    "LOAD_FAILURE_POLICIES",
    "CachedRequestData",
    "ModelRunnerOutput",
    "NewRequestData",
    "Scheduler",
    "SchedulerOutput",
    "SchedulerStats",
    "yield_req_data",
]
