"""The daemon's ``catalog`` control command: the files at or under a path on the mount with their
size, time and state (the ``user.ckptfs.state`` of each), and their recorded checksums if asked.
What `ckptfs ls`, `ckptfs checkpoints` and `ckptfs gc` read on a mountpoint."""

from __future__ import annotations

import trio

from ckptfs.errors import CkptfsError, FsError

CHECKSUM_LOOKUPS = 16  # HEADs (and manifest GETs) in flight for checksums=true
YIELD_EVERY = 2000  # nodes walked between yields to the FUSE loop (a huge tree must not stall it)


async def handle(namespace, request: dict, progress) -> dict:
    path = str(request.get("path") or "")
    parts = [p for p in path.split("/") if p and p != "."]
    await namespace.refresh_paths(["/".join(parts)] if parts else [])  # what other mounts published
    node = namespace.root
    for part in parts:  # the tree, not the kernel: never stat()s through our own mount
        node = node.children.get(part) if node.is_dir else None
        if node is None:
            raise CkptfsError(f"no such file or directory on the mount: {path}")
    entries, files = [], []
    for count, n in enumerate(node.walk(), 1):
        if count % YIELD_EVERY == 0:
            await trio.lowlevel.checkpoint()  # (walk copies each child list: changes meanwhile are safe)
        if n is namespace.root or n.unlinked:
            continue
        entry = {"path": n.key().rstrip("/"), "dir": n.is_dir, "size": n.size(), "mtime": n.mtime_ns / 1e9}
        if not n.is_dir:
            try:
                entry["state"] = namespace.state(n.ino)
            except FsError:
                continue  # forgotten while we yielded
            files.append((n.ino, entry))
        entries.append(entry)
    if request.get("checksums"):
        await _checksums(namespace, files)
    return {"entries": entries}


async def _checksums(namespace, files: list[tuple[int, dict]]) -> None:
    limiter = trio.CapacityLimiter(CHECKSUM_LOOKUPS)

    async def one(ino: int, entry: dict) -> None:
        if entry["state"] != "durable":
            entry["checksum"] = "-"
            return
        async with limiter:
            try:
                verified, xxh3 = await namespace.verification(ino)
            except (FsError, KeyError) as e:  # the store does not answer; or the file went meanwhile
                entry["checksum"] = f"unknown ({e})" if isinstance(e, FsError) else "-"
                return
        entry["checksum"] = describe(verified == "yes", xxh3)

    async with trio.open_nursery() as nursery:
        for ino, entry in files:
            nursery.start_soon(one, ino, entry)


def describe(verified: bool, xxh3: str, parts: int = 0) -> str:
    """How `ckptfs ls` shows a recorded checksum."""
    if not verified:
        return "unverified"
    if xxh3:
        return f"xxh3:{xxh3}"
    return f"xxh3 per part ({parts} parts)" if parts else "xxh3 per part"
