"""StoreHealth: the store's state for `ckptfs status`, from reports of attempts and calls."""

from __future__ import annotations

import time

import pytest

from ckptfs.store.health import StoreHealth, describe

pytestmark = pytest.mark.unit


def test_failed_attempts_show_at_once_and_the_first_answer_clears_them():
    health = StoreHealth()
    assert health.status()["state"] == "ok" and not health.in_trouble() and describe(health.status()) == "ok"
    health.failed("UploadPart", "a.bin", "cannot reach http://h:9: Connection reset by peer", reachable=False)
    state = health.status()
    assert state["state"] == "unreachable" and health.in_trouble()
    assert state["reason"] == "UploadPart: cannot reach http://h:9: Connection reset by peer (a.bin)"
    assert describe(state).startswith("unreachable since ")
    health.failed("", "a.bin", "put s3://b/a.bin: cannot reach ...")  # the caller cannot tell: state kept
    assert health.status()["state"] == "unreachable"
    health.failed("PutObject", "b.bin", "HTTP 503 SlowDown", reachable=True)  # it answers, with errors
    assert health.status()["state"] == "failing"
    assert [e["key"] for e in health.errors()] == ["a.bin", "a.bin", "b.bin"]
    health.answered()
    assert health.status()["state"] == "ok" and not health.in_trouble()
    assert len(health.errors()) == 3  # the history stays (bounded)


def test_an_attempt_left_unanswered_shows_as_not_answering():
    health = StoreHealth(stall_s=0.2)
    token = health.attempt_started("UploadPart", "big.bin")
    assert health.status()["state"] == "ok"
    time.sleep(0.3)
    state = health.status()
    assert state["state"] == "not answering" and "UploadPart big.bin: no answer for" in state["reason"]
    assert state["waiting_calls"] == 1 and health.in_trouble()
    health.attempt_ended(token)
    assert health.status()["state"] == "ok"


def test_events_are_bounded():
    health = StoreHealth()
    for i in range(100):
        health.failed("GetObject", f"k{i}", "read timeout", reachable=False)
    assert [e["key"] for e in health.errors()] == [f"k{i}" for i in range(80, 100)]
