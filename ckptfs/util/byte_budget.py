"""``ByteBudget``: at most so many bytes taken at once, by trio tasks, in the order they ask."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio


class ByteBudget:
    """Bytes held at once (request bodies, fetched ranges) kept within ``limit``. A taker waits
    until its bytes fit; one larger than the whole limit waits until nothing is taken and then
    goes alone (so it is bounded too: by itself). First come, first served: a large taker is
    not starved by small ones arriving after it."""

    def __init__(self, limit: int):
        self.limit = max(1, limit)
        self.used = 0
        self._order = trio.Lock()  # (trio's Lock is fair: FIFO)
        self._freed = trio.Event()

    @asynccontextmanager
    async def take(self, nbytes: int) -> AsyncIterator[None]:
        async with self._order:
            while self.used and self.used + nbytes > self.limit:
                await self._freed.wait()
            self.used += nbytes
        try:
            yield
        finally:
            self.used -= nbytes
            self._freed.set()
            self._freed = trio.Event()
