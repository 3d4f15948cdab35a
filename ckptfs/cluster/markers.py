"""Checkpoint markers: the files that make a set of files a checkpoint, and what each stands for.

Pure: names and bytes in, descriptions out. The step-name vocabulary is shared with
``admin/series.py`` (which judges whole steps after the fact); here it decides, at publish time,
what a marker must wait for (``model/gate.py``):

- a marker that lists files (``LISTS``): DCP's ``.metadata`` (the files its storage data names),
  a sharded save's ``*.index.json`` (the shards of its ``weight_map``), Lightning's ``last.ckpt``
  when it is a link (its target);
- a pointer (``POINTER``): a tracker or ``latest`` file naming a step of its directory
  (DeepSpeed's ``latest``: ``global_step100``; Megatron's tracker: ``100``, that is
  ``iter_0000100``; any ``latest``/``latest.txt``/``LATEST``);
- a file written last into a step directory (``STEP``): HF Trainer's ``trainer_state.json``,
  accelerate's ``random_states_N.pkl``.

A file that only looks like one (a ``.metadata`` that is not DCP's, a ``latest`` naming nothing)
is described as no marker: it is published as any file.
"""

from __future__ import annotations

import fnmatch
import json
import posixpath
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass

from ckptfs.cluster import dcpmeta

LISTS, POINTER, STEP = "lists", "pointer", "step"

NUMBERED = [  # (layout, pattern of a step's name); a file step may add an extension
    ("hf-trainer", re.compile(r"checkpoint-(\d+)")),
    ("megatron", re.compile(r"iter_(\d+)")),
    ("deepspeed", re.compile(r"global_step_?(\d+)")),
    ("step", re.compile(r"(?:step|ckpt|checkpoint)[-_]?(\d+)")),
    ("lightning", re.compile(r"epoch=\d+-step=(\d+)(?:-v\d+)?(?:\.ckpt)?")),
]
FILE_SUFFIX = re.compile(r"\.(?:pt|pth|ckpt|bin|safetensors|pkl|tar)\Z")
LIGHTNING_LAST = re.compile(r"last(?:-v\d+)?\.ckpt\Z")
POINTER_NAMES = ("latest_checkpointed_iteration.txt", "latest", "latest.txt", "LATEST")
DCP_METADATA = ".metadata"
HF_TRAINER_STATE = "trainer_state.json"
# accelerate's save_state writes each process's RNG state after the model, optimizer, scheduler,
# sampler and scaler files; it names its steps checkpoint_N (the "step" layout).
ACCELERATE_RNG_STATE = re.compile(r"random_states_\d+\.pkl\Z")
INDEX_SUFFIX = ".index.json"
# the shards a sharded save_pretrained / save_model writes before its index
SHARD_NAME = re.compile(r"-\d{5}-of-\d{5}\.(?:safetensors|bin)\Z")

POINTER_MAX_BYTES = 4096
METADATA_MAX_BYTES = 256 << 20  # a DCP .metadata of a very large model is tens of MB
INDEX_MAX_BYTES = 64 << 20


def match_step(name: str, is_file: bool) -> tuple[str, int] | None:
    """(layout, number) if ``name`` names a step (-1: Lightning's ``last.ckpt``)."""
    if is_file:
        if LIGHTNING_LAST.match(name):
            return "lightning", -1
        if not FILE_SUFFIX.search(name):
            return None
        stem = name if name.endswith(".ckpt") and name.startswith("epoch=") else FILE_SUFFIX.sub("", name)
    else:
        stem = name
    for layout, pattern in NUMBERED:
        m = pattern.fullmatch(stem)
        if m:
            return layout, int(m.group(1))
    return None


def locate(path: str, is_file: bool) -> tuple[int, str, int | None] | None:
    """The index of the component that makes ``path`` part of a step, its layout and number."""
    parts = path.split("/")
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        found = match_step(part, is_file and last)
        if found is not None:
            layout, number = found
            return i, layout, None if number < 0 else number
    return None


@dataclass(frozen=True)
class Marker:
    """What a marker at ``key`` stands for. Keys are the store's (relative to the mount's prefix),
    directories written with a trailing ``/``."""

    key: str
    kind: str  # LISTS, POINTER or STEP
    scope: str  # the directory whose files it stands for ("" for none: LISTS of a link)
    names: frozenset[str] = frozenset()  # LISTS: the keys it names
    series: str = ""  # the directory holding its series of steps
    number: int | None = None  # its step's number, where it has one

    def describe(self) -> str:
        return f"{self.key} ({self.kind})"


def kind_of(key: str, mode: int = 0, plain: Iterable[str] = ()) -> str | None:
    """What ``key`` would be by its name (and mode: a link), or None. ``plain``: globs (on the
    key and on its last component) that the user declared plain files (``--no-marker``)."""
    name = posixpath.basename(key)
    if any(fnmatch.fnmatchcase(key, g) or fnmatch.fnmatchcase(name, g) for g in plain):
        return None
    if name == DCP_METADATA or name.endswith(INDEX_SUFFIX):
        return LISTS
    if LIGHTNING_LAST.match(name) and stat.S_ISLNK(mode):
        return LISTS
    if name in POINTER_NAMES:
        return POINTER
    if name == HF_TRAINER_STATE or ACCELERATE_RNG_STATE.match(name):
        directory = posixpath.dirname(key)
        return STEP if directory and locate(directory, False) is not None else None
    return None


def read_limit(kind: str, key: str) -> int:
    """The most bytes of a marker worth reading."""
    if kind == POINTER:
        return POINTER_MAX_BYTES
    return INDEX_MAX_BYTES if key.endswith(INDEX_SUFFIX) else METADATA_MAX_BYTES


def _step_of(directory: str) -> tuple[str, int | None]:
    """(series directory, number) of the step ``directory`` (a key without "/") belongs to."""
    found = locate(directory, False)
    if found is None:
        return posixpath.dirname(directory), None
    index, _layout, number = found
    parts = directory.split("/")
    return "/".join(parts[:index]), number


def _dir_key(directory: str) -> str:
    return directory + "/" if directory else ""


def describe(key: str, kind: str, data: bytes) -> Marker | None:
    """The marker at ``key`` of ``kind`` (``kind_of``) with content ``data``; None when the content
    says it is no marker after all. POINTER markers come back without scope: ``pointer_candidates``
    says which steps their text may name, and the caller resolves them."""
    directory = posixpath.dirname(key)
    series, number = _step_of(directory) if directory else ("", None)
    if kind == STEP:
        return Marker(key, STEP, _dir_key(directory), series=series, number=number)
    if kind == POINTER:
        return Marker(key, POINTER, "", series=directory) if pointer_text(data) else None
    name = posixpath.basename(key)
    if LIGHTNING_LAST.match(name):  # a link: its content is the target's path
        target = data.decode(errors="replace")
        if not target or target.startswith("/"):
            return None
        resolved = posixpath.normpath(posixpath.join(directory, target))
        if resolved.startswith("../") or resolved == "..":
            return None
        target_dir = posixpath.dirname(resolved)
        return Marker(key, LISTS, _dir_key(target_dir), frozenset({resolved}), series=directory)
    try:
        if name == DCP_METADATA:
            listed = dcpmeta.referenced_files(data)
        else:
            weight_map = json.loads(data).get("weight_map")
            if not isinstance(weight_map, dict):
                return None
            listed = {v for v in weight_map.values() if isinstance(v, str)}
    except (dcpmeta.MetadataError, ValueError, AttributeError):
        return None
    names = set()
    for relative in listed:
        resolved = posixpath.normpath(posixpath.join(directory, relative)) if directory else relative
        if not resolved or resolved.startswith("/") or resolved.startswith(".."):
            continue
        names.add(resolved)
    if not names:
        return None
    return Marker(key, LISTS, _dir_key(directory), frozenset(names), series=series, number=number)


def pointer_text(data: bytes) -> str:
    """A pointer's first line, stripped ("" if none)."""
    lines = data[:POINTER_MAX_BYTES].decode(errors="replace").strip().splitlines()
    return lines[0].strip() if lines else ""


def pointer_candidates(key: str, data: bytes) -> list[tuple[str, int | None]]:
    """The steps a pointer's text may name, most likely first: (path key, number). A name
    (``global_step100``, a path ending in it) or a number (Megatron: ``iter_0000100``)."""
    text = pointer_text(data)
    directory = posixpath.dirname(key)
    if not text or text.startswith("/") or ".." in text.split("/"):
        return []
    if text.isdigit():
        n = int(text)
        names = [f"iter_{n:07d}", f"global_step{n}", f"step_{n}", f"step-{n}", f"step{n}"]
        names += [f"checkpoint-{n}", f"checkpoint_{n}", f"ckpt-{n}", f"ckpt_{n}", f"iter_{n}"]
        return [(posixpath.join(directory, name) if directory else name, n) for name in names]
    base = text.rstrip("/")
    path = posixpath.normpath(posixpath.join(directory, base)) if directory else posixpath.normpath(base)
    found = match_step(posixpath.basename(base), False) or match_step(posixpath.basename(base), True)
    return [(path, found[1] if found and found[1] >= 0 else None)]
