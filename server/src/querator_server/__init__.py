"""The Querator server: a lease-based FIFO work queue served over gRPC.

Layers, each knowing only the one below it:

- ``grpc_api``: gRPC handlers; validate requests, convert protobuf to domain values,
  map domain errors to gRPC status. They know nothing of LMDB.
- ``manager`` and ``actor``: the queues manager and one logical-queue actor per queue,
  which batches every waiting request into one storage transaction per cycle.
- ``storage``: LMDB environments, key layout and item records. It knows nothing of gRPC.
"""

__version__ = "0.1.0"
