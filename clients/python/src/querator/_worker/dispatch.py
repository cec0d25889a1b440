"""Which handler an item goes to: one for every item, or one per ``kind``."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from .._items import AsyncLeasedItem, LeasedItem

Handler = Callable[["LeasedItem"], object] | Callable[["AsyncLeasedItem"], Awaitable[object]]
H = TypeVar("H", bound=Handler)


def is_async(handler: Callable[..., Any]) -> bool:
    # An object whose __call__ is async; callable() cannot tell that.
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(getattr(handler, "__call__", None))  # noqa: B004


class Route:
    """A handler and how it runs (a task for ``async def``, a thread otherwise)."""

    __slots__ = ("handler", "is_async")

    def __init__(self, handler: Handler) -> None:
        if not callable(handler):
            raise TypeError(f"a handler must be callable, not {handler!r}")
        self.handler = handler
        self.is_async = is_async(handler)


class Dispatch:
    """The handlers of a worker: ``default`` for every item, or by the item's ``kind``
    (``worker.handler("email")``), ``default`` then taking the kinds not named. An item
    with neither goes to the dead-letter queue."""

    def __init__(self, default: Handler | None) -> None:
        self.default = Route(default) if default is not None else None
        self.by_kind: dict[str, Route] = {}
        self.frozen = False

    def add(self, kind: str, handler: Handler) -> None:
        if self.frozen:
            raise RuntimeError("handlers are registered before the worker runs")
        if not isinstance(kind, str):
            raise TypeError(f"a kind is a string, not {kind!r}")
        if kind in self.by_kind:
            raise ValueError(f"a handler for kind {kind!r} is registered already")
        self.by_kind[kind] = Route(handler)

    def route(self, kind: str) -> Route | None:
        return self.by_kind.get(kind, self.default) if self.by_kind else self.default

    def routes(self) -> list[Route]:
        return [*self.by_kind.values(), *([self.default] if self.default is not None else [])]

    def check(self) -> None:
        """Called as the worker starts: from then on the handlers are fixed."""
        if self.default is None and not self.by_kind:
            raise ValueError("the worker has no handler: pass one, or register some with worker.handler(kind)")
        self.frozen = True
