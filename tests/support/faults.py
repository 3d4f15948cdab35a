"""A fault-injecting ObjectStore wrapper for tests of the layers above the stores.

``FaultyStore(inner)`` passes every call through to a real store (a LocalStore on tmp_path, or
S3Store) and can, per verb (and optionally per key):

- ``fail(verb, times)``: raise ``StoreError(transient=True)`` on the next ``times`` calls;
- ``hold(verb)``: block calls in their worker thread until the returned ``Gate`` is opened
  (``await gate.entered()`` waits, from trio, until a call is being held).

Every call is logged in ``calls`` as ``(verb, key)`` in the order it reached the inner store;
``await store.called(verb)`` waits until such a call has completed. No timing is involved:
the only time limits are hang guards (``HANG_GUARD_S``) that turn a deadlock into a failure.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator

import trio

from ckptfs.errors import StoreError
from ckptfs.store.base import DirListing, ObjectInfo, ObjectStore, PartInfo

HANG_GUARD_S = 60.0


class Gate:
    """Holds store calls until opened (thread side: ``pass_through``; trio side: ``entered``)."""

    def __init__(self, verb: str, key: str | None):
        self.verb, self.key = verb, key
        self._open = threading.Event()
        self._entered = threading.Event()

    def matches(self, verb: str, key: str) -> bool:
        return verb == self.verb and (self.key is None or key == self.key)

    def open(self) -> None:
        self._open.set()

    def pass_through(self) -> None:
        self._entered.set()
        if not self._open.wait(HANG_GUARD_S):
            raise RuntimeError(f"test gate on {self.verb} {self.key!r} was never opened")

    async def entered(self) -> None:
        """Wait until a call is held at this gate."""
        ok = await trio.to_thread.run_sync(self._entered.wait, HANG_GUARD_S)
        assert ok, f"no {self.verb} call for {self.key!r} reached the store"


class FaultyStore(ObjectStore):
    def __init__(self, inner: ObjectStore):
        self.inner = inner
        self.url = inner.url
        self.calls: list[tuple[str, str]] = []
        self.done = Counter()  # completed calls (success or failure) per verb
        self._failures: dict[tuple[str, str | None], int] = {}
        self._gates: list[Gate] = []
        self._lock = threading.Condition()

    # -- configuration -----------------------------------------------------------------
    def fail(self, verb: str, times: int, key: str | None = None) -> None:
        """The next ``times`` calls of ``verb`` (on ``key``, or any key) raise a transient StoreError."""
        with self._lock:
            self._failures[(verb, key)] = times

    def hold(self, verb: str, key: str | None = None) -> Gate:
        gate = Gate(verb, key)
        with self._lock:
            self._gates.append(gate)
        return gate

    def open_all(self) -> None:
        with self._lock:
            for gate in self._gates:
                gate.open()

    def count(self, verb: str, key: str | None = None) -> int:
        with self._lock:
            return sum(1 for v, k in self.calls if v == verb and (key is None or k == key))

    async def called(self, verb: str, n: int = 1, guard_s: float = HANG_GUARD_S) -> None:
        """Wait until ``n`` calls of ``verb`` have completed (fails after ``guard_s``)."""

        def wait() -> bool:
            with self._lock:
                return self._lock.wait_for(lambda: self.done[verb] >= n, guard_s)

        ok = await trio.to_thread.run_sync(wait)
        assert ok, f"fewer than {n} {verb} calls completed"

    # -- the pass-through -----------------------------------------------------------------
    def _call(self, verb: str, key: str, fn, *args):
        with self._lock:
            gates = [g for g in self._gates if g.matches(verb, key)]
        for gate in gates:
            gate.pass_through()
        try:
            with self._lock:
                self.calls.append((verb, key))
                for pattern in ((verb, key), (verb, None)):
                    left = self._failures.get(pattern, 0)
                    if left > 0:
                        self._failures[pattern] = left - 1
                        raise StoreError(f"injected failure of {verb} {key!r}", transient=True)
            return fn(*args)
        finally:
            with self._lock:
                self.done[verb] += 1
                self._lock.notify_all()

    def check(self) -> None:
        return self._call("check", "", self.inner.check)

    def put(self, key: str, data, metadata: dict[str, str] | None = None) -> None:
        return self._call("put", key, self.inner.put, key, data, metadata)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        return self._call("get_range", key, self.inner.get_range, key, start, length)

    def get_range_meta(self, key: str, start: int, length: int) -> tuple[bytes, dict[str, str]]:
        return self._call("get_range", key, self.inner.get_range_meta, key, start, length)

    def head(self, key: str) -> ObjectInfo | None:
        return self._call("head", key, self.inner.head, key)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return iter(self._call("list", prefix, lambda: list(self.inner.list(prefix))))

    def list_dir(self, prefix: str = "", limit: int | None = None) -> DirListing:
        return self._call("list_dir", prefix, self.inner.list_dir, prefix, limit)

    def delete(self, key: str) -> None:
        return self._call("delete", key, self.inner.delete, key)

    def set_metadata(self, key: str, metadata: dict[str, str]) -> None:
        return self._call("set_metadata", key, self.inner.set_metadata, key, metadata)

    def copy(self, src: str, dst: str) -> None:
        return self._call("copy", dst, self.inner.copy, src, dst)

    def create_multipart(self, key: str, metadata: dict[str, str] | None = None) -> str:
        return self._call("create_multipart", key, self.inner.create_multipart, key, metadata)

    def upload_part(self, key: str, upload_id: str, number: int, data) -> PartInfo:
        return self._call("upload_part", key, self.inner.upload_part, key, upload_id, number, data)

    def upload_zero_part(self, key: str, upload_id: str, number: int, length: int) -> PartInfo:
        return self._call(
            "upload_zero_part", key, self.inner.upload_zero_part, key, upload_id, number, length
        )

    def complete_multipart(self, key: str, upload_id: str, parts: list[PartInfo]) -> None:
        return self._call("complete_multipart", key, self.inner.complete_multipart, key, upload_id, parts)

    def abort_multipart(self, key: str, upload_id: str) -> None:
        return self._call("abort_multipart", key, self.inner.abort_multipart, key, upload_id)

    def list_multipart(self, prefix: str = "") -> list[tuple[str, str]]:
        return self._call("list_multipart", prefix, self.inner.list_multipart, prefix)

    def close(self) -> None:
        self.inner.close()
