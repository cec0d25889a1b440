"""LMDB storage: the queue catalog, the commit groups' shared environments, and the
environments of queues that have one of their own.

Nothing in this package knows about gRPC; it stores and finds items by key.
"""

from .local_catalog import Catalog, CatalogError
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
