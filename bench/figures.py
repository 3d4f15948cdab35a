"""The figures the bench reports, and the runs collected for each (target -> seconds, ...)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

PEERS = ("s3fs", "rclone", "boto3", "s3torchconnector")
CKPTFS = ("ckptfs-local", "ckptfs-s3", "ckptfs-s3-crc32c", "ckptfs-cluster")
CLUSTER_NODES = (1, 2, 4)  # the node counts of the cluster scenario (bench/cluster.py)


@dataclass(frozen=True)
class Figure:
    id: str
    scenario: str  # figures of one scenario share a plot
    title: str
    unit: str
    higher_is_better: bool = False
    floor: str | None = None  # the target that ratios "to the floor" divide by
    # measured side by side in each run: the ratio to the floor is the median of the runs' ratios
    paired: bool = False


def _cluster_figures() -> list[Figure]:
    """Per node count: all at once, then one after another (the same thing for one node)."""
    figures = []
    for n in CLUSTER_NODES:
        nodes = f"{n} node{'s' if n > 1 else ''}"
        once = f"{n} nodes restore at once: until the last is done" if n > 1 else "1 node restores alone"
        figures += [
            Figure(f"cluster_once_{n}", "cluster", once, "s"),
            Figure(
                f"cluster_store_once_{n}",
                "cluster",
                f"{nodes}{' at once' * (n > 1)}: store bytes / checkpoint",
                "x",
            ),
        ]
        if n > 1:
            figures += [
                Figure(
                    f"cluster_stagger_{n}", "cluster", f"{nodes} one after another: sum of their times", "s"
                ),
                Figure(
                    f"cluster_store_stagger_{n}",
                    "cluster",
                    f"{nodes} one after another: store bytes / checkpoint",
                    "x",
                ),
            ]
    return figures


FIGURES = [
    Figure("save_stall", "save", "save stall: torch.save until it returns", "s", floor="cache-disk"),
    Figure("durable", "save", "time to durable, from save start", "s"),
    Figure("warm_load", "load", "warm torch.load of the latest checkpoint", "s", floor="cache-disk"),
    Figure("cold_load", "load", "cold torch.load (empty cache, page cache dropped)", "s", floor="cache-disk"),
    Figure(
        "daemon_cpu", "daemon", "daemon CPU per GiB saved and uploaded (with its store workers)", "CPU s/GiB"
    ),
    # issue 42: of that, the daemon's main interpreter (its GIL) and its store worker processes
    Figure(
        "daemon_cpu_main", "daemon", "daemon's main interpreter: CPU per GiB saved and uploaded", "CPU s/GiB"
    ),
    Figure(
        "daemon_cpu_workers", "daemon", "daemon's store workers: CPU per GiB saved and uploaded", "CPU s/GiB"
    ),
    Figure(
        "daemon_cpu_main_cold",
        "daemon",
        "daemon's main interpreter: CPU per GiB of a cold load (fetched and read)",
        "CPU s/GiB",
    ),
    Figure(
        "restore_ceiling",
        "daemon",
        "projected per-mount restore ceiling on many cores = 1 / main interpreter CPU s per GiB of a cold load",
        "GiB/s",
        True,
    ),
    Figure("daemon_rss", "daemon", "daemon peak RSS while saving and uploading", "MiB"),
    Figure("ram_4x_rss", "daemon", "ckptfs peak RSS saving 4x its RAM-tier budget", "MiB"),
    # issue 32: what the client side spends (daemon + application, or the client library)
    Figure(
        "client_cpu_save",
        "client_cpu",
        "client CPU per GiB saved until durable",
        "CPU s/GiB",
        floor="cache-disk",
    ),
    Figure(
        "client_cpu_cold", "client_cpu", "client CPU per GiB of a cold load", "CPU s/GiB", floor="cache-disk"
    ),
    # what the S3 server spends on the same work (save start to durable; a cold load)
    Figure("server_cpu_save", "client_cpu", "S3 server CPU per GiB saved until durable", "CPU s/GiB"),
    Figure("server_cpu_cold", "client_cpu", "S3 server CPU per GiB of a cold load", "CPU s/GiB"),
    Figure("gil_held", "gil", "daemon GIL-held time per GiB saved and uploaded", "s/GiB"),
    Figure(
        "projected_ceiling",
        "gil",
        "projected per-mount save ceiling on many cores = 1 / GIL-held s per GiB",
        "GiB/s",
        True,
    ),
    Figure(
        "fuse_thread_cpu",
        "gil",
        "daemon FUSE thread's CPU per GiB saved and uploaded (serial: every request)",
        "CPU s/GiB",
    ),
    Figure(
        "fuse_thread_ceiling",
        "gil",
        "projected per-mount save ceiling = 1 / the FUSE thread's CPU s per GiB",
        "GiB/s",
        True,
    ),
    Figure("write_tp", "write", "FUSE write path: 8 MiB os.write calls", "GiB/s", True, floor="nullfs"),
    Figure("save_tp", "write", "FUSE write path: torch.save throughput", "GiB/s", True, floor="nullfs"),
    Figure(
        "scale_write_1",
        "scale",
        "1 writer into one mount (8 MiB os.write): aggregate",
        "GiB/s",
        True,
        floor="nullfs",
    ),
    Figure("scale_write_2", "scale", "2 writers into one mount: aggregate", "GiB/s", True, floor="nullfs"),
    Figure("scale_write_4", "scale", "4 writers into one mount: aggregate", "GiB/s", True, floor="nullfs"),
    Figure("scale_read_1", "scale", "1 cold reader (fresh mount, empty cache)", "GiB/s", True),
    Figure("scale_read_4", "scale", "4 cold readers of different files: aggregate", "GiB/s", True),
    Figure(
        "scale_write_cpu_1", "scale_cpu", "1 writer: daemon CPU per GiB written and uploaded", "CPU s/GiB"
    ),
    Figure(
        "scale_write_cpu_2", "scale_cpu", "2 writers: daemon CPU per GiB written and uploaded", "CPU s/GiB"
    ),
    Figure(
        "scale_write_cpu_4", "scale_cpu", "4 writers: daemon CPU per GiB written and uploaded", "CPU s/GiB"
    ),
    Figure("scale_read_cpu_1", "scale_cpu", "1 cold reader: daemon CPU per GiB read", "CPU s/GiB"),
    Figure("scale_read_cpu_4", "scale_cpu", "4 cold readers: daemon CPU per GiB read", "CPU s/GiB"),
    Figure(
        "dcp_stall", "dcp", "4 ranks save a shard each: stall until the last returns", "s", floor="cache-disk"
    ),
    Figure("dcp_durable", "dcp", "4 ranks: time to durable of all shards", "s"),
    Figure("small_stall", "small", "many small files: save time", "s", floor="cache-disk"),
    Figure("small_durable", "small", "many small files: time to durable", "s"),
    # the node scenario (bench/node_path.py): ckptfs on a file:// store vs the cache disk, warm
    Figure(
        "node_read",
        "node",
        "warm read of a cached file: fresh open, 8 MiB readinto",
        "GiB/s",
        True,
        floor="cache-disk",
        paired=True,
    ),
    Figure(
        "node_load", "node", "warm torch.load of that checkpoint (fp32)", "s", floor="cache-disk", paired=True
    ),
    Figure(
        "node_save",
        "node",
        "torch.save of that state dict into a new file",
        "s",
        floor="cache-disk",
        paired=True,
    ),
    Figure(
        "node_write_2",
        "node",
        "2 writer processes, size/2 each (8 MiB os.write): aggregate",
        "GiB/s",
        True,
        floor="cache-disk",
        paired=True,
    ),
    Figure(
        "node_write_1",
        "node",
        "1 writer process (8 MiB os.write)",
        "GiB/s",
        True,
        floor="cache-disk",
        paired=True,
    ),
    Figure("node_read_cpu", "node_cpu", "warm read: daemon CPU per GiB (all threads)", "CPU s/GiB"),
    Figure(
        "node_write_cpu_trio",
        "node_cpu",
        "1 writer: the trio thread's CPU per GiB written",
        "CPU s/GiB",
    ),
    Figure(
        "node_write_cpu_fuse",
        "node_cpu",
        "1 writer: ckptfs-fuse-N threads' CPU per GiB written",
        "CPU s/GiB",
    ),
    Figure(
        "node_upload_cpu",
        "node_cpu",
        "1 writer: the daemon's CPU per GiB from the close to durable (upload, checks)",
        "CPU s/GiB",
    ),
    *_cluster_figures(),
    # the replicas scenario (bench/replicas.py): --replicas 1 vs 0 on two --cluster mounts
    Figure("replicas_stall", "replicas", "save stall: torch.save until it returns", "s"),
    Figure("replicas_replicated", "replicas", "time to replicated: the close returned, replica held", "s"),
    Figure("replicas_durable", "replicas", "time to durable: until ckptfs sync returns", "s"),
    Figure("replicas_after_close", "replicas", "after the close: durable - stall", "s"),
    Figure("replicas_upload", "replicas", "the upload alone (boto3, bytes in memory)", "s"),
    Figure("replicas_cpu_client", "replicas", "client CPU, save start to durable", "CPU s"),
    Figure("replicas_cpu_writer", "replicas", "writer daemon CPU, save start to durable", "CPU s"),
    Figure("replicas_cpu_holder", "replicas", "holder daemon CPU, save start to durable", "CPU s"),
    Figure("replicas_cpu_store", "replicas", "Swift server CPU, save start to durable", "CPU s"),
    Figure("replicas_busy", "replicas", "machine CPU busy during the stall", "%"),
]
BY_ID = {f.id: f for f in FIGURES}

SCENARIO_TITLES = {
    "save": "One checkpoint: save stall and time to durable",
    "load": "Loading the latest checkpoint",
    "daemon": "Filesystem daemon: CPU and memory",
    "client_cpu": "Client CPU per GiB: daemon + application, or the client library",
    "gil": "ckptfs daemon: GIL-held time while saving and uploading",
    "write": "FUSE write path vs a do-nothing filesystem on the same transport (fusewire)",
    "scale": "Scaling: concurrent writers and cold readers in one mount",
    "scale_cpu": "Scaling: daemon CPU per GiB as the work grows",
    "dcp": "DCP-like: 4 ranks save at once",
    "small": "Many small files",
    "node": "One node, warm: ckptfs (file:// store) vs the same work on the cache disk",
    "node_cpu": "One node: the ckptfs daemon's CPU per GiB",
}


@dataclass
class Summary:
    median: float
    min: float
    max: float
    runs: list[float]


@dataclass
class Results:
    values: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    notes: dict[str, dict[str, str]] = field(default_factory=dict)

    def add(self, figure: str, target: str, value: float) -> None:
        assert figure in BY_ID, figure
        self.values.setdefault(figure, {}).setdefault(target, []).append(value)

    def note(self, figure: str, target: str, text: str) -> None:
        self.notes.setdefault(figure, {})[target] = text

    def targets(self, figure: str) -> list[str]:
        return list(self.values.get(figure, {}))

    def summary(self, figure: str, target: str) -> Summary | None:
        runs = self.values.get(figure, {}).get(target)
        if not runs:
            return None
        return Summary(statistics.median(runs), min(runs), max(runs), list(runs))

    def median(self, figure: str, target: str) -> float | None:
        s = self.summary(figure, target)
        return s.median if s else None

    def paired_ratios(self, figure: str, target: str) -> list[float] | None:
        """A paired figure's value / the floor's, run by run (None: not paired, or the runs differ)."""
        fig = BY_ID[figure]
        mine = self.values.get(figure, {}).get(target)
        floor = self.values.get(figure, {}).get(fig.floor or "")
        if not (fig.paired and mine and floor) or len(mine) != len(floor) or not all(floor):
            return None
        return [m / f for m, f in zip(mine, floor)]

    def best_peer(self, figure: str) -> str | None:
        fig = BY_ID[figure]
        peers = [(self.median(figure, p), p) for p in PEERS if self.median(figure, p) is not None]
        if not peers:
            return None
        return (max(peers) if fig.higher_is_better else min(peers))[1]

    def ratios(self, figure: str, target: str) -> dict:
        """ckptfs (or any target) against the floor and the best peer: value / theirs."""
        fig, mine = BY_ID[figure], self.median(figure, target)
        out = {}
        if mine is None:
            return out
        if fig.floor and self.median(figure, fig.floor):
            out["floor"] = fig.floor
            out["vs_floor"] = mine / self.median(figure, fig.floor)
            per_run = self.paired_ratios(figure, target)
            if per_run:
                out["vs_floor"] = statistics.median(per_run)
                out["vs_floor_runs"] = per_run
        peer = self.best_peer(figure)
        if peer and self.median(figure, peer):
            out["best_peer"] = peer
            out["vs_best_peer"] = mine / self.median(figure, peer)
        return out
