"""The replicas scenario: what ``--replicas 1`` costs a save, and how soon the file is safe.

    scripts/bench --scenarios replicas [--runs N] [--replicas-size MiB]

Two ``--cluster`` mounts of one store on the Swift server the bench starts, peers on loopback
(``--peer-addr 127.0.0.1``): node A writes, node B holds A's replica. Each has its own cache
dir, RAM tier (as large as the save scenario's: 1.25x the checkpoint, at least 1 GiB) and
``--shm-dir`` (a private directory under /dev/shm). Every measurement mounts both afresh on an
empty prefix of the bucket ``ckptfs-replicas`` (cold: new node ids, empty caches), waits until
each lists the other as live (and, with ``--replicas 1``, until A's ``peers.holders`` names B),
then times one ``torch.save`` of the checkpoint (``--replicas-size``, default ``--size``: the
save scenario's) into A. Per run, in this order (interleaved, so machine noise hits both):
  - ``replicas-1``: A mounted with ``--cluster --replicas 1`` (default ``--replica-timeout`` 5 s);
  - ``replicas-0``: the same two mounts with ``--replicas 0`` (the baseline);
  - ``boto3``: ``upload_fileobj`` of the same torch.save'd bytes, already in memory, to the same
    Swift (8 MiB parts, 8 in flight): the upload alone, as the save scenario's boto3 baseline.
Figures, each the median of ``--runs``:
  - save stall: torch.save(state, path) until it returns (its close included);
  - time to replicated (``replicas-1`` only): the stall, counted only when the close returned
    with the replica acknowledged: ``user.ckptfs.state`` read right after the close says
    ``replicated`` (or ``durable``) and A's ``peers.local_commits`` stayed 0; else the run is
    reported as not replicated;
  - time to durable: from the save's start until ``ckptfs sync MNT`` (started right after the
    close) returns; the object's size in the store is checked after;
  - after the close: durable minus stall, what the upload still took once the save returned;
  - CPU seconds from the save's start to durable: the bench process (the client: torch.save),
    A's daemon and B's daemon.
Before each save, free memory is pre-faulted (sysinfo.prefault_free_memory, 3x the checkpoint:
both RAM tiers and torch.save's own), as before the loads of the other scenarios.
"""

from __future__ import annotations

import contextlib
import io
import os
import resource
import shutil
import statistics
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench import sysinfo
from bench.figures import FIGURES, Results
from bench.goals import Goal
from bench.mounts import CkptfsMount
from bench.targets import transfer_config

MiB = 1 << 20
BUCKET, KEY = "ckptfs-replicas", "model.pt"
TARGETS = ("replicas-1", "replicas-0", "boto3")
LABELS = {
    "replicas-1": "ckptfs --cluster --replicas 1",
    "replicas-0": "ckptfs --cluster --replicas 0",
    "boto3": "boto3 upload alone",
}
STATE_XATTR = "user.ckptfs.state"
PEER_WAIT_S = 60  # for the two nodes to see each other (and A to stream to B)
SYNC_TIMEOUT_S = 600
CPU_OF = ("client", "writer", "holder", "store")  # the bench, A's daemon, B's daemon, Swift
PREFAULT = 3.0  # times the checkpoint: A's RAM tier, B's, torch.save's own


def _client_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _store_cpu() -> float:
    """CPU seconds so far of the Swift server's processes (the bench's children: Swift's servers
    and their workers, memcached)."""
    import psutil

    total = 0.0
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if any("swift" in part or "memcached" in part for part in proc.cmdline()):
                times = proc.cpu_times()
                total += times.user + times.system
    return total


def _machine() -> tuple[int, int, int]:
    """Jiffies of all CPUs so far from /proc/stat: (total, idle + iowait, niced)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:9]]
    return sum(fields), fields[3] + fields[4], fields[1]


def _busy(before: tuple[int, int, int], after: tuple[int, int, int]) -> tuple[float, float]:
    """(busy, niced) share of the machine's CPUs between two _machine() samples."""
    total = max(1, after[0] - before[0])
    return 1 - (after[1] - before[1]) / total, (after[2] - before[2]) / total


class Scenario:
    def __init__(self, bench, ctx, opts, work: Path, stack: contextlib.ExitStack):
        self.bench, self.ctx, self.opts, self.work = bench, ctx, opts, work
        self.progress = bench.progress
        self.size_mib = opts.replicas_size or opts.size
        self.shm_dirs: list[Path] = []
        self.live: list[CkptfsMount] = []
        stack.callback(self._cleanup)
        self.ram_cache = max(1024 * MiB, (self.size_mib * 5 // 4) * MiB)
        self.cache_size = max(4096 * MiB, 16 * self.size_mib * MiB)
        self.mounts = 0
        self.runs: list[dict] = []  # every measurement, for replicas.json

    def _cleanup(self) -> None:
        while self.live:
            with contextlib.suppress(Exception):
                self.live.pop().stop()
        while self.shm_dirs:
            shutil.rmtree(self.shm_dirs.pop(), ignore_errors=True)

    # -- setup --
    def make_checkpoint(self) -> None:
        import torch

        from tests.support.checkpoints import make_checkpoint

        self.state = make_checkpoint(self.size_mib)
        buf = io.BytesIO()
        torch.save(self.state, buf)
        self.blob = buf  # (what boto3 uploads)
        self.size = buf.tell()
        self.ctx.client().create_bucket(Bucket=BUCKET)
        self.progress(
            f"replicas  checkpoint: {self.size / MiB:.0f} MiB (--replicas-size {self.size_mib}); "
            f"two --cluster mounts on loopback, RAM tier {self.ram_cache // MiB} MiB each"
        )

    def _mount(self, prefix: str, tag: str, extra: tuple[str, ...]) -> CkptfsMount:
        self.mounts += 1
        name = f"replicas-{self.mounts}-{tag}"
        shm = Path("/dev/shm") / f"ckptfs-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        shm.mkdir(mode=0o700)
        self.shm_dirs.append(shm)
        mount = CkptfsMount(
            f"s3://{BUCKET}/{prefix}",
            self.work / f"{name}-mnt",
            self.work / f"{name}-cache",
            self.ram_cache,
            self.cache_size,
            self.ctx.endpoint,
            extra=("--shm-dir", str(shm), "--cluster", "--peer-addr", "127.0.0.1", *extra),
        )
        mount.start()
        self.live.append(mount)
        return mount

    def _wait(self, what: str, ok) -> None:
        deadline = time.monotonic() + PEER_WAIT_S
        while not ok():
            if time.monotonic() > deadline:
                raise RuntimeError(f"replicas: {what} after {PEER_WAIT_S} s")
            time.sleep(0.2)

    # -- one measurement --
    def save(self, replicas: int, i: int) -> dict:
        """Fresh nodes A (writer) and B; one torch.save into A; its sync; both unmounted."""
        import torch

        prefix = f"run-{i}-r{replicas}-{uuid.uuid4().hex[:6]}"
        b = self._mount(prefix, "b", ())
        a = self._mount(prefix, "a", ("--replicas", str(replicas)))
        try:

            def live(m):
                return len((m.status().get("peers") or {}).get("live") or ())

            self._wait("A and B do not see each other", lambda: live(a) >= 1 and live(b) >= 1)
            if replicas:
                self._wait("A streams to no holder", lambda: (a.status().get("peers") or {}).get("holders"))
            sysinfo.prefault_free_memory(int(PREFAULT * self.size))
            path = a.mountpoint / KEY
            cpu0 = (_client_cpu(), sysinfo.cpu_seconds(a.pid), sysinfo.cpu_seconds(b.pid), _store_cpu())
            machine0 = _machine()
            start = time.monotonic()
            torch.save(self.state, path)
            stall = time.monotonic() - start
            busy, niced = _busy(machine0, _machine())
            state = os.getxattr(path, STATE_XATTR).decode()
            saved = path.stat().st_size  # (torch.save names its archive after the file: not blob's size)
            cpu1 = (_client_cpu(), sysinfo.cpu_seconds(a.pid), sysinfo.cpu_seconds(b.pid), _store_cpu())
            a._ckptfs("sync", str(a.mountpoint), timeout=SYNC_TIMEOUT_S)
            durable = time.monotonic() - start
            cpu2 = (_client_cpu(), sysinfo.cpu_seconds(a.pid), sysinfo.cpu_seconds(b.pid), _store_cpu())
            stored = self.ctx.client().head_object(Bucket=BUCKET, Key=f"{prefix}/{KEY}")["ContentLength"]
            peers_a = a.status().get("peers") or {}
            peers_b = b.status().get("peers") or {}
        finally:
            with ThreadPoolExecutor(2) as pool:
                list(pool.map(lambda m: m.stop(), (a, b)))
            for m in (a, b):
                self.live.remove(m)
            while self.shm_dirs:
                shutil.rmtree(self.shm_dirs.pop(), ignore_errors=True)
        if stored != saved:
            raise RuntimeError(f"s3://{BUCKET}/{prefix}/{KEY} holds {stored} bytes, not {saved}")
        replicated = None
        if replicas:
            replicated = state in ("replicated", "durable") and not peers_a.get("local_commits")
        return {
            "target": f"replicas-{replicas}",
            "bytes": saved,
            "stall": stall,
            "durable": durable,
            "after_close": durable - stall,
            "state_after_close": state,
            "machine_busy_in_stall": busy,
            "machine_niced_in_stall": niced,
            "replicated": replicated,
            "cpu_to_close": {k: cpu1[j] - cpu0[j] for j, k in enumerate(CPU_OF)},
            "cpu_to_durable": {k: cpu2[j] - cpu0[j] for j, k in enumerate(CPU_OF)},
            "peers_writer": peers_a,
            "peers_holder": peers_b,
        }

    def upload(self, i: int) -> dict:
        """boto3 upload_fileobj of the torch.save'd bytes already in memory: the upload alone."""
        key = f"run-{i}-boto3/{KEY}"
        self.blob.seek(0)
        cpu0 = (_client_cpu(), _store_cpu())
        start = time.monotonic()
        self.ctx.client().upload_fileobj(self.blob, BUCKET, key, Config=transfer_config())
        seconds = time.monotonic() - start
        cpu = (_client_cpu() - cpu0[0], _store_cpu() - cpu0[1])
        return {"target": "boto3", "upload": seconds, "cpu": {"client": cpu[0], "store": cpu[1]}}

    # -- all of it --
    def run(self) -> None:
        self.make_checkpoint()
        runs = self.bench.runs("replicas", "")
        for i in range(runs):
            for replicas in (1, 0):
                self._record(self.save(replicas, i), i, runs)
            self._record(self.upload(i), i, runs)
        del self.state, self.blob

    def _record(self, r: dict, i: int, runs: int) -> None:
        r["run"] = i
        self.runs.append(r)
        res, t = self.bench.results, r["target"]
        if t == "boto3":
            res.add("replicas_upload", t, r["upload"])
            res.add("replicas_cpu_client", t, r["cpu"]["client"])
            res.add("replicas_cpu_store", t, r["cpu"]["store"])
            self.progress(
                f"replicas  {t:17} run {i + 1}/{runs}: upload alone {r['upload']:6.2f} s; CPU s: client "
                f"{r['cpu']['client']:.1f}, Swift {r['cpu']['store']:.1f}"
            )
            return
        res.add("replicas_stall", t, r["stall"])
        res.add("replicas_durable", t, r["durable"])
        res.add("replicas_after_close", t, r["after_close"])
        if r["replicated"]:
            res.add("replicas_replicated", t, r["stall"])
        cpu = r["cpu_to_durable"]
        res.add("replicas_cpu_client", t, cpu["client"])
        res.add("replicas_cpu_writer", t, cpu["writer"])
        res.add("replicas_cpu_holder", t, cpu["holder"])
        res.add("replicas_cpu_store", t, cpu["store"])
        res.add("replicas_busy", t, 100 * r["machine_busy_in_stall"])
        pa, pb = r["peers_writer"], r["peers_holder"]
        in_stall = ", ".join(f"{r['cpu_to_close'][k]:.1f}" for k in CPU_OF)
        line = (
            f"replicas  {t:17} run {i + 1}/{runs}: stall {r['stall']:6.2f} s, durable {r['durable']:6.2f} s "
            f"(after close {r['after_close']:5.2f} s), state {r['state_after_close']}; CPU s to durable: "
            f"client {cpu['client']:.1f}, writer {cpu['writer']:.1f}, holder {cpu['holder']:.1f}, Swift "
            f"{cpu['store']:.1f} (in the stall: {in_stall}); machine "
            f"busy {r['machine_busy_in_stall']:.0%} in the stall ({r['machine_niced_in_stall']:.0%} niced)"
        )
        if t == "replicas-1":
            line += (
                f"; holders {pa.get('holders')}, replicated {pa.get('replicated_bytes', 0) / MiB:.0f} MiB, "
                f"local commits {pa.get('local_commits')}, holder losses {pa.get('holder_losses')}, holder received "
                f"{pb.get('replica_received_bytes', 0) / MiB:.0f} MiB"
            )
            if not r["replicated"]:
                line += " -- NOT REPLICATED"
        self.progress(line)

    def in_stall(self, target: str) -> str:
        """The medians of the CPU seconds spent in the stall, per process ("" for boto3)."""
        runs = [r["cpu_to_close"] for r in self.runs if r["target"] == target and "cpu_to_close" in r]
        if not runs:
            return ""
        return ", ".join(f"{statistics.median(r[k] for r in runs):.2f}" for k in CPU_OF)

    def not_replicated(self) -> list[str]:
        return [
            f"run {r['run'] + 1}" for r in self.runs if r["target"] == "replicas-1" and not r["replicated"]
        ]


def measure(bench, ctx, opts, work: Path, stack: contextlib.ExitStack) -> Scenario:
    scenario = Scenario(bench, ctx, opts, work, stack)
    scenario.run()
    return scenario


# --- the goal --------------------------------------------------------------------------------

STALL_LIMIT = 1.25


def check(results: Results, not_replicated: list[str], runs: int) -> list[Goal]:
    """The replicated level's bench target: the stall with --replicas 1 <= 1.25x without; and
    every close with --replicas 1 returned with its replica."""
    text = f"save stall with --replicas 1 <= {STALL_LIMIT}x without (two --cluster mounts)"
    one, zero = (
        results.summary("replicas_stall", "replicas-1"),
        results.summary("replicas_stall", "replicas-0"),
    )
    if one is None or zero is None:
        goals = [Goal(text, "not measured", None)]
    else:
        ratio = one.median / zero.median
        pairs = sorted(a / b for a, b in zip(one.runs, zero.runs))
        goals = [
            Goal(
                text,
                f"{ratio:.2f}x ({one.median:.2f} s vs {zero.median:.2f} s; run by run "
                f"{', '.join(f'{p:.2f}x' for p in pairs)})",
                ratio <= STALL_LIMIT,
            )
        ]
    measured = one is not None
    goals.append(
        Goal(
            "every close with --replicas 1 returned replicated (state replicated or durable, 0 local commits)",
            (
                ("not replicated in " + ", ".join(not_replicated))
                if not_replicated
                else (f"all {runs} did" if measured else "not measured")
            ),
            None if not measured else not not_replicated,
        )
    )
    return goals


# --- what it reports: replicas.json, replicas.png, the bench:replicas block of docs/benchmarks.md -

BEGIN, END = "<!-- bench:replicas -->", "<!-- /bench:replicas -->"
COLORS = {"replicas-1": "#d95f02", "replicas-0": "#fdae61", "boto3": "#4c78a8"}
GROUPS = (
    ("replicas_stall", "save stall"),
    ("replicas_replicated", "time to replicated"),
    ("replicas_durable", "time to durable"),
    ("replicas_after_close", "after the close:\ndurable - stall"),
)
CPU = (
    ("replicas_cpu_client", "client"),
    ("replicas_cpu_writer", "writer daemon (A)"),
    ("replicas_cpu_holder", "holder daemon (B)"),
    ("replicas_cpu_store", "Swift server"),
)


def _bars(ax, results: Results, groups, targets, width=0.36) -> None:
    for k, t in enumerate(targets):
        xs, med, lo, hi = [], [], [], []
        for g, (fig, _) in enumerate(groups):
            s = results.summary(fig, t)
            if s is None:
                continue
            xs.append(g + (k - (len(targets) - 1) / 2) * width)
            med.append(s.median)
            lo.append(s.median - s.min)
            hi.append(s.max - s.median)
        if xs:
            bars = ax.bar(xs, med, width, yerr=[lo, hi], capsize=3, color=COLORS[t], label=LABELS[t])
            ax.bar_label(bars, labels=[f"{m:.2f}" for m in med], padding=2, fontsize=7)
    ax.set_xticks(range(len(groups)), [label for _, label in groups], fontsize=8)
    ax.margins(y=0.15)
    ax.set_ylim(bottom=0)


def plot(results: Results, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, cpu) = plt.subplots(1, 2, figsize=(13, 4.6), gridspec_kw={"width_ratios": [3, 2]})
    _bars(ax, results, GROUPS, ("replicas-1", "replicas-0"))
    upload = results.summary("replicas_upload", "boto3")
    if upload is not None:
        ax.axhline(
            upload.median,
            color=COLORS["boto3"],
            linestyle="--",
            linewidth=1,
            label=f"the upload alone (boto3): {upload.median:.2f} s",
        )
    zero = results.median("replicas_stall", "replicas-0")
    if zero is not None:
        ax.plot(
            [-0.45, 0.45],
            [STALL_LIMIT * zero] * 2,
            color=COLORS["replicas-1"],
            linestyle=":",
            linewidth=1.5,
            label=f"goal: stall <= {STALL_LIMIT}x without",
        )
    ax.set_ylabel("s from the save's start (lower is better)", fontsize=8)
    ax.set_title("one torch.save into node A; node B holds A's replica", fontsize=9)
    _bars(cpu, results, CPU, TARGETS, width=0.27)
    cpu.set_ylabel("CPU s, save start to durable", fontsize=8)
    cpu.set_title("CPU (2 cores, shared with Swift)", fontsize=9)
    handles, labels = cpu.get_legend_handles_labels()
    lines, texts = ax.get_legend_handles_labels()
    keep = [(h, t) for h, t in zip(lines, texts) if t not in labels]
    handles, labels = handles + [h for h, _ in keep], labels + [t for _, t in keep]
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    fig.suptitle("--replicas 1 vs --replicas 0 (median of the runs; whiskers: min and max)", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    path = out / "replicas.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _cell(results: Results, figure: str, target: str, unit: str = " s") -> str:
    s = results.summary(figure, target)
    if s is None:
        return ""
    digits = 0 if unit == " %" else 2
    text = f"{s.median:.{digits}f}{unit}"
    if len(s.runs) > 1:
        text += f" ({s.min:.{digits}f}–{s.max:.{digits}f})"
    return f"**{text}**" if target == "replicas-1" else text


def markdown(
    results: Results, goals: list[Goal], meta: dict, scenario: Scenario, png: Path, doc: Path
) -> str:
    from tabulate import tabulate

    from bench import report

    rows = []
    for figure, label in (
        ("replicas_stall", "save stall (torch.save until it returns)"),
        ("replicas_replicated", "time to replicated (the close returned, replica acknowledged)"),
        ("replicas_durable", "time to durable (until `ckptfs sync` returns)"),
        ("replicas_after_close", "after the close: durable - stall"),
        ("replicas_upload", "the upload alone (boto3, bytes in memory)"),
        ("replicas_cpu_client", "CPU s, client (torch.save; boto3: its upload), to durable"),
        ("replicas_cpu_writer", "CPU s, writer daemon (A), to durable"),
        ("replicas_cpu_holder", "CPU s, holder daemon (B), to durable"),
        ("replicas_cpu_store", "CPU s, Swift server, to durable (boto3: its upload)"),
        ("replicas_busy", "machine CPU busy during the stall, % of all cores"),
    ):
        unit = "" if figure.startswith("replicas_cpu") else (" %" if figure == "replicas_busy" else " s")
        cells = [_cell(results, figure, t, unit) for t in TARGETS]
        if any(cells):
            rows.append([label, *cells])
        if figure == "replicas_cpu_store":
            rows.append(
                ["CPU s in the stall: client, writer, holder, Swift", *map(scenario.in_stall, TARGETS)]
            )
    matrix = tabulate(rows, ["", *(LABELS[t] for t in TARGETS)], tablefmt="github", disable_numparse=True)
    runs = scenario.bench.runs("replicas", "")
    states = ", ".join(r["state_after_close"] for r in scenario.runs if r["target"] == "replicas-1")
    lines = [
        BEGIN,
        *report.header(meta),
        f"Checkpoint: {scenario.size / MiB:.0f} MiB (`--replicas-size {scenario.size_mib}`); {runs} "
        f"run{'s' * (runs > 1)}, each on fresh mounts; peers on loopback.",
        "",
        "Medians (min–max).",
        "",
        matrix,
        "",
        *_comparisons(results),
        f"`user.ckptfs.state` right after each close with `--replicas 1`: {states or 'none'}.",
        "",
        "Target of the replicated level:",
        "",
        *(f"- **{report._goal_mark(g)}**: {g.text}: {g.detail}" for g in goals),
        "",
        f"![replicas]({os.path.relpath(png, doc.parent)})",
        END,
    ]
    return "\n".join(lines)


def _comparisons(results: Results) -> list[str]:
    replicated = results.median("replicas_replicated", "replicas-1")
    durable = results.median("replicas_durable", "replicas-1")
    durable0 = results.median("replicas_durable", "replicas-0")
    upload = results.median("replicas_upload", "boto3")
    out = []
    if replicated is not None and upload is not None:
        out.append(
            f"Time to replicated {replicated:.2f} s: {replicated / upload:.2f}x the upload alone "
            f"({upload:.2f} s)"
            + (f", {replicated / durable:.2f}x its own time to durable ({durable:.2f} s)" if durable else "")
            + "."
        )
    if durable is not None and durable0:
        out.append(
            f"Time to durable with `--replicas 1`: {durable / durable0:.2f}x without ({durable0:.2f} s)."
        )
    return [" ".join(out), ""] if out else []


def write(scenario: Scenario, results: Results, goals: list[Goal], meta: dict, out: Path, doc: str) -> None:
    """replicas.json and replicas.png in `out`, and the bench:replicas block of `doc` ('none': not)."""
    from bench import report

    figures = [f for f in FIGURES if f.scenario == "replicas"]
    data = report.to_json(results, goals, meta, figures)
    data["runs"] = scenario.runs
    data["meta"]["replicas"] = {
        "checkpoint_bytes": scenario.size,
        "ram_cache_bytes": scenario.ram_cache,
        "targets": LABELS,
        "peers": "loopback, --peer-addr 127.0.0.1",
        "durable": "from the save's start until `ckptfs sync MNT` returns",
        "upload_alone": "boto3 upload_fileobj of the torch.save'd bytes in memory, 8 MiB parts, 8 in flight",
    }
    report.publish_scenario(
        "replicas",
        data,
        out,
        doc,
        lambda out: plot(results, out),
        lambda png, path: markdown(results, goals, meta, scenario, png, path),
        BEGIN,
        END,
        scenario.progress,
    )


if __name__ == "__main__":
    import sys

    sys.exit(__doc__)
