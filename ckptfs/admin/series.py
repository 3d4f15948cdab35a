"""Checkpoint series: which files make up which step, whether each step is complete, which one a
restart should use, and what retention (gc) keeps. Pure: it is given the list of files and a
function that reads a small file (pointer files, DCP ``.metadata``, shard indexes); the caller
(admin/catalog.py) does the I/O on a mount or a store.

Layouts recognised (the outermost path component that matches makes the step; its parent
directory holds the series):

- ``step-N``, ``step_N``, ``stepN`` (and ``ckpt-N``): a directory or a single file (``step_N.pt``)
- ``checkpoint-N``: Hugging Face Trainer (its ``trainer_state.json`` is written last)
- ``iter_NNNNNNN``: Megatron-LM, with ``latest_checkpointed_iteration.txt`` next to them
- ``global_stepN``: DeepSpeed, with its ``latest`` file next to them
- ``epoch=E-step=S.ckpt``: PyTorch Lightning (a file, or a directory for sharded strategies);
  ``last.ckpt`` is the newest save, kept apart from the numbered series
- any other directory holding a torch.distributed.checkpoint ``.metadata``: a step with no number

A step is complete when every file is durable, every DCP directory in it has its ``.metadata``
and that names only files present, every ``*.index.json`` shard index names only files present,
an HF Trainer step has ``trainer_state.json`` (when the series' other steps show the Trainer
writes one), a step of accelerate's ``save_state`` has its ``random_states_R.pkl`` (likewise),
and no pointer file of the series names an older step (Megatron and DeepSpeed write
it after every rank saved: a newer step is still being written or was abandoned).
"""

from __future__ import annotations

import fnmatch
import json
import posixpath
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ckptfs.cluster import dcpmeta
from ckptfs.cluster.markers import (
    ACCELERATE_RNG_STATE,
    DCP_METADATA,
    HF_TRAINER_STATE,
    INDEX_MAX_BYTES,
    INDEX_SUFFIX,
    METADATA_MAX_BYTES,
    POINTER_MAX_BYTES,
    POINTER_NAMES,
    SHARD_NAME,
)
from ckptfs.cluster.markers import locate as _locate

DURABLE = "durable"

Reader = Callable[[str, int], bytes]  # (path, most bytes wanted) -> the bytes; OSError if unreadable


@dataclass(frozen=True)
class Entry:
    """A file (or a directory marker) relative to the root being looked at."""

    path: str
    size: int = 0
    mtime: float = 0.0
    state: str = DURABLE  # durable, pending (committed, not yet in the store) or writing
    is_dir: bool = False


@dataclass
class Step:
    path: str  # relative to the root looked at
    name: str
    layout: str
    number: int | None  # None: a DCP directory with no number in its name, or Lightning's last.ckpt
    is_file: bool = False  # a single-file step (step_100.pt, epoch=0-step=5.ckpt)
    files: int = 0
    size: int = 0
    mtime: float = 0.0
    state: str = DURABLE  # durable, or pending while any file is not yet in the store
    complete: bool = False
    reasons: list[str] = field(default_factory=list)  # why it is not complete
    pointed: bool = False  # a pointer file names it
    restart: bool = False  # the one a restart should use
    location: str = ""  # where a user finds it (a path on the mount, or a URL), set by the caller
    entries: list[Entry] = field(default_factory=list, repr=False)

    def to_json(self) -> dict:
        return {
            "path": self.path,
            "name": self.name,
            "layout": self.layout,
            "step": self.number,
            "files": self.files,
            "bytes": self.size,
            "mtime": self.mtime,
            "state": self.state,
            "complete": self.complete,
            "reasons": list(self.reasons),
            "pointed": self.pointed,
            "restart": self.restart,
            "location": self.location,
        }


@dataclass
class Pointer:
    path: str
    text: str  # what it says (first line), "" if unreadable
    names: str | None  # the path of the step it names, None if none in the series


@dataclass
class Series:
    directory: str  # relative to the root looked at ("" for the root itself)
    layout: str
    steps: list[Step]
    pointers: list[Pointer] = field(default_factory=list)

    @property
    def restart(self) -> Step | None:
        return next((s for s in self.steps if s.restart), None)

    def to_json(self) -> dict:
        restart = self.restart
        return {
            "directory": self.directory,
            "layout": self.layout,
            "pointers": [{"path": p.path, "text": p.text, "names": p.names} for p in self.pointers],
            "restart": restart.path if restart else None,
            "steps": [s.to_json() for s in self.steps],
        }


def analyse(entries: Iterable[Entry], read: Reader) -> list[Series]:
    """The checkpoint series among ``entries``: steps grouped by the directory holding them,
    sorted by step number (steps with no number after, by time), each assessed."""
    entries = [e for e in entries if e.path and not e.path.startswith("/")]
    steps: dict[str, Step] = {}
    loose: list[Entry] = []
    for entry in entries:
        path = entry.path.rstrip("/")
        found = _locate(path, not entry.is_dir)
        if found is None:
            loose.append(entry)
            continue
        index, layout, number = found
        parts = path.split("/")
        step_path = "/".join(parts[: index + 1])
        step = steps.get(step_path)
        if step is None:
            is_file = index == len(parts) - 1 and not entry.is_dir
            step = steps[step_path] = Step(step_path, parts[index], layout, number, is_file=is_file)
        step.entries.append(entry)
    # Unnumbered DCP directories: a .metadata outside any step makes its directory one (the
    # outermost, when DCP directories nest).
    dcp_dirs = sorted(
        {
            posixpath.dirname(e.path)
            for e in loose
            if not e.is_dir and posixpath.basename(e.path) == DCP_METADATA
        }
        - {""}
    )
    outer = [d for d in dcp_dirs if not any(d.startswith(o + "/") for o in dcp_dirs)]
    for directory in outer:
        steps[directory] = Step(directory, posixpath.basename(directory), "dcp", None)
    for entry in loose:
        owner = next((d for d in outer if entry.path.startswith(d + "/")), None)
        if owner is not None:
            steps[owner].entries.append(entry)
    for step in steps.values():
        _measure(step)

    by_dir: dict[str, list[Step]] = {}
    for step in steps.values():
        by_dir.setdefault(posixpath.dirname(step.path), []).append(step)
    files = {e.path for e in entries if not e.is_dir}
    series = []
    for directory, members in sorted(by_dir.items()):
        members.sort(
            key=lambda s: (s.number is None, s.number if s.number is not None else 0, s.mtime, s.name)
        )
        layouts = sorted(
            {s.layout for s in members}
            | (
                {"dcp"}
                if any(  # (DCP inside numbered steps)
                    posixpath.basename(e.path) == DCP_METADATA for s in members for e in s.entries
                )
                else set()
            )
        )
        one = Series(directory, "+".join(layouts), members)
        one.pointers = _pointers(directory, members, files, read)
        for step in members:
            _assess(step, one, files, read)
        _choose_restart(one)
        series.append(one)
    return series


def _measure(step: Step) -> None:
    real = [e for e in step.entries if not e.is_dir]
    step.files = len(real)
    step.size = sum(e.size for e in real)
    step.mtime = max((e.mtime for e in step.entries), default=0.0)
    step.state = DURABLE if all(e.state == DURABLE for e in real) else "pending"


def pointer_paths(directory: str) -> list[str]:
    return [posixpath.join(directory, name) if directory else name for name in POINTER_NAMES]


def _pointers(directory: str, steps: list[Step], files: set[str], read: Reader) -> list[Pointer]:
    out = []
    for path in pointer_paths(directory):
        if path not in files:
            continue
        try:
            text = read(path, POINTER_MAX_BYTES).decode(errors="replace").strip().splitlines()[0].strip()
        except (OSError, IndexError):
            text = ""
        named = _named_step(text, steps)
        out.append(Pointer(path, text, named.path if named else None))
        if named is not None:
            named.pointed = True
    return out


def _named_step(text: str, steps: list[Step]) -> Step | None:
    """The step a pointer's text names: its name (DeepSpeed's ``latest``: global_step100; a
    path ending in it) or its number (Megatron's tracker: 100)."""
    if not text:
        return None
    base = posixpath.basename(text.rstrip("/"))
    for step in steps:
        if step.name == base:
            return step
    if text.isdigit():
        return next((s for s in steps if s.number == int(text)), None)
    return None


def _assess(step: Step, series: Series, files: set[str], read: Reader) -> None:
    reasons = step.reasons
    if step.files == 0:
        reasons.append("no files")
    not_durable = sum(1 for e in step.entries if not e.is_dir and e.state != DURABLE)
    if not_durable:
        reasons.append(f"{not_durable} file{'s' if not_durable != 1 else ''} not yet durable")
    if not step.is_file:
        reasons.extend(_dcp_problems(step, files, read))
        reasons.extend(_index_problems(step, files, read))
        if (
            step.layout == "hf-trainer"
            and _trainer_writes_state(series)
            and posixpath.join(step.path, HF_TRAINER_STATE) not in files
        ):
            reasons.append(f"no {HF_TRAINER_STATE} (the Trainer writes it last)")
        if _accelerate_writes_rng_state(series) and not _has_accelerate_rng_state(step):
            reasons.append("no random_states_N.pkl (accelerate's save_state writes it last)")
    for pointer in series.pointers:
        named = next((s for s in series.steps if s.path == pointer.names), None)
        if (
            named is not None
            and step.number is not None
            and named.number is not None
            and step.number > named.number
            and step.layout == named.layout
        ):
            reasons.append(f"newer than the step {posixpath.basename(pointer.path)} names ({named.name})")
    step.complete = not reasons


def _trainer_writes_state(series: Series) -> bool:
    return any(
        s.layout == "hf-trainer" and any(posixpath.basename(e.path) == HF_TRAINER_STATE for e in s.entries)
        for s in series.steps
    )


def _has_accelerate_rng_state(step: Step) -> bool:
    return any(
        not e.is_dir
        and posixpath.dirname(e.path) == step.path
        and ACCELERATE_RNG_STATE.match(posixpath.basename(e.path))
        for e in step.entries
    )


def _accelerate_writes_rng_state(series: Series) -> bool:
    """Some directory step of the series holds accelerate's RNG state: its steps come from
    save_state, and one without it was cut short (save_state writes no other marker, and with
    ``total_limit`` it removes the oldest step before writing the new one)."""
    return any(not s.is_file and _has_accelerate_rng_state(s) for s in series.steps)


def _dcp_problems(step: Step, files: set[str], read: Reader) -> list[str]:
    """Each directory in the step holding DCP data must have a .metadata naming only files present."""
    dcp_dirs: dict[str, bool] = {}  # directory -> has .metadata
    for entry in step.entries:
        if entry.is_dir:
            continue
        directory, name = posixpath.split(entry.path)
        if name == DCP_METADATA:
            dcp_dirs[directory] = True
        elif name.endswith(".distcp"):
            dcp_dirs.setdefault(directory, False)
    problems = []
    for directory, has_metadata in sorted(dcp_dirs.items()):
        where = _relative(directory, step.path)
        if not has_metadata:
            problems.append(f"no DCP {DCP_METADATA}{where}")
            continue
        try:
            names = dcpmeta.referenced_files(
                read(posixpath.join(directory, DCP_METADATA), METADATA_MAX_BYTES)
            )
        except dcpmeta.MetadataError as e:
            problems.append(f"{DCP_METADATA}{where}: {e}")
            continue
        except OSError as e:
            problems.append(f"cannot read {DCP_METADATA}{where}: {e.strerror or e}")
            continue
        missing = sorted(n for n in names if posixpath.normpath(posixpath.join(directory, n)) not in files)
        if missing:
            problems.append(
                f"DCP {DCP_METADATA}{where} names {len(missing)} missing file"
                f"{'s' if len(missing) != 1 else ''} ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})"
            )
    return problems


def _index_problems(step: Step, files: set[str], read: Reader) -> list[str]:
    """A sharded safetensors / PyTorch save's ``*.index.json`` must name only shards present."""
    problems = []
    indexed = {posixpath.dirname(e.path) for e in step.entries if e.path.endswith(INDEX_SUFFIX)}
    sharded = {
        posixpath.dirname(e.path)
        for e in step.entries
        if not e.is_dir and SHARD_NAME.search(posixpath.basename(e.path))
    }
    for directory in sorted(sharded - indexed):
        problems.append(
            f"shards without their *{INDEX_SUFFIX}{_relative(directory, step.path)} (written last)"
        )
    for entry in step.entries:
        if entry.is_dir or not entry.path.endswith(INDEX_SUFFIX):
            continue
        directory, name = posixpath.split(entry.path)
        try:
            weight_map = json.loads(read(entry.path, INDEX_MAX_BYTES)).get("weight_map")
        except (OSError, ValueError, AttributeError):
            problems.append(f"{name} is not a readable shard index")
            continue
        if not isinstance(weight_map, dict):
            continue
        shards = {v for v in weight_map.values() if isinstance(v, str)}
        missing = sorted(s for s in shards if posixpath.normpath(posixpath.join(directory, s)) not in files)
        if missing:
            problems.append(
                f"{name} names {len(missing)} missing shard{'s' if len(missing) != 1 else ''} "
                f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})"
            )
    return problems


def _relative(directory: str, step_path: str) -> str:
    return "" if directory == step_path else f" in {directory[len(step_path) + 1 :]}/"


def _choose_restart(series: Series) -> None:
    """The newest complete numbered step; Lightning's last.ckpt instead when it is complete and
    no older (what Lightning itself resumes from; stores date objects to the second); in a series with
    no numbers, the newest complete step by time."""
    complete = [s for s in series.steps if s.complete]
    numbered = [s for s in complete if s.number is not None]
    best = max(numbered, key=lambda s: (s.number, s.mtime)) if numbered else None
    last = [s for s in complete if s.number is None and s.layout == "lightning"]
    if last and (best is None or max(last, key=lambda s: s.mtime).mtime >= best.mtime):
        best = max(last, key=lambda s: s.mtime)
    if best is None and complete:
        best = max(complete, key=lambda s: s.mtime)
    if best is not None:
        best.restart = True


# --- retention ---------------------------------------------------------------------------------


@dataclass
class Decision:
    step: Step
    delete: bool
    why: str  # why it is kept, or "" when deleted


def plan_gc(
    series: Iterable[Series], keep_last: int, keep_every: int | None = None, pattern: str | None = None
) -> list[Decision]:
    """What retention deletes: per series, the numbered steps matching ``pattern`` (a glob on the
    step's path, or on its name when the glob has no ``/``) other than the newest ``keep_last``,
    those whose number is a multiple of ``keep_every``, any not yet durable, any a pointer file
    names, and the one a restart should use. Steps with no number are never deleted."""
    decisions = []
    for one in series:
        in_scope = [s for s in one.steps if s.number is not None and _matches(s, pattern)]
        newest = (
            {id(s) for s in sorted(in_scope, key=lambda s: s.number or 0)[len(in_scope) - keep_last :]}
            if keep_last > 0
            else set()
        )
        for step in one.steps:
            if step.number is None:
                why = "no step number (last.ckpt or a DCP directory): never collected"
            elif not _matches(step, pattern):
                why = "not matched by --pattern"
            elif step.state != DURABLE:
                why = "still pending upload"
            elif step.pointed:
                why = "named by a pointer file"
            elif step.restart:
                why = "newest complete step (the restart point)"
            elif id(step) in newest:
                why = f"among the newest {keep_last}"
            elif keep_every and step.number % keep_every == 0:
                why = f"step number is a multiple of {keep_every}"
            else:
                why = ""
            decisions.append(Decision(step, not why, why))
    return decisions


def _matches(step: Step, pattern: str | None) -> bool:
    if not pattern:
        return True
    return fnmatch.fnmatchcase(step.path if "/" in pattern else step.name, pattern)
