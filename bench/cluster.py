"""The cluster scenario (issue 30): one checkpoint restored by N = 1, 2, 4 nodes.

    scripts/bench --scenarios cluster [--cluster-size MiB] [--cluster-rate RATE] [--cluster-nodes 1,2,4]
                  [--cluster-targets ckptfs-cluster,ckptfs-s3,boto3]

The nodes are network namespaces on this machine (bench/netnodes.py): each reaches the Swift
server through a link of its own capped with tc (``--cluster-rate``, 400mbit by default) and a
forwarder that counts the bytes the store sent it; the links between nodes are not capped. The
checkpoint (``--cluster-size`` MiB of bench/workloads.py's kind, torch.save'd) is written once
through a plain ckptfs mount. Then, for each N, it is restored by N nodes all at once and by N
nodes one after another, each run on a cold cache (fresh mounts, page cache dropped), by:
  - ckptfs-cluster: a ckptfs mount per node with ``--cluster --peer-addr 10.233.0.(10+I)``, its
    daemon in the node's namespace; readers start once every node sees the N-1 others live;
  - ckptfs-s3: a plain ckptfs mount per node (N independent mounts: ckptfs without --cluster);
  - boto3: download_fileobj of the object into memory, in a process in the node's namespace.
A reader is a process of its own (``python -m bench.cluster read ...``): ckptfs readers run here
and torch.load the file from their node's mount (the FUSE mount is seen here; the daemon's
traffic goes through the node's links). Each reader has its imports done before it is told to
go and reports its own start and end (CLOCK_MONOTONIC, one clock for all processes); at once:
from the first start to the last end; one after another: the sum (and mean) of the nodes'
times. Store bytes: what the forwarders relayed from the server to the nodes from the first
mount to the last reader's end, over the checkpoint's size. After the timing, every reader
hashes what it read (ckptfs: the file again; boto3: the downloaded bytes) against the
checkpoint's hash.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import select
import shutil
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

from bench import sysinfo
from bench.figures import FIGURES, Results
from bench.goals import Goal
from bench.mounts import CkptfsMount
from bench.netnodes import Nodes, rate_bytes

MiB = 1 << 20
REPO = Path(__file__).resolve().parent.parent
TARGETS = ("ckptfs-cluster", "ckptfs-s3", "boto3")
LABELS = {"ckptfs-cluster": "ckptfs --cluster", "ckptfs-s3": "ckptfs, N mounts", "boto3": "boto3"}
BUCKET, PREFIX, KEY = "ckptfs-cluster", "restore", "model.pt"
PEER_WAIT_S = 60  # for the nodes of a --cluster run to see each other
READ_WAIT_S = 120  # how long a reader may take beyond 4 times the checkpoint over its link
PART, IN_FLIGHT = 8 * MiB, 8  # boto3's transfer, as bench/targets.py's
LOAD_PREFAULT = 1.5  # bench/workloads.py's, per reader


# --- readers -------------------------------------------------------------------------------


class Reader:
    """A reader process: ``ready`` once imported, then on ``go`` it restores and reports."""

    def __init__(self, argv: list[str], what: str, timeout: float):
        self.what, self.timeout = what, timeout
        self.proc = subprocess.Popen(
            [*argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO
        )

    def _line(self, timeout: float) -> str:
        if not select.select([self.proc.stdout], [], [], timeout)[0]:
            raise RuntimeError(f"{self.what}: no answer in {timeout:.0f} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.what}: exited with status {self.proc.wait()}")
        return line.strip()

    def _say(self, word: str) -> None:
        self.proc.stdin.write(word + "\n")
        self.proc.stdin.flush()

    def ready(self) -> None:
        if (line := self._line(120)) != "ready":
            raise RuntimeError(f"{self.what}: said {line!r}")

    def go(self) -> None:
        self._say("go")

    def times(self) -> tuple[float, float]:
        out = json.loads(self._line(self.timeout))
        return out["start"], out["end"]

    def digest(self) -> str:
        self._say("digest")
        return self._line(300)

    def stop(self) -> None:
        """Its stdin closed, then SIGKILL (ours: Popen's PID) if it has not exited in 10 s. Not
        waited for: one stuck in a hung mount exits only once that mount's daemon is gone."""
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def reap(self) -> None:
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            print(f"  ({self.what}: pid {self.proc.pid} does not exit)", file=sys.stderr, flush=True)


def _read_main(argv: list[str]) -> int:
    """``read torch PATH`` or ``read s3 ENDPOINT BUCKET KEY`` (credentials from AWS_*)."""
    if argv[0] == "torch":
        import torch

        path = argv[1]

        def restore():
            torch.load(path, weights_only=False)

        def digest(_):
            h = hashlib.blake2b()
            with open(path, "rb") as f:
                while chunk := f.read(8 * MiB):
                    h.update(chunk)
            return h.hexdigest()

    else:
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        endpoint, bucket, key = argv[1:4]
        client = boto3.session.Session().client(
            "s3",
            endpoint_url=endpoint,
            config=Config(
                signature_version="s3v4",
                s3={"addressing_style": "path"},
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
                max_pool_connections=2 * IN_FLIGHT,
            ),
        )
        config = TransferConfig(multipart_threshold=PART, multipart_chunksize=PART, max_concurrency=IN_FLIGHT)

        def restore():
            buf = io.BytesIO()
            client.download_fileobj(bucket, key, buf, Config=config)
            return buf

        def digest(buf):
            return hashlib.blake2b(buf.getbuffer()).hexdigest()

    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 1
    start = time.monotonic()
    out = restore()
    end = time.monotonic()
    print(json.dumps({"start": start, "end": end}), flush=True)
    if sys.stdin.readline().strip() == "digest":
        print(digest(out), flush=True)
    return 0


# --- the scenario ----------------------------------------------------------------------------


class Scenario:
    def __init__(self, bench, ctx, opts, work: Path, stack: contextlib.ExitStack):
        self.bench, self.ctx, self.opts, self.work = bench, ctx, opts, work
        self.progress = bench.progress
        self.shm_dirs: list[Path] = []
        stack.callback(self._remove_shm_dirs)
        self.ram_cache = max(1024 * MiB, (opts.cluster_size * 5 // 4) * MiB)
        self.cache_size = max(4096 * MiB, 16 * opts.cluster_size * MiB)
        self.mounts = 0
        self.runs: list[dict] = []  # every measurement, for cluster.json
        server = urlsplit(ctx.endpoint)
        self.nodes = Nodes(max(opts.cluster_nodes), opts.cluster_rate, (server.hostname, server.port))
        stack.callback(self.nodes.stop)

    def _remove_shm_dirs(self) -> None:
        while self.shm_dirs:
            shutil.rmtree(self.shm_dirs.pop(), ignore_errors=True)

    # -- setup --
    def write_checkpoint(self) -> None:
        import torch

        from tests.support.checkpoints import make_checkpoint

        buf = io.BytesIO()
        torch.save(make_checkpoint(self.opts.cluster_size), buf)
        data = buf.getbuffer()
        self.size, self.digest = len(data), hashlib.blake2b(data).hexdigest()
        self.ctx.client().create_bucket(Bucket=BUCKET)
        mount = self._mount(None, self._name("writer"))
        try:
            (mount.mountpoint / KEY).write_bytes(data)
        finally:
            mount.stop()  # (waits for the upload)
        del data, buf
        stored = self.ctx.client().head_object(Bucket=BUCKET, Key=f"{PREFIX}/{KEY}")["ContentLength"]
        if stored != self.size:
            raise RuntimeError(f"s3://{BUCKET}/{PREFIX}/{KEY} holds {stored} bytes, not {self.size}")
        self.progress(
            f"cluster   checkpoint: {self.size / MiB:.0f} MiB torch.save'd through a ckptfs mount "
            f"to s3://{BUCKET}/{PREFIX}/{KEY}"
        )

    def _name(self, tag: str) -> str:
        """A mount's own name (its mountpoint and cache dir under the work dir)."""
        self.mounts += 1
        return f"cluster-{self.mounts}-{tag}"

    def _mount(self, node, name: str, cluster: bool = False) -> CkptfsMount:
        extra, prefix, endpoint = [], [], self.ctx.endpoint
        if node is not None:
            shm = Path("/dev/shm") / f"ckptfs-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            shm.mkdir(mode=0o700)
            self.shm_dirs.append(shm)
            extra = ["--shm-dir", str(shm)]
            if cluster:
                extra += ["--cluster", "--peer-addr", node.peer_ip]
            prefix, endpoint = node.prefix, node.endpoint
        return CkptfsMount(
            f"s3://{BUCKET}/{PREFIX}",
            self.work / f"{name}-mnt",
            self.work / f"{name}-cache",
            self.ram_cache,
            self.cache_size,
            endpoint,
            extra=tuple(extra),
            prefix=tuple(prefix),
        ).start()

    # -- one measurement --
    def restore(self, target: str, n: int, staggered: bool) -> dict:
        """N nodes restore the checkpoint with `target`, all at once or one after another."""
        nodes = self.nodes.nodes[:n]
        served0 = self.nodes.served()
        timeout = READ_WAIT_S + 4 * self.size / rate_bytes(self.opts.cluster_rate)
        mounts: list[CkptfsMount] = []
        readers: list[Reader] = []
        try:
            if target == "boto3":
                for node in nodes:
                    argv = [*node.prefix, sys.executable, "-m", "bench.cluster", "read", "s3"]
                    readers.append(
                        Reader(
                            [*argv, node.endpoint, BUCKET, f"{PREFIX}/{KEY}"],
                            f"boto3 on {node.name}",
                            timeout,
                        )
                    )
            else:
                cluster = target == "ckptfs-cluster"
                with ThreadPoolExecutor(n) as pool:
                    names = [self._name(node.name) for node in nodes]
                    futures = [pool.submit(self._mount, *job, cluster) for job in zip(nodes, names)]
                    for future in futures:  # (every mount made is kept, to be stopped below)
                        with contextlib.suppress(Exception):
                            mounts.append(future.result())
                    for future in futures:
                        future.result()
                if cluster:
                    self._wait_peers(mounts, n - 1)
                for node, mount in zip(nodes, mounts):
                    argv = [
                        sys.executable,
                        "-m",
                        "bench.cluster",
                        "read",
                        "torch",
                        str(mount.mountpoint / KEY),
                    ]
                    readers.append(Reader(argv, f"torch.load on {node.name}", timeout))
            for reader in readers:
                reader.ready()
            sysinfo.drop_page_cache()
            sysinfo.prefault_free_memory(int(LOAD_PREFAULT * self.size * n))
            times = []
            if staggered:
                for reader in readers:
                    reader.go()
                    times.append(reader.times())
            else:
                for reader in readers:
                    reader.go()
                times = [reader.times() for reader in readers]
            served = sum(self.nodes.served()[i] - served0[i] for i in range(n))
            wrong = [r.what for r in readers if r.digest() != self.digest]
            peers = [m.status().get("peers") for m in mounts] if target == "ckptfs-cluster" else []
        finally:
            for reader in readers:
                reader.stop()
            with ThreadPoolExecutor(max(1, len(mounts))) as pool:
                list(pool.map(lambda m: m.stop(), mounts))
            for reader in readers:
                reader.reap()
            self._remove_shm_dirs()
        node_s = [end - start for start, end in times]
        wall = max(end for _, end in times) - min(start for start, _ in times)
        return {
            "target": target,
            "nodes": n,
            "staggered": staggered,
            "seconds": sum(node_s) if staggered else wall,
            "node_seconds": node_s,
            "store_bytes": served,
            "store_ratio": served / self.size,
            "wrong_bytes_on": wrong,
            "peers": peers,
        }

    def _wait_peers(self, mounts: list[CkptfsMount], want: int) -> None:
        deadline = time.monotonic() + PEER_WAIT_S
        while True:
            live = [len((m.status().get("peers") or {}).get("live") or ()) for m in mounts]
            if min(live) >= want:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"--cluster nodes see {live} live peers after {PEER_WAIT_S} s, not {want}")
            time.sleep(0.2)

    # -- all of it --
    def run(self) -> None:
        targets = [t for t in TARGETS if t in self.opts.cluster_targets]
        self.nodes.start()
        self.progress(
            f"cluster   {len(self.nodes.nodes)} node(s): namespaces ckbn0.., store links capped at "
            f"{self.opts.cluster_rate} each (tc tbf), peer links on the bridge ckbbr0 uncapped"
        )
        self.write_checkpoint()
        runs = self.bench.runs("cluster", "")
        for i in range(runs):
            for n in sorted(self.opts.cluster_nodes):
                for staggered in (False, True) if n > 1 else (False,):
                    for target in targets:
                        self._record(self.restore(target, n, staggered), i, runs)

    def _record(self, r: dict, i: int, runs: int) -> None:
        r["run"] = i
        self.runs.append(r)
        n, t = r["nodes"], r["target"]
        kind = "stagger" if r["staggered"] else "once"
        self.bench.results.add(f"cluster_{kind}_{n}", t, r["seconds"])
        self.bench.results.add(f"cluster_store_{kind}_{n}", t, r["store_ratio"])
        how = "one after another" if r["staggered"] else ("at once" if n > 1 else "alone")
        nodes = " ".join(f"{s:.1f}" for s in r["node_seconds"])
        line = (
            f"cluster   {t:17} {n} node{'s' if n > 1 else ' '} {how:17} run {i + 1}/{runs}: "
            f"{'sum' if r['staggered'] else 'wall'} {r['seconds']:6.2f} s (nodes {nodes} s), "
            f"store {r['store_ratio']:.2f}x ({r['store_bytes'] / MiB:.0f} MiB)"
        )
        peers = [p for p in r["peers"] if p]
        if peers:
            took = sum(p.get("taken_bytes", 0) for p in peers) / MiB
            store = sum(p.get("store_bytes", 0) for p in peers) / MiB
            line += f"; peers report: taken {took:.0f} MiB from peers, {store:.0f} MiB from the store"
        if r["wrong_bytes_on"]:
            line += f"; WRONG BYTES on {', '.join(r['wrong_bytes_on'])}"
        self.progress(line)

    def wrong(self) -> list[str]:
        """The readers, in any run, that read other bytes than the checkpoint's."""
        return [f"{w} (run {r['run'] + 1})" for r in self.runs for w in r["wrong_bytes_on"]]


def restores(bench, ctx, opts, work: Path, stack: contextlib.ExitStack) -> Scenario:
    scenario = Scenario(bench, ctx, opts, work, stack)
    scenario.run()
    return scenario


# --- what it reports: cluster.json, cluster.png, the bench:cluster block of docs/benchmarks.md ----

BEGIN, END = "<!-- bench:cluster -->", "<!-- /bench:cluster -->"
COLORS = {"ckptfs-cluster": "#d95f02", "ckptfs-s3": "#fdae61", "boto3": "#4c78a8"}


def _series(results: Results, figure: str, targets, counts) -> dict[str, list]:
    """target -> [(N, median, min, max)] of `figure` ("cluster_once", ...) over the node counts;
    the "stagger" figures of 1 node are its "once" ones (one node alone either way)."""
    out = {}
    for t in targets:
        points = []
        for n in counts:
            fig = f"{figure}_{n}" if n > 1 else f"{figure}_{n}".replace("stagger", "once")
            if (s := results.summary(fig, t)) is not None:
                points.append((n, s.median, s.min, s.max))
        if points:
            out[t] = points
    return out


def plot(results: Results, out: Path, counts) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4.4))
    panels = [
        (axes[0], "cluster_once", 1, "all at once: until the last node is done", "s (lower is better)"),
        (axes[1], "cluster_stagger", 0, "one after another: mean time per node", "s (lower is better)"),
    ]
    for ax, figure, per_total, title, unit in panels:
        for t, points in _series(results, figure, TARGETS, counts).items():
            scale = [1 if per_total else 1 / n for n, *_ in points]
            med = [p[1] * k for p, k in zip(points, scale)]
            err = [
                [(p[1] - p[2]) * k for p, k in zip(points, scale)],
                [(p[3] - p[1]) * k for p, k in zip(points, scale)],
            ]
            ax.errorbar(
                [p[0] for p in points], med, yerr=err, marker="o", capsize=3, color=COLORS[t], label=LABELS[t]
            )
        ax.set_title(title, fontsize=9)
        ax.set_ylabel(unit, fontsize=8)
    one = results.median("cluster_once_1", "ckptfs-cluster")
    if one is not None:
        axes[0].axhline(1.5 * one, color=COLORS["ckptfs-cluster"], linestyle=":", linewidth=1)
        axes[0].text(
            counts[0],
            1.5 * one,
            " goal: 1.5x one node",
            fontsize=8,
            va="bottom",
            color=COLORS["ckptfs-cluster"],
        )
    ax = axes[2]
    for figure, style, how in (
        ("cluster_store_once", "-", "at once"),
        ("cluster_store_stagger", "--", "one after another"),
    ):
        for t, points in _series(results, figure, TARGETS, counts).items():
            ax.plot(
                [p[0] for p in points],
                [p[1] for p in points],
                style,
                marker="o",
                color=COLORS[t],
                label=f"{LABELS[t]}, {how}",
            )
    ax.axhline(1.10, color=COLORS["ckptfs-cluster"], linestyle=":", linewidth=1)
    ax.text(counts[0], 1.10, " goal: 1.10x", fontsize=8, va="bottom", color=COLORS["ckptfs-cluster"])
    ax.set_title("bytes the store served / checkpoint size", fontsize=9)
    ax.set_ylabel("x (lower is better)", fontsize=8)
    for ax in axes:
        ax.set_xticks(list(counts))
        ax.set_xlabel("nodes", fontsize=8)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    fig.suptitle(
        "Restoring one checkpoint on N nodes, each with a capped link to the store (median; whiskers: min and max)",
        fontsize=10,
    )
    fig.tight_layout()
    path = out / "cluster.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _cell(results: Results, n: int, staggered: bool, target: str) -> str:
    kind = "stagger" if staggered else "once"
    time_s, store = (
        results.summary(f"cluster_{kind}_{n}", target),
        results.summary(f"cluster_store_{kind}_{n}", target),
    )
    if time_s is None:
        return ""
    text = f"{time_s.median:.2f} s"
    if len(time_s.runs) > 1:
        text += f" ({time_s.min:.2f}–{time_s.max:.2f})"
    if staggered:
        text += f", {time_s.median / n:.2f} s each"
    text = f"**{text}**" if target.startswith("ckptfs") else text
    return f"{text}; store {store.median:.2f}x"


def markdown(
    results: Results, goals: list[Goal], meta: dict, scenario: Scenario, png: Path, doc: Path
) -> str:
    from tabulate import tabulate

    from bench import report

    targets = [t for t in TARGETS if any(r["target"] == t for r in scenario.runs)]
    rows = []
    for n in sorted(scenario.opts.cluster_nodes):
        for staggered in (False, True) if n > 1 else (False,):
            how = (
                "one after another: sum, mean"
                if staggered
                else ("at once: until the last is done" if n > 1 else "alone")
            )
            rows.append([str(n), how, *(_cell(results, n, staggered, t) for t in targets)])
    matrix = tabulate(
        rows, ["nodes", "restore", *(LABELS[t] for t in targets)], tablefmt="github", disable_numparse=True
    )
    o, runs = scenario.opts, scenario.bench.runs("cluster", "")
    lines = [
        BEGIN,
        *report.header(meta),
        f"Checkpoint: {scenario.size / MiB:.0f} MiB (`--cluster-size {o.cluster_size}`); each node's link to the "
        f"store capped at {o.cluster_rate} (`--cluster-rate`), peer links not; {runs} run{'s' * (runs > 1)} "
        "of each, on cold caches.",
        "",
        "Medians (min–max) of the restore time; store: the bytes the store sent to all the nodes, over the "
        "checkpoint's size.",
        "",
        matrix,
        "",
        "Issue 30 targets, for ckptfs --cluster:",
        "",
        *(f"- **{report._goal_mark(g)}**: {g.text}: {g.detail}" for g in goals),
        "",
        f"![cluster]({os.path.relpath(png, doc.parent)})",
        END,
    ]
    return "\n".join(lines)


def write(scenario: Scenario, results: Results, goals: list[Goal], meta: dict, out: Path, doc: str) -> None:
    """cluster.json and cluster.png in `out`, and the bench:cluster block of `doc` ('none': not)."""
    from bench import report

    figures = [f for f in FIGURES if f.scenario == "cluster"]
    data = report.to_json(results, goals, meta, figures)
    data["runs"] = scenario.runs
    data["meta"]["cluster"] = {
        "checkpoint_bytes": scenario.size,
        "rate": scenario.opts.cluster_rate,
        "nodes": sorted(scenario.opts.cluster_nodes),
        "targets": {t: LABELS[t] for t in TARGETS},
    }
    report.publish_scenario(
        "cluster",
        data,
        out,
        doc,
        lambda out: plot(results, out, sorted(scenario.opts.cluster_nodes)),
        lambda png, path: markdown(results, goals, meta, scenario, png, path),
        BEGIN,
        END,
        scenario.progress,
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["read"]:
        sys.exit(_read_main(sys.argv[2:]))
    sys.exit(__doc__)
