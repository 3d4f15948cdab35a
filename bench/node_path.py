"""The node scenario: one node's warm data path, ckptfs against the same work on the cache disk.

    scripts/bench --scenarios node [--size MiB] [--runs N]

ckptfs here is a mount of its own on a `file://` store in the work directory (no S3 server: the
scenario runs without Swift), sized as the ckptfs-local target (RAM tier 1.25x --size, at least 1
GiB; disk tier 16x, at least 4 GiB); the floor, "cache-disk", is a directory of the work
directory, so on the filesystem of the mount's cache dir. Nothing drops the page cache: both
sides read warm. Once, untimed: a state dict of fp32 tensors of --size MiB is torch.save'd on the
cache disk and copied into the mount with 8 MiB writes; `ckptfs sync`; then the bench waits
until an open of the file is a passthrough one (the kernel reads the file the writes went into,
or the daemon's passthrough copy of it; where passthrough is off it says so and measures
anyway) and reads both files
once, comparing them (so the cache disk's copy is in the page cache, as the mount's is). Then per
run, cache-disk first and ckptfs second in each pair:

1. warm read: a fresh open, `readinto` of 8 MiB chunks: GiB/s; for ckptfs also the daemon's CPU
   (all threads, /proc/PID/stat) per GiB read, and whether the open was a passthrough one;
2. warm `torch.load` of that file (free memory pre-faulted first, as before every bench load);
3. two writer processes, started before and told to go together, each writing --size/2 MiB into
   a new file of its own with 8 MiB `os.write` calls, then closing it: aggregate GiB/s from the
   first start to the last close;
4. one writer process, --size MiB likewise: GiB/s, and for ckptfs the CPU seconds per GiB
   written of the daemon's trio thread (its main thread, /proc/PID/task/PID/stat) and of its FUSE
   reader threads together (`ckptfs-fuse-N` in /proc/PID/task/*/comm), beside what the single
   pyfuse3 thread cost before ckptfs spoke FUSE itself (BEFORE);
5. `torch.save` of the state dict (held in this process) into a new file, to its close: seconds.

Before each timed load, write and save, 1.5x its bytes of free memory are pre-faulted on both
sides (sysinfo.prefault_free_memory): on this VM the pages a writer gets decide its speed as much
as the filesystem does. Between measurements, untimed: `ckptfs sync`, the files removed, the daemon's idle work (page
cache pushes, passthrough copies) waited for, os.sync(). Ratios to the cache disk are taken in
the same run and their median reported (Figure.paired).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from bench import sysinfo
from bench.figures import Results
from bench.goals import check_node
from bench.mounts import CkptfsMount

GiB = 1 << 30
MiB = 1 << 20
CHUNK = 8 * MiB
CKPTFS, FLOOR = "ckptfs-local", "cache-disk"  # how the two sides are reported
TENSOR_SHAPE = (4096, 1024)  # fp32: 16 MiB each, as make_checkpoint's layers
LOAD_PREFAULT = 1.5  # times the file: free memory touched before each load (sysinfo)
# ... and before each timed write and save: the new pages a writer fills decide its speed as much
# as the filesystem does (warm 4-8 GiB/s, cold 0.6 on this VM, run to run), on both sides alike.
WRITE_PREFAULT = 1.5
SETTLE_TIMEOUT_S = 120
PASSTHROUGH_WAIT_S = 60
SYNC_TIMEOUT_S = 600
FUSE_THREAD = re.compile(r"ckptfs-fuse-\d+")
# What the single pyfuse3 thread cost per GiB written before the FUSE transport (issue 40).
PYFUSE3_WRITE_CPU = 0.62
BEFORE = f"before: {PYFUSE3_WRITE_CPU} CPU s/GiB, pyfuse3, measured at 5471979"
BEFORE_LINE = f"before: {PYFUSE3_WRITE_CPU} (pyfuse3's one thread, 5471979)"  # (on the plots)
CPU_FIGURES = ("node_write_cpu_trio", "node_write_cpu_fuse")  # (beside the pyfuse3 line)

# A writer process: its 8 MiB buffer touched before it says "ready"; then one order a line
# ([path, bytes]) on stdin, and [start, end] on the shared CLOCK_MONOTONIC (time.monotonic is
# system-wide on Linux) or {"error": ...} on stdout.
WRITER = r"""
import json, os, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the bench's to handle: it stops us
chunk = memoryview(bytearray(os.urandom(int(sys.argv[1]))))
print("ready", flush=True)
for line in sys.stdin:
    path, nbytes = json.loads(line)
    try:
        start = time.monotonic()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            for _ in range(nbytes // len(chunk)):
                done = 0
                while done < len(chunk):
                    done += os.write(fd, chunk[done:])
        finally:
            os.close(fd)
        print(json.dumps([start, time.monotonic()]), flush=True)
    except OSError as e:
        print(json.dumps({"error": f"{path}: {e}"}), flush=True)
"""


class Writers:
    """Writer processes started once, each ready with its buffer; `write` tells them to go at once."""

    def __init__(self, n: int):
        self.procs: list[subprocess.Popen] = []
        for _ in range(n):
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", WRITER, str(CHUNK)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        for proc in self.procs:
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"writer process {proc.pid} exited before it was ready")

    def write(self, paths: list[Path], nbytes: int) -> float:
        """Each of the first len(paths) writers writes `nbytes` into its path, all told at once:
        seconds from the first start to the last close."""
        procs = self.procs[: len(paths)]
        for proc, path in zip(procs, paths):
            proc.stdin.write(json.dumps([str(path), nbytes]) + "\n")
            proc.stdin.flush()
        answers = [json.loads(proc.stdout.readline() or '{"error": "writer exited"}') for proc in procs]
        errors = [a["error"] for a in answers if isinstance(a, dict)]
        if errors:
            raise RuntimeError("; ".join(errors))
        return max(end for _, end in answers) - min(start for start, _ in answers)

    def close(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs = []


def fp32_state_dict(size_mib: int, seed: int = 0) -> dict:
    """About `size_mib` MiB of fp32 tensors (16 MiB each), as a model's state dict."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    count = max(1, size_mib * MiB // (TENSOR_SHAPE[0] * TENSOR_SHAPE[1] * 4))
    return {f"layers.{i}.mlp.weight": torch.randn(*TENSOR_SHAPE, generator=gen) for i in range(count)}


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """tid -> (comm, user + system CPU seconds) of every thread of `pid` (/proc/PID/task)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in os.scandir(f"/proc/{pid}/task"):
        try:
            comm = Path(task.path, "comm").read_text().strip()
            fields = Path(task.path, "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):  # (the thread ended meanwhile)
            continue
        out[int(task.name)] = (comm, (int(fields[11]) + int(fields[12])) / tick)
    return out


def fuse_threads_cpu(before: dict, after: dict) -> tuple[float, int]:
    """CPU seconds the FUSE reader threads spent between two `thread_cpu` samples, and how many
    there were (a reader started meanwhile counts from 0)."""
    readers = {tid: cpu for tid, (comm, cpu) in after.items() if FUSE_THREAD.fullmatch(comm)}
    spent = sum(cpu - before.get(tid, ("", 0.0))[1] for tid, cpu in readers.items())
    return spent, len(readers)


def _read(path: Path) -> int:
    buf = bytearray(CHUNK)
    total = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            total += n
    return total


def _same_bytes(a: Path, b: Path) -> bool:
    with open(a, "rb", buffering=0) as fa, open(b, "rb", buffering=0) as fb:
        while True:
            x, y = fa.read(CHUNK), fb.read(CHUNK)
            if x != y:
                return False
            if not x:
                return True


class Node:
    def __init__(self, bench, opts, work: Path, stack: contextlib.ExitStack):
        self.bench, self.results, self.progress = bench, bench.results, bench.progress
        self.runs = opts.runs
        self.size_mib = opts.size
        self.work = work
        self.disk = work / "node-cache-disk"
        size = opts.size * MiB
        store = work / "node-store"
        store.mkdir()
        self.disk.mkdir()
        self.mount = CkptfsMount(
            f"file://{store}",
            work / "node-mnt",
            work / "node-cache",
            max(1024 * MiB, (size * 5 // 4) // MiB * MiB),
            max(4096 * MiB, 16 * size),
        )
        self.writers: Writers | None = None
        self.state: dict | None = None  # the state dict torch.save writes (setup)
        stack.callback(self._cleanup)
        self.meta: dict = {
            "size_mib": opts.size,
            "store": "file:// (a directory of the work dir)",
            "ram_cache_mib": self.mount.ram_cache // MiB,
            "cache_size_mib": self.mount.cache_size // MiB,
            "before_pyfuse3_write_cpu_s_per_gib": PYFUSE3_WRITE_CPU,
            "before": BEFORE,
            "reads": [],
        }

    def _cleanup(self) -> None:
        """On the way out, also after an error or Ctrl-C: the writers, then the mount."""
        for what, fn in (("writer processes", self._close_writers), ("node mount", self.mount.stop)):
            try:
                fn()
            except Exception as e:  # noqa: BLE001 -- keep cleaning up
                print(f"scripts/bench: cleanup: {what}: {e}", file=sys.stderr, flush=True)

    def _close_writers(self) -> None:
        if self.writers is not None:
            self.writers.close()
            self.writers = None

    # -- the daemon, untimed --
    def sync(self) -> None:
        self.mount._ckptfs("sync", str(self.mount.mountpoint), timeout=SYNC_TIMEOUT_S)

    def settle(self, timeout: float = SETTLE_TIMEOUT_S) -> dict:
        """Wait until the daemon has nothing left to do on its own (uploads, page-cache pushes,
        passthrough copies); its last status."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.mount.status()
            idle = (
                not status["pending"]["files"]
                and not status["page_cache_queued_files"]
                and not status["passthrough"].get("queued_files", 0)
            )
            if idle or time.monotonic() > deadline:
                return status
            time.sleep(0.1)

    def passthrough_ready(self, path: Path) -> dict:
        """Wait until an open of `path` (the only file of the mount) is a passthrough one (an open
        of a complete version with no file asks for its copy); say what was found."""
        status = self.settle()
        pt = status["passthrough"]
        if not pt["on"]:
            return {"on": False, "why": pt.get("off_because", "?")}
        deadline = time.monotonic() + PASSTHROUGH_WAIT_S
        while True:
            with open(path, "rb"):
                pass
            after = self.mount.status()["passthrough"]
            if after["opens"] > pt["opens"]:
                return {
                    "on": True,
                    "file": True,
                    "copy": bool(after.get("files")),
                    "writes": after.get("writes"),
                }
            if time.monotonic() > deadline:
                return {"on": True, "file": False}
            pt = after
            self.settle()
            time.sleep(0.2)

    def forget(self, paths: list[Path]) -> None:
        """After a measurement, untimed: what was written made durable, removed, settled."""
        if paths and paths[0].is_relative_to(self.mount.mountpoint):
            self.sync()
        for path in paths:
            path.unlink(missing_ok=True)
        if paths and paths[0].is_relative_to(self.mount.mountpoint):
            self.settle()
        os.sync()

    # -- the scenario --
    def setup(self) -> None:
        import torch

        self.mount.start()
        self.pid = self.mount.pid
        self.writers = Writers(2)
        self.state = fp32_state_dict(self.size_mib)  # (kept: torch.save, each run)
        self.name = "node-model.pt"
        disk_file, mount_file = self.disk / self.name, self.mount.mountpoint / self.name
        torch.save(self.state, disk_file)
        buf = bytearray(CHUNK)
        with open(disk_file, "rb", buffering=0) as src:
            fd = os.open(mount_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                while n := src.readinto(buf):
                    view = memoryview(buf)[:n]
                    while view:
                        view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
        self.nbytes = disk_file.stat().st_size
        self.sync()
        found = self.passthrough_ready(mount_file)
        self.meta["passthrough"] = found
        self.meta["checkpoint_mib"] = self.nbytes / MiB
        if not found["on"]:
            self._note_reads(
                f"passthrough is off on this machine ({found['why']}): reads go through FUSE (page cache or daemon)"
            )
            said = f"passthrough OFF ({found['why']}): measuring anyway"
        elif not found["file"]:
            self._note_reads(
                f"no passthrough file after {PASSTHROUGH_WAIT_S} s: reads go through FUSE (page cache or daemon)"
            )
            said = f"passthrough on, but no passthrough file after {PASSTHROUGH_WAIT_S} s: measuring anyway"
        else:
            said = "passthrough on, the file's passthrough copy made"
        if not _same_bytes(mount_file, disk_file):  # (also: the cache disk's copy into the page cache)
            raise RuntimeError(f"{mount_file} does not read back the bytes of {disk_file}")
        self.progress(
            f"node      {self.nbytes / MiB:.0f} MiB fp32 state dict on {CKPTFS} (file://, daemon pid "
            f"{self.pid}) and {FLOOR}; {said}"
        )

    def _note_reads(self, text: str) -> None:
        for figure in ("node_read", "node_read_cpu", "node_load"):
            self.results.note(figure, CKPTFS, text)

    def run(self, i: int) -> None:
        from bench.targets import load

        r, gib = self.results, self.nbytes / GiB
        roots = {FLOOR: self.disk, CKPTFS: self.mount.mountpoint}
        # Every other run, ckptfs goes first: on this VM a writer measured second ran 0.72-0.87x
        # the first whichever side it was (pages the first one's file had just freed, most likely).
        order = list(roots.items()) if i % 2 == 0 else list(roots.items())[::-1]
        line = {FLOOR: [], CKPTFS: []}
        # 1. warm read
        for name, root in order:
            path = root / self.name
            if name == CKPTFS:
                before, cpu0 = self.mount.status()["passthrough"], sysinfo.cpu_seconds(self.pid)
            start = time.monotonic()
            got = _read(path)
            seconds = time.monotonic() - start
            if got != self.nbytes:
                raise RuntimeError(f"read {got} bytes of {path}, expected {self.nbytes}")
            r.add("node_read", name, gib / seconds)
            text = f"read {gib / seconds:5.2f} GiB/s"
            if name == CKPTFS:
                cpu = sysinfo.cpu_seconds(self.pid) - cpu0
                after = self.mount.status()["passthrough"]
                opens, reads = (
                    after["opens"] - before["opens"],
                    after["daemon_reads"] - before["daemon_reads"],
                )
                self.meta["reads"].append({"run": i + 1, "passthrough_opens": opens, "daemon_reads": reads})
                r.add("node_read_cpu", name, cpu / gib)
                how = (
                    "passthrough"
                    if opens and not reads
                    else f"{reads} READ requests"
                    if reads
                    else "FUSE page cache, no READ request"
                )
                text += f" ({how}; daemon {cpu / gib:.2f} CPU s/GiB)"
            line[name].append(text)
        # 2. warm torch.load
        for name, root in order:
            sysinfo.prefault_free_memory(int(LOAD_PREFAULT * self.nbytes))
            start = time.monotonic()
            state = load(root / self.name)
            seconds = time.monotonic() - start
            del state
            r.add("node_load", name, seconds)
            line[name].append(f"torch.load {seconds:5.2f} s")
        # 3. two writers at once, size/2 each
        each = max(1, self.nbytes // 2 // CHUNK) * CHUNK
        for name, root in order:
            paths = [root / f"node-w2-{i}-{j}.bin" for j in range(2)]
            sysinfo.prefault_free_memory(int(WRITE_PREFAULT * 2 * each))
            seconds = self.writers.write(paths, each)
            r.add("node_write_2", name, 2 * each / GiB / seconds)
            line[name].append(f"2 writers {2 * each / GiB / seconds:5.2f} GiB/s")
            self.forget(paths)
        # 4. one writer, size; the daemon's CPU split by thread
        total = max(1, self.nbytes // CHUNK) * CHUNK
        for name, root in order:
            paths = [root / f"node-w1-{i}.bin"]
            sysinfo.prefault_free_memory(int(WRITE_PREFAULT * total))
            if name == CKPTFS:
                threads0, cpu0 = thread_cpu(self.pid), sysinfo.cpu_seconds(self.pid)
            seconds = self.writers.write(paths, total)
            if name == CKPTFS:
                threads1, cpu = thread_cpu(self.pid), sysinfo.cpu_seconds(self.pid) - cpu0
                trio = threads1[self.pid][1] - threads0[self.pid][1]  # (the main thread: trio's)
            r.add("node_write_1", name, total / GiB / seconds)
            text = f"1 writer {total / GiB / seconds:5.2f} GiB/s"
            if name == CKPTFS:
                written = total / GiB
                fuse, readers = fuse_threads_cpu(threads0, threads1)
                r.add("node_write_cpu_trio", name, trio / written)
                if readers:
                    r.add("node_write_cpu_fuse", name, fuse / written)
                    split = f"FUSE readers ({readers}) {fuse / written:.2f}"
                else:
                    self.meta["no_fuse_threads"] = "no thread of the daemon is named ckptfs-fuse-N"
                    split = "FUSE readers not found by name"
                text += (
                    f" (CPU s/GiB: trio thread {trio / written:.2f}, {split}, daemon "
                    f"{cpu / written:.2f}; {BEFORE})"
                )
            if name == CKPTFS:  # the rest of the daemon's work on it: the upload (file://)
                cpu0 = sysinfo.cpu_seconds(self.pid)
                self.sync()
                upload = (sysinfo.cpu_seconds(self.pid) - cpu0) / written
                r.add("node_upload_cpu", name, upload)
                text += f"; upload after the close {upload:.2f} CPU s/GiB"
            line[name].append(text)
            self.forget(paths)
        # 5. torch.save into a new file
        import torch

        for name, root in order:
            path = root / f"node-save-{i}.pt"
            sysinfo.prefault_free_memory(int(WRITE_PREFAULT * self.nbytes))
            start = time.monotonic()
            torch.save(self.state, path)
            seconds = time.monotonic() - start
            r.add("node_save", name, seconds)
            line[name].append(f"torch.save {seconds:5.2f} s")
            self.forget([path])
        for name in roots:
            self.progress(f"node      {name:17} run {i + 1}/{self.runs}: " + ", ".join(line[name]))
        ratios = [
            f"{fig} {r.values[fig][CKPTFS][-1] / r.values[fig][FLOOR][-1]:.2f}x"
            for fig in ("node_read", "node_load", "node_write_2", "node_write_1", "node_save")
        ]
        self.progress(f"node      {CKPTFS} / {FLOOR} run {i + 1}/{self.runs}: " + ", ".join(ratios))

    def finish(self) -> None:
        self._close_writers()
        self.state = None
        self.meta["daemon_status"] = {
            k: v for k, v in self.mount.status().items() if k in ("passthrough", "written_bytes")
        }
        self.mount.stop()


def measure(bench, opts, work: Path, stack: contextlib.ExitStack) -> None:
    """The node scenario: its own mount and writer processes, `opts.runs` runs; the figures go
    into bench.results, what it found into bench.meta["node"]."""
    node = Node(bench, opts, work, stack)
    node.setup()
    for i in range(opts.runs):
        node.run(i)
    node.finish()
    bench.meta["node"] = node.meta


def report_lines(results: Results, meta: dict) -> list[str]:
    """What the node scenario found, in markdown (also printed under the table)."""
    node = meta.get("node")
    if not node:
        return []
    pt = node.get("passthrough", {})
    if not pt.get("on"):
        passthrough = f"passthrough **off** ({pt.get('why', '?')}): the mount's reads went through FUSE"
    elif not pt.get("file"):
        passthrough = "passthrough on, but the daemon made no passthrough file in time"
    else:
        served = sum(1 for r in node["reads"] if r["passthrough_opens"] and not r["daemon_reads"])
        passthrough = (
            f"passthrough on; {served} of {len(node['reads'])} timed reads served by the kernel alone"
        )
    lines = [
        f"Node scenario (bench/node_path.py): {CKPTFS} is a mount of its own on a `file://` store, "
        f"{FLOOR} a directory on its cache dir's filesystem; a {node.get('checkpoint_mib', 0):.0f} MiB "
        f"fp32 state dict, both read warm; {passthrough}. Its ratios to {FLOOR} are medians of the "
        "ratios within each run.",
    ]
    trio, fuse = results.median("node_write_cpu_trio", CKPTFS), results.median("node_write_cpu_fuse", CKPTFS)
    if trio is not None:
        readers = f", FUSE reader threads {fuse:.2f}, together {trio + fuse:.2f}" if fuse is not None else ""
        missing = f" ({node['no_fuse_threads']})" if "no_fuse_threads" in node else ""
        lines.append(
            f"CPU per GiB written by 1 writer: trio thread {trio:.2f}{readers} CPU s/GiB{missing}; {BEFORE}."
        )
    upload = results.median("node_upload_cpu", CKPTFS)
    if upload is not None:
        lines.append(
            f"CPU per GiB after the close, to durable (the upload to file://): {upload:.2f} CPU s/GiB."
        )
    for goal in check_node(results):
        verdict = {True: "met", False: "**not met**", None: "not measured"}[goal.met]
        lines.append(f"Issue 41 target, {goal.text}: {verdict}, {goal.detail}.")
    return lines
