"""How the object store is doing, for ``ckptfs status``, from the first failed call on.

Fed from every place that talks to the store: the S3 client reports each HTTP attempt (one
botocore retries counts: an outage shows at once, not when the last retry gives up), the
uploader its failed calls, the fetcher reads that failed (EIO), the namespace lookups the store
did not answer in time. An attempt still unanswered after ``STALL_S`` (a blackholed endpoint
only times out after the client's read timeout) marks the store as not answering too. The
first answer from the store clears the state. Thread-safe: store threads call in.

Messages carry the operation, the key and the reason, never credentials or signatures (the
callers pass reasons, not requests).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from ckptfs.util.stats import EventCounts

log = logging.getLogger(__name__)

STALL_S = 10.0  # an attempt unanswered this long means trouble (a healthy store answers far sooner)
MAX_EVENTS = 20


class StoreHealth:
    def __init__(self, stall_s: float = STALL_S):
        self.stall_s = stall_s
        self._lock = threading.Lock()
        self.events: deque[dict] = deque(maxlen=MAX_EVENTS)  # {"time", "key", "message"}, oldest first
        self.failing_since: float | None = None  # wall time of the first failure since the last answer
        self.last_failure: dict | None = None
        self.reachable: bool | None = None  # what the last failed attempt said about the endpoint
        self._attempts: dict[int, tuple[float, float, str, str]] = {}  # token -> (monotonic, wall, op, key)
        self._next_token = 0
        self.failures = EventCounts()  # by kind (see failure_kind), for the metrics

    # -- reports (any thread) ----------------------------------------------------------------
    def attempt_started(self, op: str, key: str) -> int:
        with self._lock:
            self._next_token += 1
            self._attempts[self._next_token] = (time.monotonic(), time.time(), op, key)
            return self._next_token

    def attempt_ended(self, token: int | None) -> None:
        if token is None:
            return
        with self._lock:
            self._attempts.pop(token, None)

    def failed(self, op: str, key: str, reason: str, reachable: bool | None = None) -> None:
        """A store call (or one attempt of it) failed: the store is in trouble from now on.
        ``reachable``: whether the store answered (with an error) or not at all (refused, reset,
        timed out); None when the caller cannot tell (the state keeps what attempts said)."""
        self.failures.add(failure_kind(op, key, reachable))
        now = time.time()
        event = {"time": now, "key": key, "message": f"{op}: {reason}" if op else reason}
        with self._lock:
            self.events.append(event)
            self.last_failure = event
            if reachable is not None:
                self.reachable = reachable
            first = self.failing_since is None
            if first:
                self.failing_since = now
        if first:
            # (what failed is logged where it failed, once per key and reason)
            log.warning(
                "store trouble: calls fail or go unanswered; data stays in the cache (see 'ckptfs status')"
            )

    def answered(self) -> None:
        """A store call succeeded (or got an answer that is not an error, such as a 404 to a HEAD)."""
        if self.failing_since is None:
            return
        with self._lock:
            since, self.failing_since = self.failing_since, None
            self.reachable = None
        if since is not None:
            log.info("the store answers again (after %.0f s of trouble)", time.time() - since)

    # -- queries -------------------------------------------------------------------------------
    def _stalled(self) -> tuple[float, float, str, str] | None:
        """The oldest attempt unanswered for more than ``stall_s``, if any (call under the lock)."""
        oldest = min(self._attempts.values(), default=None)
        if oldest is not None and time.monotonic() - oldest[0] > self.stall_s:
            return oldest
        return None

    def in_trouble(self) -> bool:
        with self._lock:
            return self.failing_since is not None or self._stalled() is not None

    def trouble_since(self) -> float | None:
        """Wall time the current trouble began (the first failure since the last answer, or the
        start of the oldest stalled attempt); None while the store is fine."""
        with self._lock:
            stalled = self._stalled()
            starts = [t for t in (self.failing_since, stalled[1] if stalled else None) if t is not None]
            return min(starts) if starts else None

    def errors(self) -> list[dict]:
        with self._lock:
            return list(self.events)

    def status(self) -> dict:
        """{"state": "ok" | "unreachable" | "failing" | "not answering", "since", "reason", "waiting_calls"}."""
        with self._lock:
            stalled = self._stalled()
            waiting = len(self._attempts)
            if self.failing_since is not None:
                last = self.last_failure or {}
                reason = last.get("message", "") + (f" ({last['key']})" if last.get("key") else "")
                state = "unreachable" if self.reachable is False else "failing"
                return {
                    "state": state,
                    "since": self.failing_since,
                    "reason": reason,
                    "waiting_calls": waiting,
                }
            if stalled is not None:
                _, wall, op, key = stalled
                return {
                    "state": "not answering",
                    "since": wall,
                    "reason": f"{op} {key}: no answer for {time.time() - wall:.0f} s",
                    "waiting_calls": waiting,
                }
            return {"state": "ok", "since": None, "reason": "", "waiting_calls": waiting}


def failure_kind(op: str, key: str, reachable: bool | None) -> str:
    """What failed, for counting: an S3 HTTP attempt that got no answer ("unreachable") or an
    error answer ("server"); a read that failed with EIO ("read"); an uploader call that will
    be retried ("upload", every store); a lookup the store did not answer ("lookup")."""
    if reachable is not None:
        return "unreachable" if reachable is False and op else "server" if op else "lookup"
    if op == "read":
        return "read"
    return "upload" if key else "lookup"


def describe(state: dict) -> str:
    """One line for people: "ok", or "unreachable since 12:00:01 (35 s ago): upload_part ..."."""
    if not state or state.get("state") in (None, "ok"):
        return "ok"
    since = state.get("since")
    when = ""
    if isinstance(since, (int, float)):
        when = f" since {time.strftime('%H:%M:%S', time.localtime(since))} ({time.time() - since:.0f} s)"
    return f"{state['state']}{when}: {state.get('reason', '')}".rstrip(": ")
