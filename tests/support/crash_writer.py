"""The writer of tests/test_crash_torture.py: a training job saving one checkpoint.

    python tests/support/crash_writer.py MOUNTPOINT TRIAL LOG [STOP]

Writes the files of ``plan(TRIAL)`` under MOUNTPOINT, with content that depends only on
(trial, file), then a ``latest`` pointer naming them (written last, as Megatron's
``latest_checkpointed_iteration.txt`` or DCP's ``.metadata``). After each ``close()`` (or
``rename``) returns it appends a line to LOG, which lives outside the mount and is fsynced,
so the test knows which operations the filesystem acknowledged before it was killed (each
line ends with a tab and the time.monotonic() at which it was written):

    ready                      imports done, about to touch the mount
    closed trial-007/x.bin     close() of that path returned (the file is committed)
    renamed trial-007          the temp directory was renamed into place
    done                       everything returned

STOP, ``ENTRY:CHUNK``, makes the writer stop itself (SIGSTOP) in the middle of its writes: with
entry ENTRY's file open, before writing its chunk CHUNK (1 MiB each; a chunk past the end: before
its close; a torch entry: before its save). The test uses it to be sure its kill lands during the
writes; it sends SIGCONT after the kill.

The test SIGKILLs the ckptfs daemon at a random moment; this process then gets ENOTCONN
(or EIO) and exits non-zero, which is expected. The test imports ``plan`` and
``expected_bytes`` from here to know what each file must contain.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

MiB = 1 << 20
# Sizes around the 8 MiB part size (single PUT vs multipart, exact multiples, one byte over).
RAW_SIZES = [
    0,
    1,
    4095,
    64 * 1024 + 3,
    MiB,
    3 * MiB + 17,
    8 * MiB - 1,
    8 * MiB,
    8 * MiB + 1,
    12 * MiB + 5,
    17 * MiB,
]
MAX_TRIAL_BYTES = 40 * MiB
CHUNK = MiB


@dataclass(frozen=True)
class Entry:
    name: str  # base name inside the trial directory
    kind: str  # "raw" or "torch"
    size: int  # raw: exact size; torch: approximate tensor bytes
    index: int


@dataclass(frozen=True)
class Plan:
    trial: int
    entries: tuple[Entry, ...]
    temp_dir: bool  # write into trial-N.tmp/ then rename it to trial-N/ (HF Trainer style)
    replace_latest: bool  # latest.tmp + os.replace instead of writing latest in place

    @property
    def dir(self) -> str:
        return f"trial-{self.trial:03d}"

    @property
    def write_dir(self) -> str:
        return self.dir + ".tmp" if self.temp_dir else self.dir

    def latest_text(self) -> bytes:
        return (self.dir + "\n" + "".join(f"{self.dir}/{e.name}\n" for e in self.entries)).encode()


def plan(trial: int) -> Plan:
    rng = random.Random(f"ckptfs-crash-plan-{trial}")
    entries, total = [], 0
    for index in range(rng.randint(3, 6)):
        if trial % 3 == 0 and index == 1:  # one real torch.save checkpoint every third trial
            size = rng.choice([MiB, 6 * MiB, 10 * MiB])
            entries.append(Entry(f"model-{index:02d}.pt", "torch", size, index))
        else:
            size = rng.choice(RAW_SIZES)
            if total + size > MAX_TRIAL_BYTES:
                size = rng.choice(RAW_SIZES[:5])
            entries.append(Entry(f"shard-{index:02d}.bin", "raw", size, index))
        total += size
    return Plan(trial, tuple(entries), temp_dir=rng.random() < 0.35, replace_latest=trial % 2 == 1)


def raw_bytes(trial: int, entry: Entry) -> bytes:
    return random.Random(f"ckptfs-crash-data-{trial}-{entry.index}").randbytes(entry.size)


def torch_state(trial: int, entry: Entry) -> dict:
    import torch

    gen = torch.Generator().manual_seed(trial * 1000 + entry.index)
    n = entry.size // 4
    return {
        "model": {
            "w": torch.randn(n // 2, generator=gen),
            "b": torch.randn(n // 2, generator=gen).to(torch.bfloat16),
        },
        "optimizer": {"step": trial, "lr": 3e-4},
        "iteration": trial,
    }


def expected_bytes(trial: int, entry: Entry, scratch: Path) -> bytes:
    """What the file must contain. torch.save output depends on the file's base name (the
    archive's root folder) and on nothing else, so saving to a scratch file of the same name
    gives the bytes the writer produced on the mount."""
    if entry.kind == "raw":
        return raw_bytes(trial, entry)
    import torch

    scratch.mkdir(parents=True, exist_ok=True)
    path = scratch / entry.name
    torch.save(torch_state(trial, entry), path)
    data = path.read_bytes()
    path.unlink()
    return data


def _log(fd: int, line: str) -> None:
    os.write(fd, f"{line}\t{time.monotonic():.4f}\n".encode())  # CLOCK_MONOTONIC: the test's clock too
    os.fsync(fd)


def chunks(entry: Entry) -> int:
    """How many writes the writer makes of a raw entry (the stop points are 0..chunks)."""
    return -(-entry.size // CHUNK)


def _stop() -> None:
    os.kill(os.getpid(), signal.SIGSTOP)  # the test kills the daemon, then sends SIGCONT


def _write_raw(path: Path, data: bytes, pace: random.Random, stop_at: int | None = None) -> None:
    with open(path, "wb", buffering=0) as f:
        for i, start in enumerate(range(0, len(data) + CHUNK, CHUNK)):
            if i == stop_at:
                _stop()
            if start >= len(data):
                break
            f.write(data[start : start + CHUNK])
            time.sleep(pace.uniform(0, 0.004))  # a little time for the kill to land mid-file


def main(mountpoint: str, trial: int, log_path: str, stop: str | None = None) -> int:
    p = plan(trial)
    stop_entry, stop_chunk = (int(x) for x in stop.split(":")) if stop else (-1, -1)
    root = Path(mountpoint)
    if any(e.kind == "torch" for e in p.entries):
        import torch  # noqa: F401 - import before "ready": the kill delay counts from there
    pace = random.Random()
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    _log(log, "ready")
    (root / p.write_dir).mkdir(exist_ok=True)
    for entry in p.entries:
        path = root / p.write_dir / entry.name
        if entry.kind == "raw":
            _write_raw(path, raw_bytes(trial, entry), pace, stop_chunk if entry.index == stop_entry else None)
        else:
            import torch

            if entry.index == stop_entry:
                _stop()
            torch.save(torch_state(trial, entry), path)  # opens, writes, closes
        _log(log, f"closed {p.write_dir}/{entry.name}")
        time.sleep(pace.uniform(0, 0.03))
    if p.temp_dir:
        os.rename(root / p.write_dir, root / p.dir)
        _log(log, f"renamed {p.dir}")
    if p.replace_latest:
        _write_raw(root / "latest.tmp", p.latest_text(), pace)
        _log(log, "closed latest.tmp")
        os.replace(root / "latest.tmp", root / "latest")
    else:
        _write_raw(root / "latest", p.latest_text(), pace)
    _log(log, "closed latest")
    _log(log, "done")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else None))
