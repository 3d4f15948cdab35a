"""The clean cache across mounts: which durable files' blocks are still in the arenas.

A clean umount writes ``CACHE_DIR/clean.index`` (JSON lines): for each durable file with
cached blocks, its key, size, the local time it became durable, its block list, and a digest
of the cached bytes. The next mount with the same cache dir reads it once (and deletes it, so
a later crash cannot trust slots reused since), keeps the blocks of each file the store still
holds unchanged (same size, not modified after it became durable here), and checks the digest
the first time the file is opened, before any byte is served. RAM blocks are dropped if the
RAM tier is not the one the index was written with (a reboot emptied tmpfs).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from ckptfs.blocks import BlockRef, cached_xxh3, decode_block_list, encode_block_list
from ckptfs.cache.arena import RAM
from ckptfs.cache.cache import Cache
from ckptfs.util import private_files

log = logging.getLogger(__name__)

MTIME_SLACK_S = 2.0  # store mtimes have 1 s resolution; clocks of one machine agree


@dataclass
class CleanEntry:
    key: str
    size: int
    durable_at: float  # local time.time() when the upload completed
    blocks: list[BlockRef | None]
    digest: str  # cached_digest() of the blocks when the index was written

    def unchanged_in_store(self, size: int, mtime: float) -> bool:
        return size == self.size and mtime <= self.durable_at + MTIME_SLACK_S


def cached_digest(cache: Cache, size: int, blocks: list[BlockRef | None]) -> str:
    """xxh3 of the cached blocks (index and bytes), what a remount checks before serving them."""
    return cached_xxh3(cache.view, size, blocks, cache.block_size)


def save(path: Path, cache: Cache, entries: list[CleanEntry]) -> None:
    with open(private_files.new_temp(path), "w") as f:
        f.write(json.dumps({"ram": cache.ram_arena_id}) + "\n")
        for e in entries:
            f.write(
                json.dumps(
                    {
                        "key": e.key,
                        "size": e.size,
                        "durable_at": e.durable_at,
                        "digest": e.digest,
                        "blocks": encode_block_list(e.blocks),
                    }
                )
                + "\n"
            )
        f.flush()
        os.fsync(f.fileno())
    private_files.replace_from_temp(path)


def load(path: Path, cache: Cache, taken: set[BlockRef]) -> dict[str, CleanEntry]:
    """The entries of the last clean umount, their blocks adopted by the cache; the file is gone after."""
    try:
        lines = private_files.read_file(path).decode().splitlines()
    except FileNotFoundError:
        return {}
    finally:
        path.unlink(missing_ok=True)
    entries: dict[str, CleanEntry] = {}
    try:
        same_ram = json.loads(lines[0]).get("ram") == cache.ram_arena_id if lines else False
        for line in lines[1:]:
            rec = json.loads(line)
            blocks = decode_block_list(rec["blocks"])
            if not same_ram and any(b is not None and b[0] == RAM for b in blocks):
                continue  # its RAM blocks are gone (the store still has the file)
            if any(b is not None and (not cache.valid_ref(b) or b in taken) for b in blocks):
                continue
            if any(blocks):
                taken.update(b for b in blocks if b is not None)
                entries[rec["key"]] = CleanEntry(
                    rec["key"], rec["size"], rec["durable_at"], blocks, rec["digest"]
                )
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        log.warning("clean cache index unreadable (%s): starting with an empty cache", exc)
        return {}
    cache.adopt((e.size, e.blocks) for e in entries.values())
    return entries
