"""Querator: a lease-based, almost-exactly-once FIFO work-queue service.

The generated gRPC stubs live in ``querator.v1`` (``queue_pb2``, ``queues_pb2``,
``storage_pb2`` and their ``_grpc`` twins).
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
