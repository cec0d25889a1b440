"""The gRPC face of the server: handlers, conversions and the status boundary."""

from .queue_service import QueueService
from .queues_service import QueuesService
from .storage_service import StorageService

__all__ = ["QueueService", "QueuesService", "StorageService"]
