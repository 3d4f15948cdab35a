"""ckptfs/retry.py: the named retry policies, and ``retry.call`` (the first try outside tenacity,
a failure handed to tenacity as its first attempt): what is retried and how many tries.
Waits run on trio's mock clock (instant)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from ckptfs.errors import NotFound, StoreError
from ckptfs.transfer import retry

pytestmark = pytest.mark.unit


def run(policy, fails: list[BaseException], result="ok"):
    """``retry.call`` of a function failing with ``fails`` in turn, then returning ``result``:
    (what call returned or raised, tries, failures reported to on_retry)."""
    tries, reported = [], []

    async def fn():
        tries.append(1)
        if len(tries) <= len(fails):
            raise fails[len(tries) - 1]
        return result

    async def main():
        try:
            return await retry.call(lambda: policy(reported.append), fn)
        except Exception as exc:  # noqa: BLE001
            return exc

    outcome = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return outcome, len(tries), len(reported)


def transient(n: int) -> list[BaseException]:
    return [StoreError(f"glitch {i}", transient=True) for i in range(n)]


def test_a_first_try_that_works_is_the_only_try():
    assert run(retry.reading, []) == ("ok", 1, 0)
    assert run(retry.publishing, []) == ("ok", 1, 0)


def test_reading_retries_transient_errors_up_to_its_attempts():
    assert run(retry.reading, transient(retry.READ_ATTEMPTS - 1)) == (
        "ok",
        retry.READ_ATTEMPTS,
        retry.READ_ATTEMPTS - 1,
    )
    outcome, tries, reported = run(retry.reading, transient(retry.READ_ATTEMPTS))
    assert isinstance(outcome, StoreError) and str(outcome) == f"glitch {retry.READ_ATTEMPTS - 1}"
    assert (tries, reported) == (retry.READ_ATTEMPTS, retry.READ_ATTEMPTS - 1)


@pytest.mark.parametrize("error", [StoreError("denied"), NotFound("gone"), ValueError("bug")])
def test_reading_gives_up_at_once_on_what_retrying_cannot_help(error):
    assert run(retry.reading, [error]) == (error, 1, 0)


def test_reading_asks_again_at_once_for_short_bodies_without_reporting_them():
    class Short(Exception):
        pass

    def policy(on_retry):
        return retry.reading(on_retry, at_once=(Short,))

    async def main():
        started = trio.current_time()
        tries = []

        async def fn():
            tries.append(1)
            if len(tries) < 3:
                raise Short()
            return "ok"

        assert await retry.call(lambda: policy(lambda exc: None), fn) == "ok"
        return len(tries), trio.current_time() - started

    assert trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0)) == (3, 0)


def test_publishing_retries_every_store_error_but_not_found():
    assert run(retry.publishing, transient(3) + [StoreError("denied for now")]) == ("ok", 5, 4)
    error = NotFound("gone")
    assert run(retry.publishing, [error]) == (error, 1, 0)
    outcome, tries, _ = run(lambda on_retry: retry.publishing(on_retry, attempts=5), transient(9))
    assert isinstance(outcome, StoreError) and tries == 5


def test_after_bug_retries_anything_every_interval():
    async def main():
        started, tries = trio.current_time(), []

        async def fn():
            tries.append(trio.current_time() - started)
            if len(tries) < 3:
                raise RuntimeError("bug")
            return "ok"

        assert await retry.call(lambda: retry.AFTER_BUG.retrying(lambda exc: None), fn) == "ok"
        return tries

    interval = retry.AFTER_BUG.interval_s
    assert trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0)) == [0, interval, 2 * interval]


def test_answer_gives_up_after_its_deadline_and_sooner_while_failing():
    gate = __import__("threading").Event()

    async def main(failing):
        try:
            await retry.Deadline(5.0, 0.05).call(gate.wait, failing=failing, limiter=trio.CapacityLimiter(1))
        except TimeoutError as exc:
            return str(exc)

    assert trio.run(main, True) == "the store did not answer in 0.05 s"
    gate.set()
