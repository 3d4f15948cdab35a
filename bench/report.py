"""What a run produces: the table on stdout, results.json, one PNG plot per scenario, and the
generated part of docs/benchmarks.md (between the bench:results markers)."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

from tabulate import tabulate

from bench import node_path
from bench.figures import CKPTFS, FIGURES, SCENARIO_TITLES, Figure, Results
from bench.goals import Goal

BEGIN, END = "<!-- bench:results -->", "<!-- /bench:results -->"
ORDER = (
    "cache-disk",
    "nullfs",
    "ckptfs-local",
    "ckptfs-s3",
    "ckptfs-cluster",
    "s3fs",
    "rclone",
    "boto3",
    "s3torchconnector",
)
# the figures of results.json, the plots and the bench:results block; the cluster and replicas
# scenarios' have their own (bench/cluster.py, bench/replicas.py)
OWN_REPORT = ("cluster", "replicas")
MAIN = [f for f in FIGURES if f.scenario not in OWN_REPORT]


def _targets(results: Results, figure: str) -> list[str]:
    present = results.targets(figure)
    return [t for t in ORDER if t in present] + [t for t in present if t not in ORDER]


def _num(x: float | None) -> str:
    if x is None:
        return ""
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.2f}"


def _ratio(r: dict, key: str, other: str) -> str:
    if key not in r:
        return ""
    runs = r.get(f"{key}_runs") or []
    by_run = f" (median of runs {', '.join(f'{x:.2f}' for x in runs)})" if len(runs) > 1 else ""
    return f"{r[key]:.2f}x {r[other]}{by_run}"


def _notes(results: Results) -> list[str]:
    """'figures, target: note' for every value that needs one (marked * in the tables)."""
    grouped: dict[tuple[str, str], list[str]] = {}
    for fig in FIGURES:
        for target, note in results.notes.get(fig.id, {}).items():
            grouped.setdefault((target, note), []).append(fig.id)
    return [f"{' and '.join(figs)}, {target}: {note}" for (target, note), figs in grouped.items()]


def _star(results: Results, figure: str, target: str) -> str:
    return "*" if target in results.notes.get(figure, {}) else ""


def _goal_mark(goal: Goal) -> str:
    return {True: "met", False: "NOT met", None: "not measured"}[goal.met]


# --- stdout ----------------------------------------------------------------------------------


def _goal_lines(title: str, goals: list[Goal]) -> str:
    if not goals:
        return ""
    width = max(len(g.text) for g in goals)
    lines = [f"  {_goal_mark(g):12} {g.text:{width}}  {g.detail}" for g in goals]
    return f"\n\n{title}:\n" + "\n".join(lines)


def table(
    results: Results,
    goals: list[Goal],
    cluster_goals: list[Goal] = (),
    replica_goals: list[Goal] = (),
    issue32_goals: list[Goal] = (),
    meta: dict | None = None,
) -> str:
    rows = []
    for fig in FIGURES:
        for target in _targets(results, fig.id):
            s = results.summary(fig.id, target)
            r = results.ratios(fig.id, target) if target in CKPTFS else {}
            rows.append(
                [
                    fig.id,
                    fig.unit,
                    target + _star(results, fig.id, target),
                    _num(s.median),
                    _num(s.min),
                    _num(s.max),
                    len(s.runs),
                    _ratio(r, "vs_floor", "floor"),
                    _ratio(r, "vs_best_peer", "best_peer"),
                ]
            )
    text = tabulate(
        rows,
        ["figure", "unit", "target", "median", "min", "max", "runs", "ckptfs / floor", "ckptfs / best peer"],
        tablefmt="simple",
        disable_numparse=True,
    )
    notes = "".join(f"\n  * {line}" for line in _notes(results))
    node = "".join(f"\n\n{line.replace('**', '')}" for line in node_path.report_lines(results, meta or {}))
    return (
        text
        + notes
        + node
        + _goal_lines("Design section 5 targets (ckptfs-s3)", goals)
        + _goal_lines("Issue 32 targets, bytes off the GIL (ckptfs-s3)", list(issue32_goals))
        + _goal_lines("Issue 30 targets (ckptfs-cluster)", list(cluster_goals))
        + _goal_lines("Replicated level targets (--replicas 1)", list(replica_goals))
    )


# --- JSON ------------------------------------------------------------------------------------


def _goal_json(goals: list[Goal]) -> list[dict]:
    return [{"target": g.text, "measured": g.detail, "met": g.met} for g in goals]


def to_json(
    results: Results, goals: list[Goal], meta: dict, figs: list[Figure] = MAIN, issue32_goals: list[Goal] = ()
) -> dict:
    figures = []
    for fig in figs:
        values = {}
        for target in _targets(results, fig.id):
            s = results.summary(fig.id, target)
            values[target] = {"median": s.median, "min": s.min, "max": s.max, "runs": s.runs}
            if target in results.notes.get(fig.id, {}):
                values[target]["note"] = results.notes[fig.id][target]
        if values:
            figures.append(
                {
                    "id": fig.id,
                    "scenario": fig.scenario,
                    "title": fig.title,
                    "unit": fig.unit,
                    "higher_is_better": fig.higher_is_better,
                    "floor": fig.floor,
                    "values": values,
                    "ratios": {t: results.ratios(fig.id, t) for t in CKPTFS if t in values},
                }
            )
    out = {"meta": meta, "figures": figures, "design_targets": _goal_json(goals)}
    if issue32_goals:
        out["issue32_targets"] = _goal_json(issue32_goals)
    return out


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


# --- plots -----------------------------------------------------------------------------------

COLORS = {"ckptfs": "#d95f02", "floor": "#999999", "peer": "#4c78a8"}
# what a bar measures when it is not the figure's plain meaning
BAR_LABELS = {
    ("save_stall", "boto3"): "boto3\n(serialize\n+ upload)",
    ("durable", "boto3"): "boto3\n(upload only)",
    ("cold_load", "boto3"): "boto3\n(download only)",
    ("cold_load", "cache-disk"): "cache-disk\n(cold)",
    ("client_cpu_save", "boto3"): "boto3\n(serialize\n+ upload)",
    ("client_cpu_cold", "boto3"): "boto3\n(download only)",
}


def _bar_label(results: Results, figure: str, target: str) -> str:
    label = BAR_LABELS.get((figure, target), target.replace("s3torchconnector", "s3torch-\nconnector"))
    return label + _star(results, figure, target)


def _color(target: str) -> str:
    if target in CKPTFS:
        return COLORS["ckptfs"]
    return COLORS["floor"] if target in ("cache-disk", "nullfs") else COLORS["peer"]


def plots(results: Results, out: Path, limits: dict[str, tuple[float, str]]) -> list[Path]:
    """One PNG per scenario: a panel per figure, bars = medians, whiskers = min..max, ckptfs in
    orange. `limits`: figure -> (value, label) drawn as a dashed line (e.g. the RSS limit)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for scenario, title in SCENARIO_TITLES.items():  # (not the cluster scenario's: bench/cluster.py)
        figs = [f for f in FIGURES if f.scenario == scenario and results.targets(f.id)]
        if not figs:
            continue
        fig, axes = plt.subplots(1, len(figs), figsize=(4.2 * len(figs) + 0.6, 4.2), squeeze=False)
        for ax, f in zip(axes[0], figs):
            names = _targets(results, f.id)
            sums = [results.summary(f.id, n) for n in names]
            med = [s.median for s in sums]
            err = [[s.median - s.min for s in sums], [s.max - s.median for s in sums]]
            bars = ax.bar(
                range(len(names)),
                med,
                yerr=err,
                capsize=4,
                color=[_color(n) for n in names],
                edgecolor=["black" if n in CKPTFS else "none" for n in names],
                width=0.7,
            )
            ax.bar_label(bars, labels=[_num(m) for m in med], padding=2, fontsize=8)
            ax.set_xticks(
                range(len(names)),
                [_bar_label(results, f.id, n) for n in names],
                rotation=35,
                ha="right",
                fontsize=8,
            )
            ax.set_xlim(-0.6, max(len(names), 3) - 0.4)
            better = "higher is better" if f.higher_is_better else "lower is better"
            ax.set_ylabel(f"{f.unit} ({better})", fontsize=8)
            ax.set_title(f.title, fontsize=9, wrap=True)
            ax.margins(y=0.15)
            if f.id in limits:
                value, label = limits[f.id]
                ax.axhline(value, color="#d95f02", linestyle="--", linewidth=1)
                ax.text(-0.5, value, label, ha="left", va="bottom", fontsize=8, color="#d95f02")
            ax.set_ylim(bottom=0)  # (a panel of zeros would centre on 0)
        starred = any(_star(results, f.id, n) for f in figs for n in results.targets(f.id))
        fig.suptitle(
            f"{title}  (median of the runs; whiskers: min and max{'; *: see the notes' if starred else ''})",
            fontsize=10,
        )
        fig.tight_layout()
        path = out / f"{scenario}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


# --- docs/benchmarks.md ----------------------------------------------------------------------


def markdown(
    results: Results,
    goals: list[Goal],
    meta: dict,
    plot_paths: list[Path],
    doc: Path,
    issue32_goals: list[Goal] = (),
) -> str:
    targets = [t for t in ORDER if any(t in results.targets(f.id) for f in MAIN)]
    rows = []
    for f in MAIN:
        if not results.targets(f.id):
            continue
        cells = []
        for t in targets:
            s = results.summary(f.id, t)
            if s is None:
                cells.append("")
                continue
            median = f"**{_num(s.median)}**" if t in CKPTFS else _num(s.median)
            spread = f" ({_num(s.min)}–{_num(s.max)})" if len(s.runs) > 1 else ""
            cells.append(median + spread + _star(results, f.id, t))
        rows.append([f"{f.title} [{f.unit}]", *cells])
    matrix = tabulate(rows, ["figure", *targets], tablefmt="github", disable_numparse=True)

    ckptfs = [t for t in CKPTFS if any(results.ratios(f.id, t) for f in MAIN)]
    ratio_rows = []
    for f in MAIN:
        r = {t: results.ratios(f.id, t) for t in ckptfs}
        if any(r.values()):
            ratio_rows.append(
                [
                    f.id,
                    *(_ratio(r[t], "vs_floor", "floor") for t in ckptfs),
                    *(_ratio(r[t], "vs_best_peer", "best_peer") for t in ckptfs),
                ]
            )
    ratios = tabulate(
        ratio_rows,
        ["figure", *(f"{t} / floor" for t in ckptfs), *(f"{t} / best peer" for t in ckptfs)],
        tablefmt="github",
        disable_numparse=True,
    )
    m = meta
    runs = "; ".join(f"{k}: {n}" for k, n in m["budget"].items())
    ratio_text = (
        "Ratios: ckptfs's median divided by the floor's and by the best peer's (for times, below 1 is "
        "faster; for throughputs, above 1 is faster)."
    )
    lines = [
        BEGIN,
        *header(meta),
        (
            f"Checkpoint: {m['checkpoint_mib']:.0f} MiB (`--size {m['options']['size']}`); runs per target: {runs}."
            if m["checkpoint_mib"]
            else f"Runs per target: {runs}."
        ),
        "",
        "Medians (min–max) per target; ckptfs in bold.",
        "",
        matrix,
        "",
        *(f"\\* {line}  " for line in _notes(results)),
        "",
        ratio_text,
        "",
        ratios,
        "",
        *(line for text in node_path.report_lines(results, meta) for line in (text, "")),
        *(["Design section 5 targets, for ckptfs-s3:", ""] if goals else []),
        *(f"- **{_goal_mark(g)}**: {g.text}: {g.detail}" for g in goals),
        *([""] if goals else []),
        *(["Issue 32 targets (bytes off the GIL), for ckptfs-s3:", ""] if issue32_goals else []),
        *(f"- **{_goal_mark(g)}**: {g.text}: {g.detail}" for g in issue32_goals),
        *([""] if issue32_goals else []),
        *gil_calibration(meta),
        *(f"![{p.stem}]({os.path.relpath(p, doc.parent)})" for p in plot_paths),
        END,
    ]
    return "\n".join(lines)


def gil_calibration(meta: dict) -> list[str]:
    """The GIL-held method checked on known processes (bench/gil.py), as a line of markdown."""
    found = meta.get("gil_calibration_s")
    if not found:
        return []
    checks = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in found.items())
    return [f"GIL-held calibration (py-spy, 2 s of each): {checks} (expected 2 and 0).", ""]


def header(meta: dict) -> list[str]:
    """How the block was made, on what machine, with which versions (lines of markdown)."""
    m, machine = meta, meta["machine"]
    v = machine["versions"]
    generated = (
        f"_Generated by `scripts/bench {shlex.join(m['argv'])}` on {m['date']} in {m['duration_s'] / 60:.1f} "
        "min (do not edit by hand: the next run rewrites this part)._"
    )
    load = (
        f"{', '.join(map(str, machine['load_average_at_start']))} at start, "
        f"{', '.join(map(str, m['load_average_at_end']))} at the end"
    )
    host = (
        f"Machine: {machine['cores']} cores ({machine['cpu']}), {machine['memory_gib']} GiB, "
        f"kernel {machine['kernel']}, {machine['os']}; load average {load}."
        + (f" Note: {m['note']}" if m.get("note") else "")
    )
    versions = (
        f"Versions: ckptfs {v['ckptfs']}, torch {v['torch']}, s3fs {v['s3fs']}, "
        f"rclone {v['rclone']}, boto3 {v['boto3']}, s3torchconnector {v['s3torchconnector']}, Swift {v['swift']}, "
        f"fuse3 {v.get('fuse3', v.get('libfuse'))}, py-spy {v.get('py-spy', 'not installed')}."
    )
    return [generated, "", host, versions]


def publish_scenario(
    name: str, data: dict, out: Path, doc: str, plot, block, begin: str, end: str, progress
) -> None:
    """A scenario's own results: ``<name>.json`` and its plot in ``out`` (``plot(out)`` returns
    the png's path), then its block of ``doc`` (``block(png, path)``: the markdown; "none": no doc)."""
    write_json(out / f"{name}.json", data)
    png = plot(out)
    progress(f"wrote {out / (name + '.json')} and {png}")
    if doc == "none":
        return
    path = Path(doc)
    if update_doc(path, block(png, path), begin, end):
        progress(f"updated the {name} results in {path}")
    else:
        progress(f"{path}: missing, or without the {begin} ... {end} markers: not updated")


def update_doc(doc: Path, block: str, begin: str = BEGIN, end: str = END) -> bool:
    """Replace the generated block of `doc` (`begin` ... `end`, the markers `block` starts and
    ends with); False if the doc or its markers are missing."""
    try:
        text = doc.read_text()
    except FileNotFoundError:
        return False
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        return False
    doc.write_text(text[:start] + block + text[stop + len(end) :])
    return True
