"""Querator for Python: a client for the Querator lease-based FIFO work-queue service.

::

    import querator

    with querator.Client("127.0.0.1:2319") as client:
        client.create_queue("emails")
        client.produce("emails", ["hello", "world"])
        for item in client.lease("emails", batch_size=10, wait=5):
            with item:              # completes on success, retries on exception
                print(item.text)

- :class:`Client` / :class:`AsyncClient`: every call of the v1 API, sync and asyncio.
- :class:`Producer` / :class:`AsyncProducer`: batch single items into few requests.
- :class:`Worker` / :class:`AsyncWorker`: lease, run a handler, complete / retry / extend.
- :mod:`querator.errors`: the exception tree; :mod:`querator.testing` and
  :mod:`querator.embedded`: a real server inside this process.
- :mod:`querator.tracing`: OpenTelemetry trace context from produce to the worker
  (``ClientConfig(tracing=True)``; the ``otel`` extra).

The generated gRPC stubs live in ``querator.v1`` (``queue_pb2``, ``queues_pb2``,
``storage_pb2``, ``keys_pb2`` and their ``_grpc`` twins).
"""

# querator.v1 (the generated code) comes from the querator-proto distribution, which
# may sit in another directory than this package (editable installs, or separate
# sys.path entries): look for portions of ``querator`` along the whole path.
import pkgutil

__path__ = pkgutil.extend_path(__path__, __name__)

from ._async_client import AsyncClient
from ._client import Client
from ._config import Backoff, ClientConfig
from ._failure import failure_text
from ._items import AnyLeasedItem, AsyncLeasedItem, LeasedItem
from ._models import (
    ApiKey,
    ClusterMember,
    ClusterView,
    CompleteResult,
    CreatedKey,
    DeadReason,
    ExtendResult,
    Item,
    ItemRef,
    Page,
    PartitionStats,
    ProduceResult,
    PromotedCopy,
    QueueInfo,
    QueueStats,
    RedriveResult,
    ReplicaSet,
    RetiredNode,
    RetryResult,
    SetAsideQueue,
    SetAsideQueues,
    StoredItem,
)
from ._paging import AsyncPager, Pager
from ._producer import AsyncProducer, Producer
from ._worker import (
    AsyncWorker,
    Codec,
    Kind,
    KindOptions,
    Periodic,
    RetryRule,
    Task,
    Tasks,
    UnknownTask,
    Worker,
    WorkerHooks,
    WorkerOptions,
    WorkerSettings,
    WorkerStats,
    current_item,
)
from .errors import (
    Cancelled,
    DeadLetter,
    DeadlineExceeded,
    FailedPrecondition,
    FieldViolation,
    HandlerTimeout,
    InvalidRequest,
    ItemNotFound,
    LeaseLost,
    MessageTooLarge,
    NotFound,
    NotLeased,
    Overloaded,
    PermissionDenied,
    QueratorError,
    QueueExists,
    QueueNotFound,
    ServerError,
    TimeLimitExceeded,
    Unauthenticated,
    Unavailable,
)

__version__ = "0.1.0"

# Submodules reachable as attributes without an import of their own, loaded on first
# use: querator.testing and querator.embedded need the server package only when used.
_LAZY_SUBMODULES = frozenset({"cli", "embedded", "testing", "tracing"})


def __getattr__(name: str) -> object:
    if name in _LAZY_SUBMODULES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AnyLeasedItem",
    "ApiKey",
    "SetAsideQueue",
    "SetAsideQueues",
    "AsyncClient",
    "AsyncLeasedItem",
    "AsyncPager",
    "AsyncProducer",
    "AsyncWorker",
    "Backoff",
    "Cancelled",
    "Client",
    "ClientConfig",
    "ClusterMember",
    "ClusterView",
    "CompleteResult",
    "ReplicaSet",
    "PromotedCopy",
    "RetiredNode",
    "CreatedKey",
    "DeadLetter",
    "DeadReason",
    "DeadlineExceeded",
    "ExtendResult",
    "FailedPrecondition",
    "FieldViolation",
    "HandlerTimeout",
    "InvalidRequest",
    "Item",
    "ItemNotFound",
    "ItemRef",
    "LeaseLost",
    "LeasedItem",
    "NotFound",
    "NotLeased",
    "MessageTooLarge",
    "Overloaded",
    "Page",
    "Periodic",
    "Pager",
    "PartitionStats",
    "PermissionDenied",
    "ProduceResult",
    "Producer",
    "QueratorError",
    "QueueExists",
    "QueueInfo",
    "QueueNotFound",
    "QueueStats",
    "RedriveResult",
    "RetryResult",
    "RetryRule",
    "ServerError",
    "StoredItem",
    "Unauthenticated",
    "Unavailable",
    "Worker",
    "WorkerHooks",
    "WorkerOptions",
    "WorkerSettings",
    "WorkerStats",
    "Codec",
    "Kind",
    "KindOptions",
    "Task",
    "Tasks",
    "TimeLimitExceeded",
    "UnknownTask",
    "current_item",
    "failure_text",
    "__version__",
]
