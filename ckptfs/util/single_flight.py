"""One call per key at a time: whoever asks while it runs waits for it and shares its answer."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable

import trio


class _Flight:
    def __init__(self, default: object):
        self.done = trio.Event()
        self.outcome = default


class SingleFlight:
    """``await flights.run(key, fn)``: runs ``fn()`` unless a call for ``key`` is in flight, in
    which case it waits for that one and returns its outcome (``default`` if it raised or was
    cancelled: the waiters are not failed by the first caller's error)."""

    def __init__(self, default: object = None):
        self.default = default
        self._flights: dict[Hashable, _Flight] = {}

    def __contains__(self, key: Hashable) -> bool:
        return key in self._flights

    async def run(self, key: Hashable, fn: Callable[[], Awaitable[object]]) -> object:
        flight = self._flights.get(key)
        if flight is not None:
            await flight.done.wait()
            return flight.outcome
        flight = self._flights[key] = _Flight(self.default)
        try:
            flight.outcome = await fn()
            return flight.outcome
        finally:
            del self._flights[key]
            flight.done.set()
