"""Which handler an item goes to: one for every item, or one per ``kind``."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from .._convert import seconds
from .kinds import KindOptions, KindRules

if TYPE_CHECKING:
    from .._items import AsyncLeasedItem, LeasedItem, _LeasedBase
    from .failures import FailureRules

Handler = Callable[["LeasedItem"], object] | Callable[["AsyncLeasedItem"], Awaitable[object]]
H = TypeVar("H", bound=Handler)
#: For ``executor="process"``: what a child process runs for an item (a picklable
#: function, its positional and keyword arguments).
ChildCall = Callable[["_LeasedBase"], tuple[Callable[..., object], tuple[Any, ...], dict[str, Any]]]


def is_async(handler: Callable[..., Any]) -> bool:
    # An object whose __call__ is async; callable() cannot tell that.
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(getattr(handler, "__call__", None))  # noqa: B004


class Route:
    """A handler and how it runs (a task for ``async def``, a thread otherwise, or a
    child process), with its kind's options (``KindOptions``) if it has any."""

    __slots__ = ("handler", "is_async", "options", "timeout", "time_limit", "in_process", "slots", "rules")

    def __init__(self, handler: Handler, options: KindOptions | None = None, in_process: ChildCall | None = None) -> None:
        if not callable(handler):
            raise TypeError(f"a handler must be callable, not {handler!r}")
        self.handler = handler
        self.is_async = is_async(handler)
        self.options = options
        self.timeout = seconds(options.handler_timeout) if options and options.handler_timeout is not None else None
        self.time_limit = seconds(options.time_limit) if options and options.time_limit is not None else None
        process = options is not None and options.executor == "process"
        if process and (in_process is None or self.is_async):
            raise ValueError(
                "executor='process' runs the sync function of a task (@tasks.task) in a child process: "
                "its arguments cross to the child, a leased item cannot"
            )
        self.in_process = in_process if process else None
        #: Made as the worker starts (on its loop): this kind's own concurrency, and its
        #: retry rules in front of the worker's.
        self.slots: asyncio.Semaphore | None = None
        self.rules: KindRules | None = None

    def start(self, worker_rules: FailureRules) -> None:
        if self.options is not None:
            if self.options.concurrency is not None:
                self.slots = asyncio.Semaphore(self.options.concurrency)
            self.rules = KindRules(self.options, worker_rules)


class Dispatch:
    """The handlers of a worker: ``default`` for every item, or by the item's ``kind``
    (``worker.handler("email")``), ``default`` then taking the kinds not named. An item
    with neither goes to the dead-letter queue."""

    def __init__(self, default: Handler | None) -> None:
        self.default = Route(default) if default is not None else None
        self.by_kind: dict[str, Route] = {}
        self.frozen = False

    def add(self, kind: str, handler: Handler | Route, options: KindOptions | None = None) -> None:
        if self.frozen:
            raise RuntimeError("handlers are registered before the worker runs")
        if not isinstance(kind, str):
            raise TypeError(f"a kind is a string, not {kind!r}")
        if kind in self.by_kind:
            raise ValueError(f"a handler for kind {kind!r} is registered already")
        self.by_kind[kind] = handler if isinstance(handler, Route) else Route(handler, options)

    def route(self, kind: str) -> Route | None:
        return self.by_kind.get(kind, self.default) if self.by_kind else self.default

    def routes(self) -> list[Route]:
        return [*self.by_kind.values(), *([self.default] if self.default is not None else [])]

    def check(self) -> None:
        """Called as the worker starts: from then on the handlers are fixed."""
        if self.default is None and not self.by_kind:
            raise ValueError("the worker has no handler: pass one, or register some with worker.handler(kind)")
        self.frozen = True
