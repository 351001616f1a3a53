"""The scheduler: request batching, admission, connector hooks, failed-load recovery.

Importing this package does not import torch.
"""

from kvconnector_core.scheduler.output import CachedRequestData
from kvconnector_core.scheduler.output import ModelRunnerOutput
from kvconnector_core.scheduler.output import NewRequestData
from kvconnector_core.scheduler.output import SchedulerOutput
from kvconnector_core.scheduler.output import yield_req_data
from kvconnector_core.scheduler.scheduler import LOAD_FAILURE_POLICIES
from kvconnector_core.scheduler.scheduler import Scheduler
from kvconnector_core.scheduler.scheduler import SchedulerStats

__all__ = [
    "CachedRequestData",
    "LOAD_FAILURE_POLICIES",
    "ModelRunnerOutput",
    "NewRequestData",
    "Scheduler",
    "SchedulerOutput",
    "SchedulerStats",
    "yield_req_data",
]
