"""The logical-queue actor and the requests it accepts."""

from .logical_queue import LogicalQueue
from .requests import (
    ClearRequest,
    CompleteRequest,
    DeleteItemsRequest,
    ExtendRequest,
    ExtendResult,
    GiveBackRequest,
    ImportItemsRequest,
    LeaseRequest,
    LeaseResult,
    ListItemsRequest,
    PageResult,
    ProduceRequest,
    ProduceResult,
    RedriveRequest,
    RedriveResult,
    RetryRequest,
    StoredItem,
)

__all__ = [
    "ClearRequest",
    "CompleteRequest",
    "DeleteItemsRequest",
    "ExtendRequest",
    "ExtendResult",
    "GiveBackRequest",
    "ImportItemsRequest",
    "LeaseRequest",
    "LeaseResult",
    "ListItemsRequest",
    "LogicalQueue",
    "PageResult",
    "ProduceRequest",
    "ProduceResult",
    "RedriveRequest",
    "RedriveResult",
    "RetryRequest",
    "StoredItem",
]
