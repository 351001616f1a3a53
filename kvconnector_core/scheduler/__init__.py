"""The scheduler: request batching, admission, connector hooks, failed-load recovery.

Importing this package does not import torch.
"""

from kvconnector_core.scheduler.output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    yield_req_data,
)
from kvconnector_core.scheduler.scheduler import LOAD_FAILURE_POLICIES, Scheduler, SchedulerStats

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
