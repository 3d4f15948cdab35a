"""Figures the daemon keeps for ``ckptfs status`` and the Prometheus endpoint (daemon/metrics.py).

Plain, bounded, dependency-free recorders: the data path records into them (a few additions
per event); ``status`` and a metrics scrape read them. Thread-safe where store threads record.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import Counter, deque

# Seconds: store requests (an 8 MiB part takes ~0.05-1 s on a healthy store, minutes in an outage).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# Seconds a checkpoint file was open for writing (a shard: ~0.1 s to minutes).
STALL_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
RATE_WINDOW_S = 10


class Histogram:
    """Counts of observations per bucket (upper bounds, as Prometheus's ``le``), and their sum."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self.counts[bisect.bisect_left(self.bounds, value)] += 1
            self.sum += value

    def snapshot(self) -> tuple[list[tuple[float, int]], int, float]:
        """([(upper bound, cumulative count)...] ending with +Inf, count, sum)."""
        with self._lock:
            counts, total = list(self.counts), self.sum
        out, running = [], 0
        for bound, count in zip((*self.bounds, float("inf")), counts):
            running += count
            out.append((bound, running))
        return out, running, total


class RateMeter:
    """Bytes per second over the last ``window`` seconds, kept as one total per second."""

    def __init__(self, window: int = RATE_WINDOW_S):
        self.window = window
        self._seconds: deque[list[int]] = deque(maxlen=window + 1)  # [second, bytes]
        self._lock = threading.Lock()
        self._started = time.monotonic()

    def add(self, nbytes: int) -> None:
        second = int(time.monotonic())
        with self._lock:
            if self._seconds and self._seconds[-1][0] == second:
                self._seconds[-1][1] += nbytes
            else:
                self._seconds.append([second, nbytes])

    def rate(self) -> float:
        now = time.monotonic()
        with self._lock:
            recent = sum(n for second, n in self._seconds if second > now - self.window - 1)
        return recent / max(min(self.window, now - self._started), 1.0)


class EventCounts:
    """Counts by kind (errors, retries), for labelled counters."""

    def __init__(self):
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def add(self, kind: str, n: int = 1) -> None:
        with self._lock:
            self._counts[kind] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())
