"""pagedserve.scheduler: iteration-level continuous batching (host-side only, no torch)."""

from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.errors import RequestRejectedError, SchedulerOverloadedError
from pagedserve.scheduler.in_flight import StepsInFlight
from pagedserve.scheduler.kv_connector import KVConnectorScheduler
from pagedserve.scheduler.output import ScheduledRequest, SchedulerOutput, SchedulerStats
from pagedserve.scheduler.request import Request, RequestStatus
from pagedserve.scheduler.scheduler import Scheduler

__all__ = [
    "KVConnectorScheduler",
    "Request",
    "RequestRejectedError",
    "RequestStatus",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerOverloadedError",
    "SchedulerStats",
    "StepsInFlight",
]
