"""Opt-in compression of objects (``--compress zstd[:LEVEL]``): the zstd seekable format.

A compressed object is a valid zstd *seekable format* stream (zstd's contrib/seekable_format):
one zstd frame per part (each part compressed on its own, in a store thread), then the seek
table in a skippable frame (magic 0x184D2A5E; per frame its compressed and decompressed size;
a footer with the frame count and the magic 0x8F92EAB1). So any zstd decoder reads it whole
(``zstd -d``; see "byte grouping" below), and a ranged read fetches only the frames it needs.

- Every frame carries zstd's own content checksum (XXH64) and its decompressed size.
- Byte grouping: float tensors compress poorly as they are, much better with the bytes of each
  value grouped by position (all first bytes, then all second bytes...: the exponent bytes end
  up together). Before compressing a part, a few samples of it are compressed as they are and
  grouped by 2 and by 4; the best wins. The choice is recorded per frame in the object's
  manifest (or metadata), never guessed. A grouped frame decodes, with any zstd, to the grouped
  bytes: ckptfs (or ``python -m ckptfs.objects.compression``) un-groups them.
- A part that does not compress (random bytes, already compressed data), or that the
  ``Governor`` says is faster to send as it is, becomes a *raw* frame (zstd raw blocks, built
  here without any compression work): the object never grows by more than ~0.01%.
- S3 wants every part but the last to be at least 5 MiB: a frame smaller than that is followed
  by a skippable frame of padding (counted in its compressed size in the seek table).
- The last part carries the seek table after its frame.
"""

from __future__ import annotations

import os
import struct
import sys
import threading
import time
from dataclasses import replace

import xxhash
import zstandard

from ckptfs.store.base import S3_LIMITS, PartInfo

FORMAT = "zstd-seekable"
FORMAT_META = "ckptfs-format"  # object metadata: FORMAT for a compressed object
SIZE_META = "ckptfs-size"  # object metadata of a compressed one-PUT object: its uncompressed size
FRAMES_META = "ckptfs-frames"  # object metadata of a compressed one-PUT object: "stored:group"
MARKER_KEY = ".ckptfs-compressed"  # exists once any mount stored a compressed object in the bucket
DEFAULT_LEVEL = 1  # (level 3 measured: a lower ratio on weights, for 35% more CPU; docs/benchmarks.md)
MIN_PART = S3_LIMITS.min_part_size  # frames are padded to S3's smallest part (on every store)
WORTH = 0.97  # a compressed frame is kept only if at most this share of the raw bytes (and a
# grouped one only if at most this share of the ungrouped one, on the samples)
SAMPLES, SAMPLE_BYTES = 4, 64 << 10  # what the byte-grouping choice compresses (4 x 64 KiB)
GROUPS = (1, 2, 4)
RAW = 0  # "group" of a raw frame (stored as it is)
ONE_PUT_MIN = 4096  # one-PUT files smaller than this stay plain (nothing to gain)

_FRAME_MAGIC = 0xFD2FB528
_SKIPPABLE_MAGIC = 0x184D2A50  # padding
_SEEK_TABLE_MAGIC = 0x184D2A5E
_SEEKABLE_MAGIC = 0x8F92EAB1
_BLOCK_MAX = 128 << 10
_FOOTER = 9


class CorruptFrame(ValueError):
    """Stored bytes that do not decode to what the seek table and manifest say."""


def parse_spec(text: str) -> int:
    """The zstd level of a ``--compress`` value: ``zstd`` or ``zstd:LEVEL`` (1..19)."""
    name, _, level = text.partition(":")
    if name != "zstd":
        raise ValueError(f"--compress {text!r}: the only method is zstd (zstd or zstd:LEVEL)")
    if not level:
        return DEFAULT_LEVEL
    if not level.isdigit() or not 1 <= int(level) <= 19:
        raise ValueError(f"--compress {text!r}: LEVEL is a whole number from 1 to 19")
    return int(level)


# -- byte grouping ------------------------------------------------------------------------------
def group(data, by: int) -> bytes:
    """The bytes of ``data`` grouped by position in ``by``-byte values (a tail shorter than one
    value stays at the end as it is)."""
    import numpy  # (here: the CLI's start does not pay for numpy)

    if by <= 1:
        return bytes(data)
    n = len(data) // by * by
    values = numpy.frombuffer(data, numpy.uint8, count=n).reshape(-1, by)
    return values.T.tobytes() + bytes(memoryview(data)[n:])


def _planes(data, by: int) -> list[bytes]:
    import numpy  # (here: the CLI's start does not pay for numpy)

    if by <= 1:
        return [bytes(data)]
    values = numpy.frombuffer(data, numpy.uint8, count=len(data) // by * by).reshape(-1, by)
    return [values[:, k].tobytes() for k in range(by)]


def ungroup(data, by: int) -> bytes:
    import numpy  # (here: the CLI's start does not pay for numpy)

    if by <= 1:
        return bytes(data)
    n = len(data) // by * by
    planes = numpy.frombuffer(data, numpy.uint8, count=n).reshape(by, -1)
    out = numpy.empty(len(data), numpy.uint8)
    values = out[:n].reshape(-1, by)
    for k in range(by):  # (plane by plane: 3x faster than copying the transposed view)
        values[:, k] = planes[k]
    out[n:] = numpy.frombuffer(data, numpy.uint8)[n:]
    return out.tobytes()


# -- frames --------------------------------------------------------------------------------------
def raw_frame(data) -> bytes:
    """A zstd frame that stores ``data`` as raw blocks (no compression work; any decoder reads it)."""
    view = memoryview(data)
    # Descriptor: 8-byte content size, single segment (no window descriptor), content checksum.
    out: list[bytes | memoryview] = [struct.pack("<IBQ", _FRAME_MAGIC, 0xE4, len(view))]
    offsets = range(0, len(view), _BLOCK_MAX) if len(view) else [0]
    for offset in offsets:
        chunk = view[offset : offset + _BLOCK_MAX]
        last = offset + _BLOCK_MAX >= len(view)
        out.append((len(chunk) << 3 | int(last)).to_bytes(3, "little"))  # block type 0: raw
        out.append(chunk)
    out.append(struct.pack("<I", xxhash.xxh64_intdigest(view) & 0xFFFFFFFF))
    return b"".join(out)


def padding(length: int) -> bytes:
    """A skippable frame of ``length`` bytes in all (at least 8)."""
    return struct.pack("<II", _SKIPPABLE_MAGIC, length - 8) + bytes(length - 8)


def seek_table(frames: list[tuple[int, int]]) -> bytes:
    """The seek table of frames given as (compressed size, decompressed size), in its skippable frame."""
    entries = b"".join(struct.pack("<II", stored, size) for stored, size in frames)
    footer = struct.pack("<IBI", len(frames), 0, _SEEKABLE_MAGIC)
    return struct.pack("<II", _SEEK_TABLE_MAGIC, len(entries) + _FOOTER) + entries + footer


def parse_seek_table(tail) -> list[tuple[int, int]]:
    """The (compressed, decompressed) sizes of the frames of a stream whose end is ``tail``."""
    tail = bytes(tail)
    if len(tail) < _FOOTER + 8:
        raise CorruptFrame("too short for a seek table")
    count, descriptor, magic = struct.unpack("<IBI", tail[-_FOOTER:])
    if magic != _SEEKABLE_MAGIC:
        raise CorruptFrame("no seek table footer")
    width = 12 if descriptor & 0x80 else 8
    size = count * width + _FOOTER
    if len(tail) < size + 8:
        raise CorruptFrame(f"seek table of {count} frames is cut")
    magic, length = struct.unpack("<II", tail[-size - 8 : -size])
    if magic != _SEEK_TABLE_MAGIC or length != size:
        raise CorruptFrame("seek table frame header is wrong")
    body = tail[-size:-_FOOTER]
    return [struct.unpack_from("<II", body, i * width) for i in range(count)]


def seek_table_length(frames: int) -> int:
    return 8 + 8 * frames + _FOOTER


class Codec:
    """Compresses parts into frames at one zstd level (thread-safe: a compressor per thread)."""

    def __init__(self, level: int = DEFAULT_LEVEL):
        self.level = level
        self._local = threading.local()

    def _compressor(self, level: int) -> zstandard.ZstdCompressor:
        made = getattr(self._local, "compressors", None)
        if made is None:
            made = self._local.compressors = {}
        if level not in made:
            made[level] = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)
        return made[level]

    def choose_group(self, data) -> int:
        """How to group ``data`` (1, 2 or 4), or RAW when no choice compresses a sample enough."""
        view = memoryview(data)
        if len(view) <= SAMPLES * SAMPLE_BYTES:
            samples = [view]
        else:
            step = (len(view) - SAMPLE_BYTES) // (SAMPLES - 1) // 4 * 4
            samples = [view[i * step : i * step + SAMPLE_BYTES] for i in range(SAMPLES)]
        fast = self._compressor(1)
        total = sum(len(s) for s in samples)
        # Each group of a sample on its own, as in a whole part, where each fills many zstd blocks
        # (each with its own entropy tables); a sample grouped in one block would gain nothing.
        sizes = {
            by: sum(len(fast.compress(plane)) for s in samples for plane in _planes(s, by)) for by in GROUPS
        }
        # Grouping must win clearly: an ungrouped frame is one any zstd restores as it was.
        best = min(GROUPS, key=lambda by: (sizes[by] / (1 if by == 1 else WORTH), by))
        return best if sizes[best] <= WORTH * total else RAW

    def encode(self, data, compress: bool = True) -> tuple[bytes, int]:
        """``data`` as one frame, and how it was grouped (RAW: stored as it is)."""
        by = self.choose_group(data) if compress and len(data) else RAW
        if by != RAW:
            frame = self._compressor(self.level).compress(group(data, by))
            if len(frame) <= WORTH * len(data):
                return frame, by
        return raw_frame(data), RAW


def pad_to(frame: bytes, size: int) -> bytes:
    """``frame`` followed by padding up to ``size`` bytes (S3's smallest part), if shorter."""
    if len(frame) >= size:
        return frame
    return frame + padding(max(size - len(frame), 8))


def decode(data, frames: list[tuple[int, int]], sizes: list[int]) -> bytes:
    """The original bytes of consecutive stored frames: ``frames`` as (stored size, group) and
    ``sizes`` their decompressed sizes. Raises CorruptFrame when a frame does not decode to them
    (zstd checks each frame's content checksum)."""
    view = memoryview(data)
    out = []
    offset = 0
    decompressor = zstandard.ZstdDecompressor()
    for (stored, by), size in zip(frames, sizes, strict=True):
        chunk = view[offset : offset + stored]
        offset += stored
        try:
            plain = decompressor.decompress(chunk, max_output_size=size)  # (stops at the padding)
        except zstandard.ZstdError as exc:
            raise CorruptFrame(f"a frame does not decompress: {exc}") from None
        if len(plain) != size:
            raise CorruptFrame(f"a frame decompressed to {len(plain)} bytes, not {size}")
        out.append(ungroup(plain, by))
    return b"".join(out)


# -- part tags -----------------------------------------------------------------------------------
# A compressed part's frame (stored size, group) travels with its xxh3 in PartInfo.xxh3 as
# "xxh3/stored/group", so the journal and the namespace keep it without knowing about it.
def tag(xxh3: str, stored: int, by: int) -> str:
    return f"{xxh3}/{stored}/{by}"


def untag(value: str) -> tuple[str, tuple[int, int] | None]:
    digest, sep, rest = value.partition("/")
    if not sep:
        return value, None
    stored, _, by = rest.partition("/")
    return digest, (int(stored), int(by))


def untag_part(part: PartInfo) -> tuple[PartInfo, tuple[int, int] | None]:
    digest, frame = untag(part.xxh3)
    return replace(part, xxh3=digest), frame


# -- when to compress ------------------------------------------------------------------------------
class Governor:
    """Whether to compress the next part. Every part is, unless the uploader is behind (``behind()``:
    writers wait for cache space, so the save stalls) *and* compression is what holds it back:
    compressing a part costs CPU time (``compress_rate``: bytes per second a thread compresses)
    and saves link time (``upload_rate``: stored bytes per second a part upload moves); when the
    first is larger, the part goes raw, so compression never lengthens a stall. Every PROBE-th
    part is compressed anyway, to keep the estimates current. At most ``slots`` parts are
    compressed at once (half the cores by default): the writer and the FUSE loop keep the rest."""

    PROBE = 8
    ALPHA = 0.3

    def __init__(self, behind=lambda: True, slots: int | None = None):
        self.behind = behind
        self.slots = threading.BoundedSemaphore(slots or max(1, (os.cpu_count() or 2) // 2))
        self._lock = threading.Lock()
        self.compress_rate: float | None = None
        self.upload_rate: float | None = None
        self.saving: float | None = None  # share of the bytes compression saves
        self.parts = 0
        self.raw_parts = 0  # parts sent raw because compressing did not pay

    def should_compress(self) -> bool:
        with self._lock:
            self.parts += 1
            compress_rate, upload_rate, saving = self.compress_rate, self.upload_rate, self.saving
            if compress_rate is None or upload_rate is None or saving is None or self.parts % self.PROBE == 0:
                return True
            if not self.behind():
                return True
            pays = saving * compress_rate >= upload_rate
            if not pays:
                self.raw_parts += 1
            return pays

    def compressed(self, size: int, stored: int, seconds: float) -> None:
        with self._lock:
            self.compress_rate = self._mix(self.compress_rate, size / max(seconds, 1e-6))
            self.saving = self._mix(self.saving, max(0.0, 1 - stored / max(size, 1)))

    def uploaded(self, stored: int, seconds: float) -> None:
        with self._lock:
            self.upload_rate = self._mix(self.upload_rate, stored / max(seconds, 1e-6))

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.ALPHA) * old + self.ALPHA * new


def encode_part(codec: Codec, governor: Governor | None, data) -> tuple[bytes, int]:
    """One part as a frame, compressed if the governor says it pays (and recording the cost)."""
    if governor is None:
        return codec.encode(data)
    if not governor.should_compress():
        return codec.encode(data, compress=False)
    with governor.slots:
        started = time.perf_counter()
        frame, by = codec.encode(data)
    governor.compressed(len(data), len(frame), time.perf_counter() - started)
    return frame, by


def main(argv: list[str]) -> int:
    """``python -m ckptfs.objects.compression FILE``: the original bytes of a compressed object read from
    FILE (e.g. downloaded by hand), to stdout. Each frame's grouping is in the object's manifest
    (``compression.frames``) or metadata (``ckptfs-frames``): pass them as ``--groups 4,4,1``;
    without it every frame is taken as ungrouped (what ``zstd -d`` gives)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m ckptfs.objects.compression")
    parser.add_argument("file")
    parser.add_argument("--groups", default="", help="the group of each frame, comma separated (manifest)")
    args = parser.parse_args(argv)
    try:
        with open(args.file, "rb") as f:
            data = f.read()
        table = parse_seek_table(data)
        groups = [int(g) for g in args.groups.split(",")] if args.groups else [1] * len(table)
        if len(groups) != len(table) or not set(groups) <= {RAW, *GROUPS}:
            raise ValueError(f"--groups needs {len(table)} values, each 0, 1, 2 or 4")
        frames = [(stored, by) for (stored, _), by in zip(table, groups)]
        sys.stdout.buffer.write(decode(data, frames, [size for _, size in table]))
    except (OSError, ValueError) as exc:  # (CorruptFrame is a ValueError)
        print(f"{parser.prog}: {args.file}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
