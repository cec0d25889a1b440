"""Tasks by name: a function registered for a ``kind``, with the codec of its arguments.

Sugar over Produce and the worker's dispatch by kind, nothing more: ``email.enqueue(to=...)``
produces one item of kind ``"email"`` whose payload is the arguments, encoded (JSON by
default); a worker that includes the registry decodes them and calls the function. The
same registry on both sides means a misspelt kind fails where it is produced
(:class:`UnknownTask`), not later in the dead-letter queue.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Generic, Literal, ParamSpec, Protocol, TypeVar

from .._models import Item
from ..errors import DeadLetter
from .dispatch import Route, is_async
from .kinds import KindOptions

if TYPE_CHECKING:
    from .._async_client import AsyncClient
    from .._client import Client
    from .._items import AnyLeasedItem, _LeasedBase

P = ParamSpec("P")
R = TypeVar("R")

Args = tuple[tuple[Any, ...], dict[str, Any]]


class Codec(Protocol):
    """How a task's arguments become a payload and back (``codec=`` of :meth:`Tasks.task`)."""

    #: The items' ``encoding`` (a MIME type).
    encoding: str

    def encode(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes: ...

    def decode(self, payload: bytes) -> Args: ...


class JsonCodec:
    """Keyword arguments as a JSON object: any language can produce such a task."""

    encoding = "application/json"

    def encode(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
        if args:
            raise TypeError("a task with the json codec takes keyword arguments only (they are a JSON object)")
        return json.dumps(kwargs, separators=(",", ":")).encode()

    def decode(self, payload: bytes) -> Args:
        value = json.loads(payload) if payload else {}
        if not isinstance(value, dict):
            raise ValueError(f"the payload is not a JSON object but {type(value).__name__}")
        return (), value


class MsgpackCodec:
    """Keyword arguments as a MessagePack map (the ``msgpack`` extra): bytes stay bytes."""

    encoding = "application/msgpack"

    def __init__(self) -> None:
        import msgpack

        self._msgpack = msgpack

    def encode(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
        if args:
            raise TypeError("a task with the msgpack codec takes keyword arguments only (they are a map)")
        return self._msgpack.packb(kwargs, use_bin_type=True)  # type: ignore[no-any-return]

    def decode(self, payload: bytes) -> Args:
        value = self._msgpack.unpackb(payload, raw=False) if payload else {}
        if not isinstance(value, dict):
            raise ValueError(f"the payload is not a MessagePack map but {type(value).__name__}")
        return (), value


class BytesCodec:
    """One positional ``bytes`` argument, the payload as it is."""

    encoding = "application/octet-stream"

    def encode(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
        if kwargs or len(args) != 1 or not isinstance(args[0], (bytes, bytearray, memoryview)):
            raise TypeError("a task with the bytes codec takes one positional bytes argument")
        return bytes(args[0])

    def decode(self, payload: bytes) -> Args:
        return (payload,), {}


def _codec(codec: Literal["json", "msgpack", "bytes"] | Codec) -> Codec:
    if codec == "json":
        return JsonCodec()
    if codec == "msgpack":
        return MsgpackCodec()
    if codec == "bytes":
        return BytesCodec()
    if isinstance(codec, str) or not all(hasattr(codec, name) for name in ("encoding", "encode", "decode")):
        raise ValueError(f"codec is 'json', 'msgpack', 'bytes' or a Codec, not {codec!r}")
    return codec


class UnknownTask(LookupError):
    """A kind that the task registry does not have (raised before anything is produced)."""


_current: contextvars.ContextVar[AnyLeasedItem] = contextvars.ContextVar("querator_current_item")


def current_item() -> AnyLeasedItem:
    """The leased item whose task runs now (in a task's function, on its thread or task):
    its ``attempts``, ``message_id``, ``partition``. LookupError elsewhere, and in a
    child process (``executor="process"``), which the item cannot reach."""
    try:
        return _current.get()
    except LookupError:
        raise LookupError("querator.current_item() is called from a task's function while the worker runs it") from None


class Task(Generic[P]):
    """A function registered for a kind (made by :meth:`Tasks.task`).

    Calling it calls the function; :meth:`enqueue` / :meth:`enqueue_at` (asyncio) and
    :meth:`send` / :meth:`send_at` (blocking) produce an item of the kind to the
    registry's queue, through the registry's client, with the arguments as payload.
    """

    def __init__(self, tasks: Tasks, kind: str, function: Callable[P, Any], codec: Codec, options: KindOptions) -> None:
        self.tasks = tasks
        self.kind = kind
        self.function = function
        self.codec = codec
        self.options = options
        self._signature = inspect.signature(function)
        functools.update_wrapper(self, function)
        self.__qualname__: str = getattr(function, "__qualname__", kind)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> Any:
        return self.function(*args, **kwargs)

    def __reduce__(self) -> str:
        # Pickled by reference (module and name), for executor="process": the child
        # imports the module and finds this task there.
        return self.__qualname__

    def __repr__(self) -> str:
        return f"<Task {self.kind!r}: {self.__module__}.{self.__qualname__}>"

    # -- producing ----------------------------------------------------------------------------

    def item(self, *args: P.args, **kwargs: P.kwargs) -> Item:
        """The :class:`~querator.Item` that runs this task with these arguments (to
        produce many at once, or with an ``idempotency_key``: ``dataclasses.replace``)."""
        try:
            self._signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"task {self.kind!r}: {exc}") from None
        return Item(self.codec.encode(args, kwargs), encoding=self.codec.encoding, kind=self.kind)

    async def enqueue(self, *args: P.args, **kwargs: P.kwargs) -> str:
        """Produce the task now; returns the item's id."""
        return await self.tasks._produce(self.item(*args, **kwargs))

    async def enqueue_at(self, when: datetime, *args: P.args, **kwargs: P.kwargs) -> str:
        """Produce the task to run at ``when`` (timezone-aware); returns the item's id."""
        return await self.tasks._produce(_at(self.item(*args, **kwargs), when))

    def send(self, *args: P.args, **kwargs: P.kwargs) -> str:
        """The blocking twin of :meth:`enqueue` (the registry's client is a Client)."""
        return self.tasks._send(self.item(*args, **kwargs))

    def send_at(self, when: datetime, *args: P.args, **kwargs: P.kwargs) -> str:
        """The blocking twin of :meth:`enqueue_at`."""
        return self.tasks._send(_at(self.item(*args, **kwargs), when))

    # -- handling -----------------------------------------------------------------------------

    def _arguments(self, item: _LeasedBase) -> Args:
        """The item's arguments, or DeadLetter: a payload that does not decode, or does not
        fit the function, never will."""
        try:
            args, kwargs = self.codec.decode(item.payload)
            self._signature.bind(*args, **kwargs)
        except Exception as exc:
            raise DeadLetter(f"task {self.kind!r}: bad arguments in the payload: {exc}") from exc
        return args, kwargs

    def route(self) -> Route:
        """How the worker runs this task: decode, then call the function (on the loop, a
        thread, or a child process)."""
        function: Callable[..., Any] = self.function
        if is_async(function):

            async def handle_async(item: _LeasedBase) -> None:
                args, kwargs = self._arguments(item)
                token = _current.set(item)  # type: ignore[arg-type]
                try:
                    await function(*args, **kwargs)
                finally:
                    _current.reset(token)

            return Route(handle_async, self.options)

        def handle(item: _LeasedBase) -> None:
            args, kwargs = self._arguments(item)
            token = _current.set(item)  # type: ignore[arg-type]
            try:
                function(*args, **kwargs)
            finally:
                _current.reset(token)

        def in_process(item: _LeasedBase) -> tuple[Callable[..., object], tuple[Any, ...], dict[str, Any]]:
            args, kwargs = self._arguments(item)
            return self, args, kwargs

        return Route(handle, self.options, in_process)


def _at(item: Item, when: datetime) -> Item:
    if when.tzinfo is None:
        raise ValueError("enqueue_at takes a timezone-aware datetime (e.g. datetime.now(UTC) + timedelta(...))")
    return Item(item.payload, encoding=item.encoding, kind=item.kind, enqueue_at=when)


@dataclass(eq=False)
class Tasks:
    """A registry of tasks for one queue, shared by the code that produces them and the
    worker that runs them (``worker.include(tasks)``, ``WorkerSettings(tasks=...)``)::

        tasks = querator.Tasks("notifications")

        @tasks.task("email")
        def send_email(to: str, subject: str) -> None: ...

        tasks.client = querator.Client("127.0.0.1:2319")   # or an AsyncClient
        send_email.send(to="a@example.com", subject="hi")  # await ....enqueue() with an AsyncClient
    """

    queue: str
    #: The client that produces (a Client, or an AsyncClient for enqueue()).
    client: Client | AsyncClient | None = None

    def __post_init__(self) -> None:
        self._tasks: dict[str, Task[Any]] = {}

    def task(
        self, kind: str, *, codec: Literal["json", "msgpack", "bytes"] | Codec = "json", **options: Any
    ) -> Callable[[Callable[P, Any]], Task[P]]:
        """Register a function (``def`` or ``async def``) as the task of ``kind`` (a
        decorator). ``codec``: how its arguments travel: "json" (keyword arguments as a
        JSON object, the default), "msgpack" (the ``msgpack`` extra) or "bytes" (one
        bytes argument). ``options``: :class:`~querator.KindOptions` fields
        (``handler_timeout``, ``concurrency``, ``retry_on``, ``dead_on``, ``max_attempts``,
        ``executor``, ``time_limit``, ...)."""
        if not isinstance(kind, str) or not kind:
            raise ValueError(f"a task's kind is a non-empty string, not {kind!r}")
        if kind in self._tasks:
            raise ValueError(f"a task of kind {kind!r} is registered already")
        chosen = _codec(codec)
        kind_options = KindOptions(**options)

        def register(function: Callable[P, Any]) -> Task[P]:
            task = Task(self, kind, function, chosen, kind_options)
            task.route()  # rejects an executor the function cannot have, now
            self._tasks[kind] = task
            return task

        return register

    def __getitem__(self, kind: str) -> Task[Any]:
        try:
            return self._tasks[kind]
        except KeyError:
            known = ", ".join(sorted(self._tasks)) or "none"
            raise UnknownTask(f"no task of kind {kind!r} on queue {self.queue!r} (known: {known})") from None

    def __contains__(self, kind: object) -> bool:
        return kind in self._tasks

    def __iter__(self) -> Iterator[Task[Any]]:
        return iter(list(self._tasks.values()))

    def __len__(self) -> int:
        return len(self._tasks)

    def item(self, kind: str, /, *args: Any, **kwargs: Any) -> Item:
        """The item of the task ``kind`` with these arguments; UnknownTask if there is none."""
        return self[kind].item(*args, **kwargs)

    async def enqueue(self, kind: str, /, *args: Any, **kwargs: Any) -> str:
        """Produce the task ``kind`` by name; UnknownTask (nothing produced) if the
        registry has no such kind."""
        return await self._produce(self.item(kind, *args, **kwargs))

    def send(self, kind: str, /, *args: Any, **kwargs: Any) -> str:
        """The blocking twin of :meth:`enqueue`."""
        return self._send(self.item(kind, *args, **kwargs))

    async def _produce(self, item: Item) -> str:
        client = self._client()
        from .._async_client import AsyncClient

        if isinstance(client, AsyncClient):
            result = await client.produce(self.queue, item)
        else:  # a blocking client: off the loop
            result = await asyncio.to_thread(client.produce, self.queue, item)
        return result.ids[0]

    def _send(self, item: Item) -> str:
        client = self._client()
        from .._client import Client

        if not isinstance(client, Client):
            raise TypeError("send() blocks: it needs a querator.Client (with an AsyncClient, await enqueue())")
        return client.produce(self.queue, item).ids[0]

    def _client(self) -> Client | AsyncClient:
        if self.client is None:
            raise RuntimeError("the task registry has no client: set tasks.client = querator.Client(...) first")
        return self.client
