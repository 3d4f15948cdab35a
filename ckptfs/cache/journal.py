"""The journal: a durable, append-only log of store operations not yet applied.

Every change the store must learn about (a committed file, a delete, a move, a
new directory) is an ``Op`` with a sequence number, appended as one JSON line
before the change is acknowledged. The uploader applies ops to the store in
sequence order and appends ``done``. On start, replaying the log gives the ops
still pending: the namespace lays them over the store listing, the uploader
applies them again (every op is idempotent). A ``put`` names the cache blocks
holding the file's bytes, so a restarted daemon finds them in the arenas.

Appends go to the page cache (enough to survive the daemon's death); ``sync``
fsyncs for the node-reboot level. A torn last line (crash mid-append) is ignored.
"""

from __future__ import annotations

import errno
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ckptfs.blocks import BlockRef, decode_block_list, encode_block_list
from ckptfs.cache.arena import RAM
from ckptfs.util import private_files

log = logging.getLogger(__name__)

PUT, DELETE, MOVE, MKDIR = "put", "delete", "move", "mkdir"
ATTR = "attr"  # a file's or directory's attributes (mode, uid, gid, mtime) changed: a metadata-only update
COMPACT_AFTER_LINES = 20_000


@dataclass
class Op:
    kind: str
    key: str
    src: str = ""  # MOVE: the key moved from
    size: int = 0  # PUT
    blocks: list[BlockRef | None] = field(default_factory=list)  # PUT
    seq: int = 0
    # PUT of a file whose parts were evicted from the cache once uploaded: the multipart
    # upload holding them ([key, upload_id, journal_id]) and their tokens by block index.
    upload: list[str] | None = None
    parts: dict[int, str] = field(default_factory=dict)
    hashes: dict[int, str] = field(default_factory=dict)  # their xxh3 (for the manifest)
    small: bool = False  # DELETE of an object known to have no manifest (no HEAD needed)
    # PUT over an object whose manifest then goes: its upload id, "?" (HEAD the key first) or ""
    replaces: str = ""
    # PUT, MKDIR, ATTR: the attributes stored with the object (model/tree.py attr_metadata)
    meta: dict[str, str] = field(default_factory=dict)
    # PUT of a file streamed in the grown part layout whose parts past those it shares with the
    # uniform one were evicted (ckptfs/parts.py): it keeps the grown layout. ``parts`` and
    # ``hashes`` are by part index (by block index before grown layouts: the same for uniform ones).
    grown: bool = False
    # An op this node took over from a lost node's replica (cluster/replicas.py): "NODE:SEQ",
    # that node's id and the op's number there (a restart keeps only the rest of the replica).
    origin: str = ""

    def to_record(self) -> dict:
        rec = {"t": "op", "seq": self.seq, "kind": self.kind, "key": self.key}
        if self.kind == MOVE:
            rec["src"] = self.src
        if self.kind == PUT:
            rec["size"] = self.size
            rec["blocks"] = encode_block_list(self.blocks)
            if self.upload:
                rec["upload"] = list(self.upload)
                rec["parts"] = {str(i): token for i, token in self.parts.items()}
                rec["hashes"] = {str(i): h for i, h in self.hashes.items()}
        if self.kind == DELETE and self.small:
            rec["small"] = True
        if self.kind == PUT and self.replaces:
            rec["replaces"] = self.replaces
        if self.meta:
            rec["meta"] = dict(self.meta)
        if self.kind == PUT and self.grown:
            rec["grown"] = True
        if self.origin:
            rec["origin"] = self.origin
        return rec

    @classmethod
    def from_record(cls, rec: dict) -> Op:
        blocks = decode_block_list(rec.get("blocks", []))
        parts = {int(i): token for i, token in rec.get("parts", {}).items()}
        hashes = {int(i): h for i, h in rec.get("hashes", {}).items()}
        return cls(
            rec["kind"],
            rec["key"],
            rec.get("src", ""),
            rec.get("size", 0),
            blocks,
            rec["seq"],
            rec.get("upload"),
            parts,
            hashes,
            bool(rec.get("small", False)),
            rec.get("replaces", ""),
            dict(rec.get("meta", {})),
            bool(rec.get("grown", False)),
            str(rec.get("origin", "")),
        )


# An upload the journal recorded as open: (its journal id, key, upload id; None while it was
# still being created, found again by its key).
OpenUpload = tuple[str, str, str | None]


class Journal:
    def __init__(self, path: Path, ram_arena_id: str, on_amend: Callable[[dict], None] | None = None):
        self.path = path
        # Told of every retarget, cancel and done (the replicas on peers follow them).
        self.on_amend = on_amend
        self.ram_arena_id = ram_arena_id
        self.next_seq = 1
        self.lines = 0
        self.fd = -1

    # -- start-up -------------------------------------------------------------------
    def replay(self) -> tuple[list[Op], list[OpenUpload]]:
        """Pending ops in sequence order, and multipart uploads left open by a dead daemon."""
        ops: dict[int, Op] = {}
        uploads: dict[str, tuple[str, str | None]] = {}
        arena_id = None
        try:
            lines = private_files.read_file(self.path).decode(errors="replace").splitlines()
        except FileNotFoundError:
            lines = []
        for number, line in enumerate(lines, 1):
            try:
                rec = json.loads(line)
                kind = rec["t"]
            except (ValueError, KeyError, TypeError):
                if number == len(lines):
                    log.warning("journal: ignoring a torn last record")
                    continue
                raise
            seq = rec.get("seq", 0)
            self.next_seq = max(self.next_seq, seq + 1)
            if kind == "arena":
                arena_id = rec["ram"]
            elif kind == "op":
                ops[seq] = Op.from_record(rec)
            elif kind == "retarget" and seq in ops:
                ops[seq].key = rec["key"]
            elif kind in ("done", "cancel"):
                ops.pop(seq, None)
            elif kind == "mpu":
                uploads[rec["id"]] = (rec["key"], rec["upload_id"])
            elif kind == "mpu_end":
                uploads.pop(rec["id"], None)
        pending = [ops[s] for s in sorted(ops)]
        if arena_id is not None and arena_id != self.ram_arena_id:
            lost = [op for op in pending if any(b is not None and b[0] == RAM for b in op.blocks)]
            for op in lost:
                log.error(
                    "journal: %s was committed in RAM only and the RAM tier was lost (node reboot): dropped",
                    op.key,
                )
            pending = [op for op in pending if op not in lost]
        for op in pending:  # an upload holding evicted parts of a pending file is still needed
            if op.upload:
                uploads.pop(op.upload[2], None)
        return pending, [(i, k, u) for i, (k, u) in uploads.items()]

    def open(self, pending: list[Op], open_uploads: list[OpenUpload]) -> None:
        """Start a fresh log holding just what replay found unfinished (compaction at start-up)."""
        self._rewrite(pending, open_uploads)

    # -- appends --------------------------------------------------------------------
    def append(self, op: Op) -> Op:
        op.seq = self.next_seq
        self.next_seq += 1
        self._write(op.to_record())
        return op

    def retarget(self, seq: int, key: str) -> None:
        self._amend({"t": "retarget", "seq": seq, "key": key})

    def cancel(self, seq: int) -> None:
        self._amend({"t": "cancel", "seq": seq})

    def done(self, seq: int) -> None:
        self._amend({"t": "done", "seq": seq})

    def _amend(self, rec: dict) -> None:
        self._write(rec)
        if self.on_amend is not None:
            self.on_amend(rec)

    def multipart_started(self, upload_key: str, key: str, upload_id: str | None) -> None:
        # upload_id None: an upload still being created (replay finds it by its key)
        self._write({"t": "mpu", "id": upload_key, "key": key, "upload_id": upload_id})

    def multipart_ended(self, upload_key: str) -> None:
        self._write({"t": "mpu_end", "id": upload_key})

    def should_compact(self) -> bool:
        return self.lines > COMPACT_AFTER_LINES

    def compact(self, pending: list[Op], open_uploads: list[OpenUpload]) -> None:
        self._rewrite(pending, open_uploads)

    def sync(self) -> None:
        os.fsync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    # -- internals --------------------------------------------------------------------
    def _write(self, rec: dict) -> None:
        if self.fd < 0:  # closed at shutdown: nothing may change the record of what is pending
            raise OSError(errno.EBADF, f"journal {self.path} is closed")
        # One write() per record on an O_APPEND fd: a crash leaves at most a torn last line.
        os.write(self.fd, (json.dumps(rec, separators=(",", ":")) + "\n").encode())
        self.lines += 1

    def _rewrite(self, pending: list[Op], open_uploads: list[OpenUpload]) -> None:
        records = [{"t": "arena", "ram": self.ram_arena_id, "seq": self.next_seq - 1}]
        records += [op.to_record() for op in pending]
        records += [{"t": "mpu", "id": i, "key": k, "upload_id": u} for i, k, u in open_uploads]
        with open(private_files.new_temp(self.path), "w") as f:
            f.writelines(json.dumps(r, separators=(",", ":")) + "\n" for r in records)
            f.flush()
            os.fsync(f.fileno())
        private_files.replace_from_temp(self.path)
        self.close()
        self.fd = private_files.open_file(self.path, os.O_WRONLY | os.O_APPEND)
        self.lines = len(records)
