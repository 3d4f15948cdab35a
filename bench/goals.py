"""The targets of design section 5, checked against one run's medians (ckptfs on S3)."""

from __future__ import annotations

from dataclasses import dataclass

from bench.figures import BY_ID, Results

MiB = 1 << 20
ME = "ckptfs-s3"


@dataclass
class Goal:
    text: str  # the target, as design section 5 states it
    detail: str  # what this run measured
    met: bool | None  # None: not measured in this run


def _ratio_goal(
    results: Results, text: str, figure: str, other: str, limit: float, faster: bool = False, me: str = ME
) -> Goal:
    """mine / other <= limit, or with `faster`, other / mine >= limit (how many times faster)."""
    mine, theirs = results.median(figure, me), results.median(figure, other)
    if mine is None or theirs is None:
        missing = " and ".join(t for t, value in ((me, mine), (other, theirs)) if value is None)
        return Goal(text, f"not measured ({missing} not in this run)", None)
    unit = BY_ID[figure].unit
    if faster:
        ratio = theirs / mine
        return Goal(
            text,
            f"{other} takes {ratio:.2f}x as long ({theirs:.2f} {unit} vs {mine:.2f} {unit})",
            ratio >= limit,
        )
    ratio = mine / theirs
    return Goal(text, f"{ratio:.2f}x ({mine:.2f} {unit} vs {theirs:.2f} {unit})", ratio <= limit)


def _throughput_goal(results: Results, text: str, figure: str) -> Goal:
    mine, null = results.median(figure, ME), results.median(figure, "nullfs")
    if mine is None or null is None:
        return Goal(text, "not measured", None)
    ratio = mine / null
    return Goal(text, f"{ratio:.0%} ({mine:.2f} vs {null:.2f} GiB/s)", ratio >= 0.85)


def _memory_goal(results: Results, ram_budget: int) -> Goal:
    text = "daemon RSS <= RAM-tier budget + 200 MB while writing 4x that budget"
    summary = results.summary("ram_4x_rss", ME)
    if summary is None:
        return Goal(text, "not measured", None)
    limit = (ram_budget + 200e6) / MiB
    return Goal(
        text,
        f"peak {summary.max:.0f} MiB (highest of {len(summary.runs)} runs), limit {limit:.0f} MiB "
        f"(budget {ram_budget / MiB:.0f} MiB)",
        summary.max <= limit,
    )


def _cpu_goal(results: Results) -> Goal:
    text = "daemon CPU <= 3 CPU s per GiB saved and uploaded (s3fs ~3.7, rclone ~9)"
    mine = results.median("daemon_cpu", ME)
    if mine is None:
        return Goal(text, "not measured", None)
    others = ", ".join(
        f"{p} {results.median('daemon_cpu', p):.2f}"
        for p in ("s3fs", "rclone")
        if results.median("daemon_cpu", p) is not None
    )
    return Goal(text, f"{mine:.2f} CPU s/GiB" + (f" ({others})" if others else ""), mine <= 3.0)


def _best_everywhere(results: Results) -> Goal:
    text = "beat the best peer on every figure"
    behind, compared = [], 0
    for figure in BY_ID.values():
        if figure.scenario in (
            "cluster",
            "replicas",
        ):  # (their own targets: check_cluster, bench/replicas.py)
            continue
        ratios = results.ratios(figure.id, ME)
        if "vs_best_peer" not in ratios:
            continue
        compared += 1
        r = ratios["vs_best_peer"]
        if (r < 1) if figure.higher_is_better else (r > 1):
            behind.append(f"{figure.id} ({ratios['best_peer']} {r:.2f}x)")
    if not compared:
        return Goal(text, "no peer measured", None)
    detail = f"behind on {', '.join(behind)}" if behind else f"ahead on all {compared} figures with a peer"
    return Goal(text, detail, not behind)


def check(results: Results, ram_budget: int) -> list[Goal]:
    return [
        _ratio_goal(results, "save stall <= 1.15x the cache disk", "save_stall", "cache-disk", 1.15),
        _ratio_goal(results, "save stall >= 3x faster than s3fs", "save_stall", "s3fs", 3.0, faster=True),
        _ratio_goal(results, "save stall no slower than rclone mount", "save_stall", "rclone", 1.0),
        _ratio_goal(results, "time to durable <= 1.1x the boto3 upload alone", "durable", "boto3", 1.1),
        _ratio_goal(
            results, "time to durable no slower than s3torchconnector", "durable", "s3torchconnector", 1.0
        ),
        _ratio_goal(
            results, "time to durable >= 3x faster than rclone", "durable", "rclone", 3.0, faster=True
        ),
        _ratio_goal(results, "warm torch.load <= 1.1x the cache disk", "warm_load", "cache-disk", 1.1),
        _ratio_goal(
            results,
            "cold torch.load >= 1.3x the throughput of boto3 (download_fileobj, then torch.load)",
            "cold_load",
            "boto3",
            1.3,
            faster=True,
        ),
        _memory_goal(results, ram_budget),
        _cpu_goal(results),
        _throughput_goal(
            results, "FUSE write path (os.write) >= 85% of the do-nothing filesystem", "write_tp"
        ),
        _throughput_goal(
            results, "FUSE write path (torch.save) >= 85% of the do-nothing filesystem", "save_tp"
        ),
        Goal(
            "crash safety: 100 kill -9 trials, 0 committed files lost, torn or corrupt",
            "not measured by the bench: tests/test_crash_torture.py (scripts/test --long runs 100 trials)",
            None,
        ),
        _best_everywhere(results),
    ]


def _at_most(results: Results, text: str, figure: str, limit: float, also: str = "") -> Goal:
    mine = results.median(figure, ME)
    if mine is None:
        return Goal(text, "not measured", None)
    unit = BY_ID[figure].unit
    return Goal(text, f"{mine:.2f} {unit}{also}", mine <= limit)


def _gil_goal(results: Results) -> Goal:
    text = "daemon GIL-held <= 0.5 s per GiB saved and uploaded (projected ceiling >= 2 GiB/s)"
    ceiling = results.median("projected_ceiling", ME)
    return _at_most(results, text, "gil_held", 0.5, f" (ceiling {ceiling:.2f} GiB/s)" if ceiling else "")


def check_issue32(results: Results) -> list[Goal]:
    """Issue 32's targets ("bytes off the GIL"), for ckptfs-s3."""
    return [
        _ratio_goal(results, "time to durable <= s3torchconnector's", "durable", "s3torchconnector", 1.0),
        _ratio_goal(
            results,
            "DCP 4 ranks: time to durable <= s3torchconnector's",
            "dcp_durable",
            "s3torchconnector",
            1.0,
        ),
        _ratio_goal(
            results, "cold torch.load >= 1.1x the throughput of boto3", "cold_load", "boto3", 1.1, faster=True
        ),
        _ratio_goal(
            results,
            "client CPU of a cold load (daemon + reader) <= half of boto3's",
            "client_cpu_cold",
            "boto3",
            0.5,
        ),
        _at_most(results, "daemon CPU <= 1.5 CPU s per GiB saved and uploaded", "daemon_cpu", 1.5),
        _gil_goal(results),
        # issue 42: the store's byte path in worker processes
        _ratio_goal(
            results,
            "in s3torchconnector's integrity mode (UNSIGNED-PAYLOAD + CRC32C): time to durable <= its",
            "durable",
            "s3torchconnector",
            1.0,
            me="ckptfs-s3-crc32c",
        ),
        _at_most(
            results,
            "daemon's main interpreter <= 0.2 CPU s per GiB saved and uploaded (the rest in store workers)",
            "daemon_cpu_main",
            0.2,
        ),
        _at_most(
            results,
            "daemon's main interpreter <= 0.2 CPU s per GiB of a cold load (restore ceiling >= 5 GiB/s)",
            "daemon_cpu_main_cold",
            0.2,
        ),
    ]


CLUSTER = "ckptfs-cluster"


def _others(results: Results, figure: str, unit: str) -> str:
    found = [(t, results.median(figure, t)) for t in ("ckptfs-s3", "boto3")]
    found = [f"{t} {v:.2f}{unit}" for t, v in found if v is not None]
    return f" ({', '.join(found)})" if found else ""


def check_cluster(results: Results, wrong: list[str]) -> list[Goal]:
    """Issue 30's targets for ckptfs --cluster (bench/cluster.py), from the medians; `wrong`: the
    readers that read other bytes than the checkpoint's, in any run."""
    goals = []
    for kind, how in (("once", "at once"), ("stagger", "one after another")):
        figure = f"cluster_store_{kind}_4"
        text = f"4 nodes restoring {how}: the store serves <= 1.10x the checkpoint"
        mine = results.median(figure, CLUSTER)
        if mine is None:
            goals.append(Goal(text, f"not measured{_others(results, figure, 'x')}", None))
        else:
            goals.append(Goal(text, f"{mine:.2f}x{_others(results, figure, 'x')}", mine <= 1.10))
    text = "4 nodes restoring at once take <= 1.5x the time of 1 node alone"
    one, four = results.median("cluster_once_1", CLUSTER), results.median("cluster_once_4", CLUSTER)
    if one is None or four is None:
        goals.append(Goal(text, "not measured", None))
    else:
        ratio = four / one
        goals.append(Goal(text, f"{ratio:.2f}x ({four:.2f} s vs {one:.2f} s)", ratio <= 1.5))
    measured = any(results.targets(f.id) for f in BY_ID.values() if f.scenario == "cluster")
    goals.append(
        Goal(
            "every node of every run reads the checkpoint's exact bytes",
            ("wrong bytes on " + ", ".join(wrong)) if wrong else ("all did" if measured else "not measured"),
            None if not measured else not wrong,
        )
    )
    return goals


def _node_goal(results: Results, text: str, figure: str, limit: float) -> Goal:
    """Issue 41: the node scenario's paired ratio to the cache disk (speed: ckptfs / disk)."""
    from statistics import median

    ratios = results.paired_ratios(figure, "ckptfs-local")
    if not ratios:
        return Goal(text, "not measured (the node scenario did not run)", None)
    speed = median(ratios) if BY_ID[figure].higher_is_better else median(1 / r for r in ratios)
    return Goal(
        text, f"{speed:.2f}x the cache disk's speed (median of {len(ratios)} paired runs)", speed >= limit
    )


def check_node(results: Results) -> list[Goal]:
    """Issue 41's targets on a file:// store: the node's data path at the cache disk's speed."""
    return [
        _node_goal(results, "1 writer >= 0.9x the cache disk", "node_write_1", 0.9),
        _node_goal(results, "2 writers >= 0.9x the cache disk", "node_write_2", 0.9),
        _node_goal(results, "torch.save >= 0.9x the cache disk", "node_save", 0.9),
        _node_goal(results, "warm read >= 0.9x the cache disk", "node_read", 0.9),
    ]
