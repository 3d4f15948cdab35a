"""Checksums of objects in the store: what a mount checks every fetched byte against.

Every part ckptfs uploads is hashed (xxh3-64) when it is sealed. Where they live:

- A file sent in one PUT (at most one part) carries the xxh3 of its bytes as object metadata
  ``xxh3``: its one "part" is the whole file.
- A multipart object (streamed or not) cannot carry its part list in its metadata: that is fixed
  when the upload is created, before the parts exist. Its part checksums go in a *manifest*, a
  small JSON object ``.ckptfs-manifest/<upload id>`` under the reserved top-level prefix (hidden
  from the mount), PUT before CompleteMultipartUpload: an object that is visible has its
  manifest. The object's metadata says so (``ckptfs-manifest``) and names the upload
  (``ckptfs-upload``), so the manifest is found from any GET or HEAD of the object, and a
  server-side copy (rename) keeps pointing at it.

A reader learns which applies from the metadata of its first GET of the object (no extra
request for a one-PUT file, one GET of the manifest for a multipart one) and then checks each
range it fetches, in whole parts, before a byte enters the cache. An object with neither
(written by another tool or an older ckptfs) is read unchecked and reported as unverified.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field, replace

import xxhash

from ckptfs.objects import compression
from ckptfs.parts import PartLayout
from ckptfs.store.base import RESERVED_PREFIX

MANIFEST_PREFIX = ".ckptfs-manifest/"  # under store.base.RESERVED_PREFIX: never a path on the mount
MANIFEST_META = "ckptfs-manifest"  # object metadata: "xxh3-64" when a manifest was written for it
UPLOAD_META = "ckptfs-upload"  # object metadata: the upload's journal id, which names the manifest
XXH3_META = "xxh3"  # object metadata of a one-PUT file: xxh3-64 of all its bytes
ALGORITHM = "xxh3-64"
# A whole-file checksum alone is checked only for objects this small (the read must fetch it
# whole): larger objects with no part list (an older ckptfs's multipart uploads) read unchecked.
WHOLE_FILE_CHECK_MAX = 64 << 20
MANIFEST_MAX = 4 << 20  # bytes of a manifest read at most (10,000 parts take about 200 KiB)


def part_hash(data) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def manifest_key(upload: str) -> str:
    return MANIFEST_PREFIX + upload


def is_reserved(key: str) -> bool:
    """ckptfs's own objects at the top of a store (manifests, the compression marker, the sweep
    stamp): never a file on a mount."""
    return key.startswith(RESERVED_PREFIX)


class IntegrityError(Exception):
    """Fetched bytes do not match their recorded checksum."""


class ManifestMissing(IntegrityError):
    """The object names a manifest that is not in the store."""


@dataclass(frozen=True)
class Checksums:
    """What a version's bytes are checked against: ``parts[i]`` covers part ``i`` of the layout:
    bytes [i * part_size, (i + 1) * part_size) when ``runs`` is None (every part of one size, as
    every manifest before grown layouts), else the parts of ``PartLayout(runs)``
    (ckptfs/parts.py). ``parts`` empty: nothing recorded (unverified)."""

    size: int
    part_size: int
    parts: list[str] = field(default_factory=list)
    xxh3: str = ""  # the whole file's, where known
    upload: str = ""  # the upload it was recorded for ("" for a one-PUT file)
    source: str = ""  # "metadata", "manifest", or why it is unverified
    # A compressed object (objects/compression.py): per part, its frame's stored size and byte grouping.
    # The part checksums are of the uncompressed bytes either way.
    frames: tuple[tuple[int, int], ...] = ()
    runs: tuple[tuple[int, int], ...] | None = None  # a grown layout's runs (None: uniform)

    @property
    def layout(self) -> PartLayout:
        return PartLayout(self.runs) if self.runs is not None else PartLayout.uniform_of(self.part_size)

    @property
    def compressed(self) -> bool:
        return bool(self.frames)

    def stored_range(self, begin: int, span: int) -> tuple[int, int, int, int]:
        """For whole parts [begin, begin + span) of a compressed object: the stored byte range of
        their frames (offset, length) and the frames' indexes [first, last)."""
        layout = self.layout
        first = layout.index(begin)
        last = layout.index(begin + max(span, 1) - 1) + 1
        offset = sum(stored for stored, _ in self.frames[:first])
        return offset, sum(stored for stored, _ in self.frames[first:last]), first, last

    def decompress(self, first: int, last: int, data: bytes) -> bytes:
        """The uncompressed parts [first, last) from their stored frames ``data`` (IntegrityError
        if a frame does not decode: zstd checks each frame's own checksum)."""
        layout = self.layout
        sizes = [layout.length(i, self.size) for i in range(first, last)]
        try:
            return compression.decode(data, list(self.frames[first:last]), sizes)
        except compression.CorruptFrame as exc:
            raise IntegrityError(f"parts {first + 1}-{last}: {exc}") from None

    @property
    def verified(self) -> bool:
        return bool(self.parts)

    @property
    def version(self) -> str:
        """What names this version of its object across nodes: its upload, or its whole checksum."""
        return self.upload or self.xxh3

    def span(self, start: int, length: int) -> tuple[int, int]:
        """The byte range of whole parts covering [start, start + length)."""
        if not self.verified:
            return start, length
        layout = self.layout
        first, last = layout.index(start), layout.index(start + max(length, 1) - 1)
        begin = layout.start(first)
        return begin, min(layout.start(last) + layout.size(last), self.size) - begin

    def parts_in(self, start: int, length: int) -> list[tuple[int, int, str]] | None:
        """(offset from ``start``, length, xxh3) of each part of [start, start + length) (a
        range of whole parts, as ``span`` gives), what ``check`` compares; None where the
        checksums do not cover it (unverified, or a part past those recorded)."""
        if not self.verified:
            return None
        layout = self.layout
        found: list[tuple[int, int, str]] = []
        offset = 0
        while offset < length:
            index = layout.index(start + offset)
            if index >= len(self.parts):
                return None
            end = min(layout.start(index) + layout.size(index), start + length) - start
            found.append((offset, end - offset, self.parts[index]))
            offset = end
        return found

    def check(self, start: int, data) -> None:
        """Raise IntegrityError unless ``data`` (whole parts from ``start``) matches."""
        if not self.verified:
            return
        view = memoryview(data)
        layout = self.layout
        offset = 0
        while offset < len(view):
            index = layout.index(start + offset)
            end = layout.start(index) + layout.size(index) - start  # the part's end, in ``view``
            piece = view[offset:end]
            got = part_hash(piece)
            if index >= len(self.parts) or got != self.parts[index]:
                raise IntegrityError(
                    f"part {index + 1} (bytes {start + offset}-{start + offset + len(piece) - 1}) "
                    f"has xxh3 {got}, recorded {self.parts[index] if index < len(self.parts) else 'none'}"
                )
            offset = end

    def to_manifest(self) -> bytes:
        record = {
            "format": 1,
            "algorithm": ALGORITHM,
            "size": self.size,
            "part_size": self.part_size,
            "xxh3": self.xxh3,
            "upload": self.upload,
            "parts": self.parts,
        }
        if self.runs is not None:  # (only grown layouts: a uniform one's manifest is as before)
            record["runs"] = [list(run) for run in self.runs]
        if self.frames:
            record["compression"] = {"format": compression.FORMAT, "frames": [list(f) for f in self.frames]}
        return json.dumps(record, separators=(",", ":")).encode()

    @classmethod
    def from_manifest(cls, raw: bytes, size: int) -> Checksums:
        """Parse a manifest; a malformed one, or one for another size, raises IntegrityError."""
        try:
            rec = json.loads(raw)
            parts, part_size = [str(p) for p in rec["parts"]], int(rec["part_size"])
            runs = PartLayout.from_json(rec["runs"]).runs if "runs" in rec else None
            layout = PartLayout(runs) if runs is not None else PartLayout.uniform_of(part_size)
            ok = (
                rec.get("algorithm") == ALGORITHM
                and int(rec["size"]) == size
                and part_size > 0
                and layout.base == part_size
                and len(parts) == layout.count(size)
            )
            frames = _frames(rec.get("compression"), len(parts))
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            raise IntegrityError(f"manifest unreadable or not for an object of {size} bytes")
        return cls(
            size,
            part_size,
            parts,
            str(rec.get("xxh3", "")),
            str(rec.get("upload", "")),
            "manifest",
            frames,
            runs,
        )

    @classmethod
    def unverified(cls, size: int, why: str) -> Checksums:
        return cls(size, size or 1, [], "", "", why)

    @classmethod
    def whole_file(cls, size: int, xxh3: str) -> Checksums:
        return cls(size, max(size, 1), [xxh3], xxh3, "", "metadata")


def _frames(record, parts: int) -> tuple[tuple[int, int], ...]:
    """The frames of a manifest's "compression" record (none: not compressed)."""
    if record is None:
        return ()
    if record.get("format") != compression.FORMAT or len(record["frames"]) != parts:
        raise ValueError("unknown compression")
    return tuple((int(stored), int(by)) for stored, by in record["frames"])


def manifest_size(raw: bytes) -> int:
    """The uncompressed size a manifest records (ValueError if it has none)."""
    try:
        return int(json.loads(raw)["size"])
    except (KeyError, TypeError) as exc:
        raise ValueError("no size in the manifest") from exc


def from_metadata(size: int, metadata: dict[str, str]) -> Checksums | str:
    """The checksums an object's metadata gives, or the manifest upload id to fetch."""
    if metadata.get(MANIFEST_META) == ALGORITHM and metadata.get(UPLOAD_META):
        return metadata[UPLOAD_META]
    if metadata.get(compression.FORMAT_META) == compression.FORMAT and metadata.get(XXH3_META):
        try:  # a compressed one-PUT object: one frame
            stored, by = (int(x) for x in metadata[compression.FRAMES_META].split(":"))
        except (KeyError, ValueError):
            return Checksums.unverified(size, "compressed, but its frame is not recorded")
        return replace(Checksums.whole_file(size, metadata[XXH3_META]), frames=((stored, by),))
    if metadata.get(XXH3_META) and size <= WHOLE_FILE_CHECK_MAX:
        return Checksums.whole_file(size, metadata[XXH3_META])
    if metadata.get(XXH3_META):
        return Checksums.unverified(size, "only a whole-file checksum, too large to check per read")
    return Checksums.unverified(size, "no checksum recorded (not written by this ckptfs version)")


def load_checksums(store, size: int, metadata: dict[str, str]) -> Checksums:
    """What an object (its size and user metadata) is checked against, reading its manifest from
    ``store`` where it has one (blocking). IntegrityError when the manifest it names is missing
    or unreadable; other store errors pass through."""
    from ckptfs.errors import NotFound

    found = from_metadata(size, metadata)
    if isinstance(found, Checksums):
        return found
    mkey = manifest_key(found)
    try:
        raw = store.get_range(mkey, 0, MANIFEST_MAX)
    except NotFound:
        raise ManifestMissing(f"its manifest {mkey} is missing from the store") from None
    return Checksums.from_manifest(raw, size)


# --- orphan manifests -------------------------------------------------------------------------
# A manifest outlives its object when the object is overwritten or deleted behind ckptfs's back
# (another tool, or while the daemon that would have dropped it was down), or when its upload never
# completed. Each mount sweeps them once, in the background, at start (daemon/run.py).
ORPHAN_MIN_AGE_S = 24 * 3600.0  # younger manifests are never collected
ORPHAN_SWEEP_MAX = 1000  # manifests judged per sweep (a random sample; the rest wait for a later sweep)
PROBE_NAME = "checksum-probe-"  # store/s3_client.py's support probe, left behind by a crash
SWEEP_STAMP = ".ckptfs-manifest-sweep"  # its mtime: when a mount last swept (hidden like all .ckptfs-)
SWEEP_EVERY_S = 24 * 3600.0  # a mount sweeps only if no mount did for this long


def sweep_due(store, now: float, every: float = SWEEP_EVERY_S) -> bool:
    """Whether this mount should sweep; if so, stamps the store first so that the other mounts
    starting now (a whole training job's nodes) skip it: about one sweep per ``every``."""
    stamp = store.head(SWEEP_STAMP)
    if stamp is not None and now - stamp.mtime < every:
        return False
    store.put(SWEEP_STAMP, b"", {})
    return True


def _object_sizes(rec: dict) -> set[int]:
    """The sizes a listing may give for the object a manifest record describes: the size it
    records, and for a compressed object also its stored size (every frame, then the seek table):
    a store that is not a LogicalStore, or one that has not seen the bucket's compression marker
    (deleted, or not copied along with the objects), lists that one."""
    sizes = {int(rec["size"])}
    if rec.get("compression") is not None:
        frames = _frames(rec["compression"], len(rec["parts"]))
        sizes.add(sum(stored for stored, _ in frames) + compression.seek_table_length(len(frames)))
    return sizes


def orphan_manifests(
    store, now: float, min_age: float = ORPHAN_MIN_AGE_S, limit: int = ORPHAN_SWEEP_MAX
) -> list[str]:
    """The manifest keys in ``store`` that no object can ever need again (blocking).

    Safe against writers on other mounts: a manifest is PUT just before its upload's
    CompleteMultipartUpload (and again before each later try), so one is an orphan only if

    1. it is older than ``min_age`` (a writer between its PUT and its Complete is not);
    2. no multipart upload still in progress was started before it was written (that upload
       may still complete and name it: kept, whatever its key); listed *before* the objects, so
       an upload completing meanwhile is seen in one list or the other;
    3. no object names its upload: the candidates are the objects of exactly the size it
       records, or for a compressed object its stored size (a rename is a server-side copy that
       keeps size and metadata), each HEADed.
    """
    from ckptfs.errors import NotFound

    old = [info for info in store.list(MANIFEST_PREFIX) if now - info.mtime >= min_age]
    # A random sample: with more than ``limit``, each sweep judges others (live ones stay old).
    old = random.sample(old, min(limit, len(old)))
    if not old:
        return []
    started = store.list_multipart_started()
    orphans: list[str] = []
    sizes: dict[str, set[int]] = {}
    for info in old:
        name = info.key[len(MANIFEST_PREFIX) :]
        if name.startswith(PROBE_NAME):
            orphans.append(info.key)
            continue
        if any(when <= info.mtime for when in started):
            continue
        try:
            rec = json.loads(store.get_range(info.key, 0, MANIFEST_MAX))
            sizes[name] = _object_sizes(rec)
        except NotFound:
            continue
        except (ValueError, KeyError, TypeError, AttributeError):
            continue  # not one of ours to judge: kept
    if not sizes:
        return orphans
    wanted: set[int] = set().union(*sizes.values())
    by_size: dict[int, list[str]] = {}
    for obj in store.list(""):
        if obj.size in wanted and not obj.key.startswith(".ckptfs-") and not obj.key.endswith("/"):
            by_size.setdefault(obj.size, []).append(obj.key)
    named: dict[str, str | None] = {}  # object key -> the upload its metadata names
    for name, candidates in sizes.items():
        live = False
        for key in (k for size in candidates for k in by_size.get(size, [])):
            if key not in named:
                head = store.head(key)
                named[key] = head.metadata.get(UPLOAD_META) if head is not None else None
            if named[key] == name:
                live = True
                break
        if not live:
            orphans.append(manifest_key(name))
    return orphans
