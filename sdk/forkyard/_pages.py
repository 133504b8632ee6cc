"""A page of a listing that continues with a cursor."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Page(Generic[T]):
    """Some items of a listing; pass ``next_cursor`` back for the next page (None: this was the last)."""

    items: list[T]
    next_cursor: str | None

    def __iter__(self) -> Iterator[T]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> T:
        return self.items[index]


def every(fetch: Callable[[str | None], Page[T]]) -> Iterator[T]:
    """Every item of a listing: ``fetch(cursor)`` page after page until one has no ``next_cursor``."""
    cursor: str | None = None
    while True:
        page = fetch(cursor)
        yield from page
        if not page.next_cursor:
            return
        cursor = page.next_cursor


async def every_async(fetch: Callable[[str | None], Awaitable[Page[T]]]) -> AsyncIterator[T]:
    """:func:`every` for the async client."""
    cursor: str | None = None
    while True:
        page = await fetch(cursor)
        for item in page:
            yield item
        if not page.next_cursor:
            return
        cursor = page.next_cursor
