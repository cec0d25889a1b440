"""Listings that walk their pages on demand."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Generic, TypeVar

from ._models import Page

T = TypeVar("T")


class Pager(Generic[T]):
    """Iterate a listing item by item; ``pages()`` walks it page by page.

    Pages are fetched only as iteration reaches them, each with its own call.
    """

    def __init__(self, fetch: Callable[[str], Page[T]], page_token: str = "") -> None:
        self._fetch = fetch
        self._first_token = page_token

    def pages(self) -> Iterator[Page[T]]:
        token = self._first_token
        while True:
            page = self._fetch(token)
            yield page
            if not page.next_page_token:
                return
            token = page.next_page_token

    def __iter__(self) -> Iterator[T]:
        for page in self.pages():
            yield from page.items


class AsyncPager(Generic[T]):
    """``async for`` over a listing item by item; ``pages()`` walks it page by page."""

    def __init__(self, fetch: Callable[[str], Awaitable[Page[T]]], page_token: str = "") -> None:
        self._fetch = fetch
        self._first_token = page_token

    async def pages(self) -> AsyncIterator[Page[T]]:
        token = self._first_token
        while True:
            page = await self._fetch(token)
            yield page
            if not page.next_page_token:
                return
            token = page.next_page_token

    async def __aiter__(self) -> AsyncIterator[T]:
        async for page in self.pages():
            for item in page.items:
                yield item

    async def collect(self) -> list[T]:
        """Every item of the listing, in a list."""
        return [item async for item in self]
