"""ckptfs side by side with what users would use instead, in one run on this machine.

    scripts/bench [--size MiB] [--runs N] [--targets LIST] [--scenarios LIST] ...
    scripts/bench --scenarios cluster [--cluster-size MiB] [--cluster-rate RATE] ...
    scripts/bench --scenarios replicas [--replicas-size MiB] [--runs N]
    scripts/bench --scenarios node [--size MiB] [--runs N]

Starts OpenStack Swift (s3api) on 127.0.0.1, mounts every filesystem target, runs the scenarios
(run 1 of every target, then run 2, ...), prints a table, writes docs/benchmarks/results.json,
one PNG per scenario and the generated part of docs/benchmarks.md. The cluster scenario (issue
30; only when named) restores one checkpoint on 1, 2 and 4 nodes in network namespaces
(bench/cluster.py) and writes cluster.json, cluster.png and its own part of the doc. The replicas
scenario (only when named) times a save with --replicas 1 against --replicas 0 on two --cluster
mounts (bench/replicas.py) and writes replicas.json, replicas.png and its own part. The node
scenario (bench/node_path.py) measures one node's warm reads, torch.load and writers on a mount
of its own (a file:// store) against the cache disk; run alone it needs no Swift. Unmounts,
stops what it started (by PID), removes its network namespaces and its work directory on the
way out, also after an error or Ctrl-C. See docs/benchmarks.md for the method.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

from bench import cluster, node_path, replicas, report, sysinfo, workloads
from bench.durable import POLL_INTERVAL
from bench.figures import CLUSTER_NODES, Results
from bench.goals import check, check_cluster, check_issue32
from bench.mounts import fuse_mounts_under, unmount
from bench.netnodes import rate_bytes
from bench.targets import TARGETS, Context

REPO = Path(__file__).resolve().parent.parent
SCENARIOS = ("save", "cold", "write", "scale", "ram4x", "dcp", "small", "node")  # the default: all of these
# only when named: several nodes each, minutes of their own (cluster: network namespaces, root)
OPT_IN = ("cluster", "replicas")
NO_STORE = ("node",)  # its own mount on a file:// store: no Swift, none of the targets
SLOW_PEERS = ("s3fs", "rclone")  # 15-30 s per 1 GiB save here, twice the others
MiB = 1 << 20


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not usage + error
        self.exit(2, f"scripts/bench: {message} (see --help)\n")


def _names(allowed, what: str):
    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in allowed]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {', '.join(unknown) or repr(text)}; choose from {','.join(allowed)}"
            )
        return names

    return parse


def _rate(text: str) -> str:
    try:
        rate_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text.strip().lower()


def _node_counts(text: str) -> list[int]:
    return [int(n) for n in _names(tuple(map(str, CLUSTER_NODES)), "node count")(text)]


def _at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is below {low}")
        return value

    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = Parser(
        prog="scripts/bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--size",
        type=_at_least(16),
        default=1024,
        metavar="MiB",
        help="checkpoint size in MiB (default 1024); each of the 4 DCP ranks saves size/4; the node "
        "scenario's file (its 2 writers: size/2 each)",
    )
    p.add_argument(
        "--runs", type=_at_least(1), default=3, metavar="N", help="runs per figure and target (default 3)"
    )
    p.add_argument(
        "--slow-runs",
        type=_at_least(1),
        default=2,
        metavar="N",
        help=f"runs of {' and '.join(SLOW_PEERS)} in the save, cold and dcp scenarios (default 2)",
    )
    p.add_argument(
        "--small-files",
        type=_at_least(1),
        default=2000,
        metavar="N",
        help="files of 64 KiB in the small-files scenario (default 2000)",
    )
    p.add_argument(
        "--small-runs",
        type=_at_least(1),
        default=1,
        metavar="N",
        help="runs per target of the small-files scenario, the slowest part (default 1)",
    )
    p.add_argument(
        "--slow-files",
        type=_at_least(0),
        default=200,
        metavar="N",
        help="s3fs and s3torchconnector write only N of the small files, their times scaled "
        "to all of them (default 200; 0: all)",
    )
    p.add_argument(
        "--targets",
        type=_names(tuple(TARGETS), "target"),
        default=list(TARGETS),
        metavar="LIST",
        help=f"comma-separated (default all: {','.join(TARGETS)})",
    )
    p.add_argument(
        "--scenarios",
        type=_names(SCENARIOS + OPT_IN, "scenario"),
        default=list(SCENARIOS),
        metavar="LIST",
        help=f"comma-separated (default all but {','.join(OPT_IN)}: {','.join(SCENARIOS)}); cold loads "
        "read what save wrote; node uses a mount of its own on a file:// store (alone: no Swift)",
    )
    p.add_argument(
        "--cluster-size",
        type=_at_least(16),
        default=256,
        metavar="MiB",
        help="the checkpoint the cluster scenario restores, in MiB (default 256)",
    )
    p.add_argument(
        "--cluster-rate",
        type=_rate,
        default="400mbit",
        metavar="RATE",
        help="each node's link to the store in the cluster scenario, in tc's units (default 400mbit)",
    )
    p.add_argument(
        "--cluster-nodes",
        type=_node_counts,
        default=list(CLUSTER_NODES),
        metavar="LIST",
        help=f"node counts of the cluster scenario (default {','.join(map(str, CLUSTER_NODES))})",
    )
    p.add_argument(
        "--cluster-targets",
        type=_names(cluster.TARGETS, "cluster target"),
        default=list(cluster.TARGETS),
        metavar="LIST",
        help=f"what restores in the cluster scenario (default all: {','.join(cluster.TARGETS)})",
    )
    p.add_argument(
        "--replicas-size",
        type=_at_least(16),
        default=None,
        metavar="MiB",
        help="the checkpoint the replicas scenario saves, in MiB (default: --size)",
    )
    p.add_argument(
        "--store",
        choices=("swift", "rgw"),
        default="swift",
        help="the S3 server the store targets use: OpenStack Swift (default) or Ceph's RADOS "
        "Gateway (tests/support/rgw.py, bluestore); its own CPU per GiB is reported either way; "
        "rgw leaves s3torchconnector out (its writer fails there at the close)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="where results.json and the plots go (default docs/benchmarks; docs/benchmarks/rgw with --store rgw)",
    )
    p.add_argument(
        "--doc",
        default=None,
        metavar="FILE",
        help="markdown file whose bench:results block is rewritten; 'none' to skip (default "
        "docs/benchmarks.md; none with --store rgw)",
    )
    p.add_argument(
        "--work-dir",
        type=Path,
        default=Path(tempfile.gettempdir()),
        metavar="DIR",
        help="where the temporary work directory goes: the cache disk (default $TMPDIR or /tmp)",
    )
    p.add_argument(
        "--compress",
        action="store_true",
        help="measure --compress zstd instead (bench/compression.py; with it: --size MiB "
        "(default 256), --rate MiB/s for the throttled link (default 50), --level N)",
    )
    p.add_argument(
        "--note",
        default="",
        metavar="TEXT",
        help="a remark stored with the results (e.g. that the machine was shared)",
    )
    opts = p.parse_args(argv)
    rgw = opts.store == "rgw"
    if rgw and "s3torchconnector" in opts.targets:
        # (its writer fails at the close against the RGW of the tests: "Header "ETag" not found")
        if opts.targets != list(TARGETS):  # (named, not the default)
            p.error(
                "s3torchconnector cannot save to Ceph RGW 16 (its writer fails at the close): leave it out"
            )
        opts.targets.remove("s3torchconnector")
    if opts.out is None:
        opts.out = REPO / "docs" / "benchmarks" / ("rgw" if rgw else "")
    if opts.doc is None:
        opts.doc = "none" if rgw else str(REPO / "docs" / "benchmarks.md")
    if not opts.work_dir.is_dir():
        p.error(f"--work-dir {opts.work_dir} is not a directory")
    if "cluster" in opts.scenarios and os.geteuid() != 0:
        p.error("the cluster scenario needs root (network namespaces, tc)")
    return opts


def runs_policy(opts):
    def runs(scenario: str, target: str) -> int:
        if scenario == "small":
            return opts.small_runs
        if scenario == "ram4x":
            return 1  # a peak: one save of 4x the budget answers it
        if scenario == "scale":
            return 1  # five figures a target, a minute or more each for ckptfs-s3: the time budget
        if target in SLOW_PEERS:
            return min(opts.runs, opts.slow_runs)
        return opts.runs

    return runs


def budget(opts) -> dict[str, str]:
    """How many runs each scenario gets, and what the slow peers skip, in words."""

    def runs(n: int) -> str:
        return f"{n} run{'s' if n > 1 else ''}"

    slow = [t for t in SLOW_PEERS if t in opts.targets]
    out = {}
    for s in ("save", "cold", "write", "dcp"):
        if s in opts.scenarios:
            out[s] = runs(opts.runs)
            if s != "write" and slow and opts.slow_runs < opts.runs:
                out[s] += f" ({' and '.join(slow)}: {runs(opts.slow_runs)})"
    if "scale" in opts.scenarios:
        out["scale"] = runs(1)
    if "ram4x" in opts.scenarios:
        out["ram4x"] = runs(1)
    if "cluster" in opts.scenarios:
        out["cluster"] = runs(opts.runs)
    if "replicas" in opts.scenarios:
        out["replicas"] = runs(opts.runs)
    if "node" in opts.scenarios:
        out["node"] = runs(opts.runs)
    if "small" in opts.scenarios:
        out["small"] = runs(opts.small_runs)
        slow = [t for t in workloads.SLOW_SMALL if t in opts.targets]
        if slow and 0 < opts.slow_files < opts.small_files:
            out["small"] += (
                f", {' and '.join(slow)} on {opts.slow_files} of {opts.small_files} files with times scaled"
            )
    return out


def _safely(what: str, fn, *args) -> None:
    start = time.monotonic()
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 -- keep cleaning up
        print(f"scripts/bench: cleanup: {what}: {e}", file=sys.stderr, flush=True)
    if time.monotonic() - start > 3:
        print(f"  ({what} took {time.monotonic() - start:.0f} s)", flush=True)


def _clean_work(work: Path) -> None:
    """Whatever is left: FUSE mounts under the work dir, RAM arenas of its ckptfs caches, the dir."""
    from ckptfs.daemon.run import recorded_ram_dir

    for mountpoint in fuse_mounts_under(work):
        print(f"  unmounting leftover {mountpoint}", file=sys.stderr, flush=True)
        unmount(mountpoint, attempts=4)
    for cache in work.glob("*-cache"):
        if (ram := recorded_ram_dir(cache)) is not None:
            shutil.rmtree(ram, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def run(opts, work: Path, stack: contextlib.ExitStack, progress: workloads.Progress) -> int:
    import torch

    from tests.support.checkpoints import make_checkpoint
    from tests.support.rgw import RgwServer
    from tests.support.swift import SwiftServer

    main_scenarios = [s for s in opts.scenarios if s not in OPT_IN]
    target_scenarios = [s for s in main_scenarios if s not in NO_STORE]  # (those use the targets)
    machine = sysinfo.describe()  # before the bench loads the machine
    server = None
    if [s for s in opts.scenarios if s not in NO_STORE]:
        name = "Swift (s3api)" if opts.store == "swift" else "Ceph RGW"
        server = (
            SwiftServer(work / "swift")
            if opts.store == "swift"
            else RgwServer(work / "rgw", objectstore="bluestore")
        )
        stack.callback(_safely, f"stopping {name}", server.stop)
        server.start()
        os.environ.update(server.env())
        sysinfo.SERVER_GROUPS[:] = server.pids().values()  # (each leads a process group of its own)
        progress(f"{name} healthy at {server.endpoint}")

    state, nbytes = None, 0
    if target_scenarios:
        state = make_checkpoint(opts.size)
        buf = io.BytesIO()
        torch.save(state, buf)
        nbytes = buf.tell()
        del buf
        progress(f"checkpoint: {nbytes / MiB:.0f} MiB (bf16 + fp32 weights, Adam-like state, python objects)")

    ctx = Context(
        work,
        *(
            (server.endpoint, server.access_key, server.secret_key, server.region)
            if server
            else ("", "", "", "")
        ),
        nbytes,
    )
    targets = {}
    for name in opts.targets if target_scenarios else ():
        target = TARGETS[name](ctx)
        stack.callback(_safely, f"stopping {name}", target.stop)
        target.start()
        targets[name] = target
        progress(f"ready     {name:17} {f'(daemon pid {target.pid})' if target.pid else ''}")

    runs = runs_policy(opts)
    progress("budget: " + "; ".join(f"{k}: {v}" for k, v in budget(opts).items()))
    results = Results()
    bench = workloads.Bench(targets, results, progress, runs)
    ram_budget = max(4 * 8 * MiB, (nbytes // 4) // MiB * MiB)
    if "save" in opts.scenarios:
        workloads.one_checkpoint(bench, state, nbytes)
        workloads.gil_held(bench, state, nbytes)
    if "cold" in opts.scenarios:
        workloads.cold_loads(bench, nbytes)
    if "write" in opts.scenarios:
        workloads.write_path(bench, state, nbytes)
    if "scale" in opts.scenarios:
        workloads.scaling(bench, nbytes)
    if "ram4x" in opts.scenarios and "ckptfs-s3" in targets:
        ram_budget = workloads.ram_budget_4x(bench, ctx, state, nbytes)
    del state
    if "dcp" in opts.scenarios:
        workloads.dcp_like(bench, max(1, opts.size // workloads.RANKS))
    if "small" in opts.scenarios:
        workloads.small_files(bench, opts.small_files, opts.slow_files)

    for target in reversed(list(targets.values())):  # unmount before reporting: counts in the run time
        target.stop()
    if "node" in opts.scenarios:  # (its own mount, once the targets' daemons are gone)
        node_path.measure(bench, opts, work, stack)
    restores = cluster.restores(bench, ctx, opts, work, stack) if "cluster" in opts.scenarios else None
    replicated = replicas.measure(bench, ctx, opts, work, stack) if "replicas" in opts.scenarios else None
    meta = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "argv": sys.argv[1:],
        "options": {
            "size": opts.size,
            "runs": opts.runs,
            "slow_runs": opts.slow_runs,
            "small_files": opts.small_files,
            "small_runs": opts.small_runs,
            "slow_files": opts.slow_files,
            "targets": opts.targets,
            "scenarios": opts.scenarios,
            "cluster_size": opts.cluster_size,
            "cluster_rate": opts.cluster_rate,
            "cluster_nodes": opts.cluster_nodes,
            "cluster_targets": opts.cluster_targets,
            "replicas_size": opts.replicas_size or opts.size,
        },
        "budget": budget(opts),
        "checkpoint_mib": nbytes / MiB,
        "poll_interval_s": POLL_INTERVAL,
        "ram_budget_4x_mib": ram_budget / MiB,
        "targets": {name: t.note for name, t in targets.items()},
        "machine": machine,
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        "note": opts.note,
        "duration_s": time.monotonic() - progress.start,
        **bench.meta,
    }
    goals = check(results, ram_budget) if target_scenarios else []
    issue32_goals = check_issue32(results) if target_scenarios else []
    cluster_goals = check_cluster(results, restores.wrong()) if restores else []
    replica_goals = (
        replicas.check(results, replicated.not_replicated(), runs("replicas", "")) if replicated else []
    )
    print("\n" + report.table(results, goals, cluster_goals, replica_goals, issue32_goals, meta), flush=True)
    opts.out.mkdir(parents=True, exist_ok=True)
    if restores:
        cluster.write(restores, results, cluster_goals, meta, opts.out, opts.doc)
    if replicated:
        replicas.write(replicated, results, replica_goals, meta, opts.out, opts.doc)
    if not main_scenarios:  # (an opt-in-only run leaves results.json and the bench:results block alone)
        return 0
    report.write_json(
        opts.out / "results.json", report.to_json(results, goals, meta, issue32_goals=issue32_goals)
    )
    limit = (ram_budget + 200e6) / MiB
    lines = {"ram_4x_rss": (limit, f"budget + 200 MB = {limit:.0f} MiB")}
    lines.update({f: (node_path.PYFUSE3_WRITE_CPU, node_path.BEFORE_LINE) for f in node_path.CPU_FIGURES})
    pngs = report.plots(results, opts.out, lines)
    progress(f"wrote {opts.out / 'results.json'} and {len(pngs)} plots in {opts.out}")
    if opts.doc != "none":
        doc = Path(opts.doc)
        if report.update_doc(doc, report.markdown(results, goals, meta, pngs, doc, issue32_goals)):
            progress(f"updated the results in {doc}")
        else:
            progress(f"{doc}: missing, or without the {report.BEGIN} ... {report.END} markers: not updated")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--compress" in argv and not {"-h", "--help"} & set(argv):
        from bench import compression

        return compression.main([a for a in argv if a != "--compress"])
    opts = parse_args(argv)
    progress = workloads.Progress()
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started with SIGINT ignored
    work = Path(tempfile.mkdtemp(prefix="ckptfs-bench-", dir=opts.work_dir))
    progress(f"work directory {work}")
    stack = contextlib.ExitStack()
    stack.callback(_safely, "removing the work directory", _clean_work, work)
    rc = 1
    try:
        rc = run(opts, work, stack, progress)
    except KeyboardInterrupt:
        print("\nscripts/bench: interrupted; cleaning up", file=sys.stderr, flush=True)
        rc = 130
    except Exception as e:  # noqa: BLE001 -- reported, then cleaned up
        traceback.print_exc()
        print(f"scripts/bench: failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # let the cleanup finish
            signal.signal(sig, signal.SIG_IGN)
        stack.close()
        progress(f"cleaned up; {time.monotonic() - progress.start:.0f} s in all")
    return rc


if __name__ == "__main__":
    sys.exit(main())
