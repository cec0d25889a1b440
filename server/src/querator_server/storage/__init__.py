"""LMDB storage: the queue catalog and one environment per queue.

Nothing in this package knows about gRPC; it stores and finds items by key.
"""

from .catalog import Catalog, CatalogError
from .queue_store import MAX_GROWTHS, MapFull, PartitionScan, QueueStore, StorageError, StorageFull
from .record import Item

__all__ = [
    "Catalog",
    "CatalogError",
    "Item",
    "MAX_GROWTHS",
    "MapFull",
    "PartitionScan",
    "QueueStore",
    "StorageError",
    "StorageFull",
]
