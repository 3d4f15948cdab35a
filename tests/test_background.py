"""Background threads: parallel, lower CPU priority, uncancellable once started (like trio.to_thread)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import trio

from ckptfs.util import background
from ckptfs.util.background import BackgroundThreads
from tests.support.harness import trio_test, wait_until_async

pytestmark = pytest.mark.unit


def test_calls_run_in_parallel_at_a_lower_priority():
    threads = BackgroundThreads(4, "t")
    nices = []

    def job(i):
        nices.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        time.sleep(0.2)
        return i * 2

    async def main():
        out = []

        async def one(i):
            out.append(await threads.run(job, i))

        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(one, i)
        return sorted(out)

    assert trio.run(main) == [i * 2 for i in range(8)]
    assert set(nices) == {background.NICE}
    assert threads._live == 4  # no more threads than asked for


@trio_test
async def test_errors_reach_the_caller_and_idle_threads_end(monkeypatch):
    monkeypatch.setattr(background, "IDLE_EXIT_S", 0.1)
    threads = BackgroundThreads(2, "t")

    def boom():
        raise ValueError("store said no")

    with pytest.raises(ValueError, match="store said no"):
        await threads.run(boom)
    await wait_until_async(lambda: threads._live == 0, 10, "the idle threads to end")
    assert await threads.run(lambda: 5) == 5  # a new thread starts for new work


@trio_test
async def test_a_started_call_finishes_and_a_queued_one_never_runs_after_cancel():
    threads = BackgroundThreads(1, "t")
    ran = []

    def slow():
        time.sleep(0.3)
        ran.append("slow")

    with trio.move_on_after(0.1):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(threads.run, slow)
            await trio.sleep(0.01)
            nursery.start_soon(threads.run, lambda: ran.append("queued"))  # behind slow
    assert ran == ["slow"]  # the cancel waited for the call that had started
    await trio.sleep(0.1)
    assert ran == ["slow"]


@trio_test
async def test_after_abandon_a_cancelled_caller_stops_waiting_for_its_call():
    threads = BackgroundThreads(2, "t")
    release = threading.Event()
    finished = []

    entered = threading.Event()

    def hangs():  # a store call on a dead endpoint
        entered.set()
        release.wait(10)
        finished.append(True)

    with trio.move_on_after(5) as deadline:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(threads.run, hangs)  # already shielded when abandon comes
            await wait_until_async(entered.is_set, 4, "the call to start")
            started = trio.current_time()
            threads.abandon()
            nursery.cancel_scope.cancel()
    assert not deadline.cancelled_caught
    assert trio.current_time() - started < 1
    assert finished == []  # still running, on its own
    with trio.move_on_after(0.2):  # abandoning from the start: a later cancel does not wait either
        await threads.run(hangs)
    release.set()


def test_a_gate_waits_for_uses_in_progress_and_refuses_later_ones():
    gate = background.Gate("the cache")
    inside, log = threading.Event(), []

    def user():
        with gate.use():
            inside.set()
            time.sleep(0.2)
            log.append("copied")

    thread = threading.Thread(target=user)
    thread.start()
    inside.wait(5)
    gate.close()
    assert log == ["copied"]  # close waited for the copy in progress
    with pytest.raises(background.Closed, match="the cache is closed"):
        with gate.use():
            pass
    thread.join()
