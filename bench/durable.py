"""Time to durable: one poller, the same for every target, watching the store itself.

A `Poller` thread starts with the save and asks the store every `interval` seconds which of the
expected keys are there and how large they are. A key counts from the first poll that saw it with
its final size (known up front, or given with `expect` once the save returned); the figure is the
time of the last such poll, from the save's start. Keys are listed per directory in sorted
order, with `StartAfter` past the ones already confirmed, so a poll of 2,000 small files stays cheap.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

POLL_INTERVAL = 0.05
TIMEOUT = 900.0


class S3View:
    """The keys of one bucket: HEAD when a few keys are left, else ListObjectsV2 (a listing can
    lag behind the objects on Swift, a HEAD cannot)."""

    HEAD_AT_MOST = 8

    def __init__(self, client, bucket: str):
        self.client, self.bucket = client, bucket

    def sizes(self, keys: list[str]) -> Iterator[tuple[str, int]]:
        """(key, size) of what exists among `keys` (sorted), and maybe of neighbours."""
        if len(keys) <= self.HEAD_AT_MOST:
            yield from self._heads(keys)
            return
        # One listing per directory, of its direct children only, from its first missing key on:
        # a listing of the whole prefix would go through every file already confirmed in
        # sub-directories sorted after the first missing one (2,000 shards listed every 50 ms
        # while `config.json`, written last but sorted first, is missing), and its parsing in this
        # process would slow the writer measured beside it.
        by_folder: dict[str, list[str]] = {}
        for key in keys:
            by_folder.setdefault(key.rpartition("/")[0], []).append(key)
        for folder, missing in by_folder.items():
            yield from self._list(folder + "/" if folder else "", missing[0])

    def _list(self, prefix: str, first: str) -> Iterator[tuple[str, int]]:
        args = {"Bucket": self.bucket, "Prefix": prefix, "Delimiter": "/"}
        if start_after := _just_before(first):
            args["StartAfter"] = start_after
        while True:
            page = self.client.list_objects_v2(**args)
            for entry in page.get("Contents", ()):
                yield entry["Key"], entry["Size"]
            if not page.get("IsTruncated"):
                return
            args["ContinuationToken"] = page["NextContinuationToken"]

    def _heads(self, keys: list[str]) -> Iterator[tuple[str, int]]:
        from botocore.exceptions import ClientError

        for key in keys:
            try:
                yield key, self.client.head_object(Bucket=self.bucket, Key=key)["ContentLength"]
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") not in ("404", "NoSuchKey", "NotFound"):
                    raise


class DirView:
    """The keys of ckptfs's local store: one file per key under a directory."""

    def __init__(self, root: Path):
        self.root = root

    def sizes(self, keys: list[str]) -> Iterator[tuple[str, int]]:
        for key in keys:
            try:
                yield key, os.stat(self.root / key).st_size
            except FileNotFoundError:
                continue


def _just_before(key: str) -> str:
    """A string that sorts before `key` and after most keys below it (StartAfter is exclusive)."""
    return key[:-1] + chr(ord(key[-1]) - 1) if key and key[-1] > " " else ""


class Poller:
    """Polls `view` from `start` (a time.monotonic() value) until every expected key is whole."""

    def __init__(self, view, expected: dict[str, int | None], start: float, interval: float = POLL_INTERVAL):
        self.view, self.start, self.interval = view, start, interval
        self.expected = dict(expected)
        self.seen: dict[str, tuple[int, float]] = {}  # key -> (size, first poll that saw that size)
        self.done_at: float | None = None
        self.error: BaseException | None = None
        self.cpu = 0.0  # CPU seconds of the poller thread itself, set when it ends (client CPU leaves it out)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="durable-poller", daemon=True)
        self._thread.start()

    def expect(self, sizes: dict[str, int]) -> None:
        """Final sizes of keys that were expected without one."""
        with self._lock:
            self.expected.update(sizes)

    def wait(self, timeout: float = TIMEOUT) -> float:
        """Seconds from the start to durable; raises if the store never got there."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._stop.set()
            missing = sorted(k for k in self.expected if not self._confirmed(k))
            raise TimeoutError(
                f"not durable after {timeout:.0f} s: {len(missing)} keys missing, e.g. {missing[:3]}"
            )
        if self.error is not None:
            raise self.error
        return self.done_at - self.start

    def cancel(self) -> None:
        self._stop.set()

    def _confirmed(self, key: str) -> bool:
        size = self.expected.get(key)
        return size is not None and key in self.seen and self.seen[key][0] == size

    def _run(self) -> None:
        cpu0 = time.thread_time()
        try:
            while not self._stop.is_set():
                with self._lock:
                    pending = sorted(k for k in self.expected if not self._confirmed(k))
                if not pending:
                    self.done_at = max(t for _, t in self.seen.values()) if self.seen else time.monotonic()
                    return
                found = list(self.view.sizes(pending))
                now = time.monotonic()
                with self._lock:
                    self._record(found, now)
                    if all(self._confirmed(k) for k in self.expected):
                        continue
                self._stop.wait(self.interval)
        except BaseException as e:  # noqa: BLE001 -- reported by wait()
            self.error = e
        finally:
            self.cpu = time.thread_time() - cpu0

    def _record(self, found: Iterable[tuple[str, int]], now: float) -> None:
        for key, size in found:
            if key in self.expected and (key not in self.seen or self.seen[key][0] != size):
                self.seen[key] = (size, now)
