"""``ckptfs verify STORE_URL|MOUNTPOINT [PATH...]``: read objects back from the store and check
them against the checksums recorded when they were uploaded (``integrity``: the xxh3 in a one-PUT
object's metadata, or its manifest's part list).

Each object ends in one state:

- ``ok``: every part read back matches its recorded checksum;
- ``mismatch``: a part does not match (read twice: a fault on the wire alone does not count);
- ``missing-manifest``: the object names a manifest that is gone (a mount refuses to read it);
- ``missing``: a PATH named on the command line is not in the store;
- ``unverified``: nothing recorded to check against (another tool, an older ckptfs): listed,
  a failure only with ``--strict``;
- ``error``: the store failed to answer for it.

On a STORE_URL the command opens the store itself; on a MOUNTPOINT the mount's daemon runs it
(``verify`` control command: it has the store and its credentials) and streams progress. Reads
run in parallel, at most ``jobs`` parts (of the object's part size) in flight.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass

import trio

from ckptfs.config import VERIFY_JOBS
from ckptfs.errors import NotFound, StoreError
from ckptfs.objects import integrity
from ckptfs.objects.integrity import IntegrityError
from ckptfs.store.base import RESERVED_PREFIX, ObjectInfo, ObjectStore

PROGRESS_S = 0.5
FAILURES = ("mismatch", "missing-manifest", "missing", "error")


@dataclass
class Result:
    key: str
    size: int
    state: str
    detail: str = ""


def failed(results: list[dict], strict: bool) -> list[dict]:
    return [r for r in results if r["state"] in FAILURES or (strict and r["state"] == "unverified")]


# --- the check (in the daemon, or in the CLI's own trio loop) -------------------------------------


def _targets(store: ObjectStore, paths: list[str]) -> list[tuple[str, ObjectInfo | None]]:
    """The objects to verify: every object under each PATH (a key, or a directory prefix), or
    the whole store; a PATH that is neither comes back as (path, None): missing."""
    out: dict[str, ObjectInfo | None] = {}
    for path in [p.strip("/") for p in paths] or [""]:
        found = False
        if path:
            info = store.head(path)
            if info is not None and not path.endswith("/"):
                out[path] = info
                continue
        for info in store.list(path + "/" if path else ""):
            if info.key.endswith("/") or info.key.split("/", 1)[0].startswith(RESERVED_PREFIX):
                found = True
                continue
            out[info.key] = info
            found = True
        if path and not found:
            out[path] = None
    return sorted(out.items())


async def run(
    store: ObjectStore,
    paths: list[str],
    progress: Callable[[dict], Awaitable[None]] | None = None,
    jobs: int = VERIFY_JOBS,
) -> dict:
    """Verify the objects at or under ``paths`` (keys relative to the store; [] for all).
    Returns {"store", "files": [Result as dict], "total_bytes", "seconds"}."""
    started = time.monotonic()
    # Threads of its own: in the daemon the default limiter carries the journal's fsyncs and the
    # cache's copies, which a verify of a whole store must not hold up.
    threads = trio.CapacityLimiter(jobs)
    targets = await trio.to_thread.run_sync(_targets, store, paths, abandon_on_cancel=True, limiter=threads)
    total = sum(info.size for _, info in targets if info is not None)
    state = {"done_bytes": 0, "total_bytes": total, "files": len(targets), "files_done": 0}
    results: list[Result] = []
    parts = trio.Semaphore(jobs)  # part reads in flight, over all objects
    objects = trio.Semaphore(jobs)

    async def one(key: str, info: ObjectInfo | None) -> None:
        try:
            results.append(await _verify(store, key, info, parts, threads, state))
        finally:
            state["files_done"] += 1
            objects.release()

    async with trio.open_nursery() as outer:
        if progress is not None:
            outer.start_soon(_report, progress, state)
        async with trio.open_nursery() as nursery:
            for key, info in targets:
                await objects.acquire()
                nursery.start_soon(one, key, info)
        outer.cancel_scope.cancel()
    if progress is not None:
        await progress(dict(state))
    results.sort(key=lambda r: r.key)
    return {
        "store": store.url,
        "files": [asdict(r) for r in results],
        "total_bytes": total,
        "seconds": round(time.monotonic() - started, 3),
    }


async def _report(progress, state: dict) -> None:
    while True:
        await progress(dict(state))
        await trio.sleep(PROGRESS_S)


async def _verify(
    store: ObjectStore,
    key: str,
    info: ObjectInfo | None,
    parts: trio.Semaphore,
    threads: trio.CapacityLimiter,
    state: dict,
    again: bool = False,
) -> Result:
    if info is None:
        return Result(key, 0, "missing", "not in the store")
    size = info.size
    try:
        # HEAD: a listing carries no user metadata (and the object may have changed since).
        head = await trio.to_thread.run_sync(store.head, key, abandon_on_cancel=True, limiter=threads)
        if head is None:
            state["done_bytes"] += size
            return Result(key, size, "missing", "deleted from the store while verifying")
        if head.size != size:
            state["total_bytes"] += head.size - size
            size = head.size
        try:
            checks = await trio.to_thread.run_sync(
                integrity.load_checksums,
                store,
                head.size,
                head.metadata,
                abandon_on_cancel=True,
                limiter=threads,
            )
        except IntegrityError as exc:
            state["done_bytes"] += size
            return Result(
                key,
                size,
                "missing-manifest" if isinstance(exc, integrity.ManifestMissing) else "mismatch",
                str(exc),
            )
        if not checks.verified:
            state["done_bytes"] += size
            return Result(key, size, "unverified", checks.source)
        bad: list[tuple[int, str]] = []
        async with trio.open_nursery() as nursery:
            layout = checks.layout
            for start in (layout.start(i) for i in range(layout.count(size))):
                await parts.acquire()
                nursery.start_soon(_check_part, store, key, checks, start, parts, threads, state, bad)
        if bad:
            now = await trio.to_thread.run_sync(store.head, key, abandon_on_cancel=True, limiter=threads)
            if not again and now is not None and (now.etag, now.size) != (head.etag, head.size):
                # Replaced while we read it (a mount wrote a new version): check the new one.
                state["total_bytes"] += now.size
                return await _verify(store, key, now, parts, threads, state, again=True)
            more = f" (and {len(bad) - 1} more parts)" if len(bad) > 1 else ""
            return Result(key, size, "mismatch", min(bad)[1] + more)
        return Result(
            key,
            size,
            "ok",
            f"{len(checks.parts)} part{'s' if len(checks.parts) != 1 else ''} ({checks.source})",
        )
    except NotFound:
        return Result(key, size, "missing", "deleted from the store while verifying")
    except StoreError as exc:
        return Result(key, size, "error", str(exc))


async def _check_part(
    store: ObjectStore,
    key: str,
    checks: integrity.Checksums,
    start: int,
    parts: trio.Semaphore,
    threads: trio.CapacityLimiter,
    state: dict,
    bad: list[tuple[int, str]],
) -> None:
    try:
        length = checks.layout.length(checks.layout.index(start), checks.size)

        def read_and_check() -> None:  # (in a thread: decoding and hashing 8 MiB would stall a daemon's loop)
            if checks.compressed:  # the part's frame, decoded (zstd checks the frame, xxh3 the part)
                stored, stored_length, first, last = checks.stored_range(start, length)
                data = checks.decompress(first, last, store.get_range(key, stored, stored_length))
            else:
                data = store.get_range(key, start, length)
            checks.check(start, data)

        for attempt in (1, 2):  # a second read: bytes bent on the wire are not damage in the store
            try:
                await trio.to_thread.run_sync(read_and_check, abandon_on_cancel=True, limiter=threads)
                break
            except IntegrityError as exc:
                if attempt == 2:
                    bad.append((start, str(exc)))
        state["done_bytes"] += length
    finally:
        parts.release()
