"""How store calls are retried: the named policies, in one place (tenacity for the retrying).

- ``publishing``: the uploader's calls. Every ``StoreError`` but ``NotFound`` is retried, with
  random exponential backoff (up to 0.2 s x 2^n, at most 30 s), forever: the data waits in the
  cache until the store takes it (``attempts`` bounds cleanup calls, such as a manifest delete).
- ``AFTER_BUG``: the uploader's steps. An unexpected error (a bug, a failing cache read) is
  logged and the step retried every 30 s, forever: it must not stop the uploader nor lose data.
- ``reading``: the fetcher's reads. A reader waits through short glitches, not through an
  outage: transient ``StoreError``s only, ``READ_ATTEMPTS`` tries in all, jittered backoff
  (up to 0.2 s x 2^n, at most 5 s); short bodies are asked again at once.
- ``ANSWER``: listings and lookups for other mounts' files. No retry: one try within a
  deadline (shorter while the store is known to be failing), then the tree answers from what
  it knows; the next use asks again.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import tenacity
import trio

from ckptfs.errors import NotFound, PartsLeftOut, StoreError

READ_ATTEMPTS = 5

T = TypeVar("T")


def _failure(state: tenacity.RetryCallState) -> BaseException:
    """The exception of the attempt ``state`` describes. Only for ``wait`` and ``before_sleep``:
    tenacity calls them once an attempt is over (its outcome is set), and every policy here
    retries only failures (so that outcome is an exception)."""
    outcome = state.outcome
    assert outcome is not None  # set when the attempt ended, before wait/before_sleep run
    exc = outcome.exception()
    assert exc is not None  # only failed attempts are retried (every policy's ``retry``)
    return exc


async def call(retrying: Callable[[], tenacity.AsyncRetrying], fn: Callable[[], Awaitable[T]]) -> T:
    """``await fn()`` under the policy ``retrying()`` makes. The first try runs outside tenacity:
    its async loop costs about 45 us of CPU per try (it inspects every callback each time), paid
    here only once a try has failed; that failure is handed to tenacity as its first attempt, so
    what is retried, how often and after which waits stay the policy's."""
    try:
        return await fn()
    except Exception as exc:  # noqa: BLE001 - the policy decides (re-raised as attempt 1)
        first: list[Exception] = [exc]
    async for attempt in retrying():
        with attempt:
            if first:
                raise first.pop()
            return await fn()
    raise AssertionError("unreachable: tenacity re-raises the last failure")


def publishing(
    on_retry: Callable[[BaseException], None], attempts: int | None = None
) -> tenacity.AsyncRetrying:
    """Retries of an upload's store call; ``on_retry(exc)`` before each wait."""
    return tenacity.AsyncRetrying(
        sleep=trio.sleep,
        retry=tenacity.retry_if_exception(
            # (not NotFound, PartsLeftOut: answers the caller acts on, not failures)
            lambda e: isinstance(e, StoreError) and not isinstance(e, (NotFound, PartsLeftOut))
        ),
        wait=tenacity.wait_random_exponential(multiplier=0.2, max=30),
        stop=tenacity.stop_after_attempt(attempts) if attempts else tenacity.stop_never,
        before_sleep=lambda state: on_retry(_failure(state)),
        reraise=True,
    )


@dataclass
class Every:
    """Retry anything every ``interval_s`` seconds, forever."""

    interval_s: float

    def retrying(self, on_retry: Callable[[BaseException], None]) -> tenacity.AsyncRetrying:
        return tenacity.AsyncRetrying(
            sleep=trio.sleep,
            retry=tenacity.retry_if_exception_type(Exception),
            wait=tenacity.wait_fixed(self.interval_s),
            stop=tenacity.stop_never,
            before_sleep=lambda state: on_retry(_failure(state)),
            reraise=True,
        )


AFTER_BUG = Every(30.0)


def reading(
    on_retry: Callable[[BaseException], None] = lambda exc: None,
    at_once: tuple[type[BaseException], ...] = (),
) -> tenacity.AsyncRetrying:
    """Retries of a read: transient ``StoreError``s with backoff (``on_retry(exc)`` before each
    wait) and ``at_once`` exceptions without a wait; the last failure is raised."""
    backoff = tenacity.wait_random_exponential(multiplier=0.4, max=5)  # uniform(0, min(0.2 x 2^n, 5))

    def wait(state: tenacity.RetryCallState) -> float:
        return 0.0 if isinstance(_failure(state), at_once) else backoff(state)

    def before_sleep(state: tenacity.RetryCallState) -> None:
        exc = _failure(state)
        if not isinstance(exc, at_once):
            on_retry(exc)

    return tenacity.AsyncRetrying(
        sleep=trio.sleep,
        retry=tenacity.retry_if_exception(
            lambda e: (
                isinstance(e, at_once)
                or (isinstance(e, StoreError) and e.transient and not isinstance(e, NotFound))
            )
        ),
        wait=wait,
        stop=tenacity.stop_after_attempt(READ_ATTEMPTS),
        before_sleep=before_sleep,
        reraise=True,
    )


@dataclass
class Deadline:
    """One try, given up (TimeoutError) after ``limit_s`` seconds, ``failing_s`` while the store
    is known to be failing: the thread is left to finish on its own and its answer dropped."""

    limit_s: float
    failing_s: float

    async def call(self, fn, *args, failing: bool, limiter: trio.CapacityLimiter):
        limit = self.failing_s if failing else self.limit_s
        with trio.move_on_after(limit):
            return await trio.to_thread.run_sync(fn, *args, limiter=limiter, abandon_on_cancel=True)
        raise TimeoutError(f"the store did not answer in {limit:g} s")


# How long a readdir or lookup waits for the store before it answers from what it knows (a store
# that does not answer must not hang `ls`).
ANSWER = Deadline(10.0, 0.25)
