"""The import rules of ckptfs/, checked by reading every module with ``ast`` (imports inside
functions count too), so the layering cannot rot silently:

- only fuse_ops.py and daemon.py import pyfuse3; only the S3 store's modules (store/s3.py,
  s3_client.py, s3_multipart.py: S3_ALLOWED) import boto3, botocore, s3transfer or awscrt;
  importing the package, the CLI or any model/data module loads neither (checked in a fresh
  interpreter, which also catches a dependency that pulls them in);
- each module imports only modules of lower layers (LAYERS below, bottom first): the order of
  docs/architecture.md's diagram (daemon > fuse_ops > namespace > uploader/fetcher/prefill >
  journal > cache > store), with the modules the diagram leaves out placed where their imports
  put them today. Calls handed up at run time (the cache's ``CachePolicy``, the uploader's
  ``on_durable``/``on_moved`` and ``retained_ops``, prefill's ``busy``) are calls, not imports:
  docs/architecture.md lists them ("Who calls whom").

A new module gets a line in LAYERS (test_every_module_has_a_layer says which are missing).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ckptfs"

# Bottom first. A module may import modules of lower layers only (never its own layer or above).
LAYERS: list[tuple[str, set[str]]] = [
    (
        "leaves: no ckptfs imports",
        {
            "errors",
            "config",
            "background",
            "stats",
            "dcpmeta",
            "blocks",
            "store.localfs",
            "single_flight",
            "model",
        },
    ),
    ("the store interface", {"store.base"}),
    (
        "files, figures, local-store files, the S3 connection",
        {"private", "logs", "limits", "health", "series", "metrics", "store.local_tree", "store.s3_client"},
    ),
    ("local-store and S3 uploads, cache arenas", {"store.local_multipart", "store.s3_multipart", "arena"}),
    (
        "stores, part encoding, retry policies, cached contents",
        {"store.local", "store.s3", "compression", "retry", "contents"},
    ),
    ("store choice, the cache, checksums", {"store", "cache", "integrity"}),
    (
        "cache users, admin targets and client",
        {"journal", "clean_index", "target", "control", "logical_store"},
    ),
    ("uploads' records, fetched ranges' checks", {"upload_tasks", "fetch_checks"}),
    ("uploads' parts and encoding", {"upload_parts", "upload_encoding"}),
    ("transfer", {"uploader", "fetcher", "prefill", "openers", "verify"}),
    ("model: the tree, handles, key codec", {"model.tree"}),
    ("model: cache policy", {"model.policy"}),
    ("model: commit path", {"model.commits"}),
    ("model: start-up, refresh, operations", {"model.startup", "model.refresh", "model.files", "model.dirs"}),
    ("model facade", {"namespace"}),
    ("FUSE glue, admin server", {"fuse_ops", "control_server", "catalog_handler"}),
    ("mount checks (ask a mount's daemon)", {"paths"}),
    ("the parts, built and wired (build_core)", {"core"}),
    ("the control commands' answers", {"commands"}),
    ("daemon wiring", {"daemon"}),
    ("admin clients, Python API", {"catalog", "api", "cli_support"}),
    ("commands", {"catalog_cli", "verify_cli", "mount_cli", "control_cli"}),
    ("command line", {"cli"}),
    ("python -m ckptfs", {"__main__"}),
]
RANK = {module: rank for rank, (_, modules) in enumerate(LAYERS) for module in modules}

PYFUSE3_ALLOWED = {"fuse_ops", "daemon"}
S3_LIBRARIES = {"boto3", "botocore", "s3transfer", "awscrt"}
S3_ALLOWED = {"store.s3", "store.s3_client", "store.s3_multipart"}  # the S3 store's modules


def modules() -> dict[str, Path]:
    """ckptfs modules by dotted name below the package ("store.s3"); "" is the package itself."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = modules()


def imports(name: str) -> tuple[set[str], set[str]]:
    """(ckptfs modules, top-level outside packages) that module ``name`` imports anywhere in it."""
    path = MODULES[name]
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    ours, outside = set(), set()

    def ours_from(dotted: list[str], names: list[str]) -> None:
        base = ".".join(dotted)
        for alias in names:  # `from . import cache`: a module; `from .cache import Cache`: a name
            candidate = f"{base}.{alias}" if base else alias
            ours.add(candidate if candidate in MODULES else base)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "ckptfs" or alias.name.startswith("ckptfs."):
                    ours.add(alias.name.removeprefix("ckptfs").lstrip("."))
                else:
                    outside.add(alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                ours_from(
                    base + (node.module.split(".") if node.module else []), [a.name for a in node.names]
                )
            elif node.module == "ckptfs" or node.module.startswith("ckptfs."):
                ours_from(node.module.split(".")[1:], [a.name for a in node.names])
            else:
                outside.add(node.module.split(".")[0])
    ours.discard("")  # the package itself (its __init__ is checked on its own)
    ours.discard(name)
    return ours, outside


def test_the_parser_sees_known_imports():
    # (a guard against this test going blind: these imports exist today)
    assert {"namespace", "openers", "errors"} <= imports("fuse_ops")[0]
    assert "pyfuse3" in imports("fuse_ops")[1] and "boto3" in imports("store.s3_client")[1]
    assert {"store.s3_client", "store.s3_multipart"} <= imports("store.s3")[0]
    assert {"control", "limits", "logs", "private", "store", "daemon"} <= imports("mount_cli")[0] | imports(
        "control_cli"
    )[0]
    assert {"mount_cli", "control_cli", "catalog_cli", "verify_cli"} <= imports("cli")[0]
    assert {"store.local", "store.s3", "store.base"} <= imports("store")[0]


def test_only_the_fuse_glue_and_the_daemon_import_pyfuse3():
    users = {name for name in MODULES if "pyfuse3" in imports(name)[1]}
    assert users <= PYFUSE3_ALLOWED, (
        f"pyfuse3 imported outside fuse_ops/daemon: {sorted(users - PYFUSE3_ALLOWED)}"
    )


def test_only_the_s3_store_imports_boto3():
    users = {name: sorted(imports(name)[1] & S3_LIBRARIES) for name in MODULES}
    assert {name: libs for name, libs in users.items() if libs and name not in S3_ALLOWED} == {}


def test_the_package_and_the_lower_layers_load_neither_at_import():
    """In a fresh interpreter: `import ckptfs`, the CLI and every module below the FUSE glue
    (bar the S3 store) load neither pyfuse3 nor an S3 library."""
    light = sorted(
        name for name in MODULES if name and name != "__main__" and name not in S3_ALLOWED | PYFUSE3_ALLOWED
    )
    code = (
        "import importlib, sys\n"
        "import ckptfs\n"
        f"for name in {light!r}:\n"
        "    importlib.import_module('ckptfs.' + name)\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({sorted(S3_LIBRARIES | {'pyfuse3'})!r})))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"loaded at import: {done.stdout.strip()}"


def test_every_module_has_a_layer():
    unplaced = sorted(name for name in MODULES if name and name not in RANK)
    assert not unplaced, (
        f"place {unplaced} in a layer of tests/test_layering.py LAYERS "
        "(and in docs/architecture.md's diagram)"
    )


@pytest.mark.parametrize("name", sorted(name for name in MODULES if name in RANK))
def test_imports_go_down_the_layers(name):
    upward = sorted(target for target in imports(name)[0] if target in RANK and RANK[target] >= RANK[name])
    assert not upward, (
        f"ckptfs/{name.replace('.', '/')} ({LAYERS[RANK[name]][0]}) imports "
        + ", ".join(f"{t} ({LAYERS[RANK[t]][0]})" for t in upward)
        + ": only lower layers may be imported"
    )


def test_the_command_line_starts_without_trio_or_numpy():
    """Every `ckptfs` command pays for what `import ckptfs.cli.main` loads (the tests call it hundreds
    of times): the event loop and numpy load only in the commands that use them."""
    code = (
        "import sys, ckptfs.cli\nprint(sorted({m.split('.')[0] for m in sys.modules} & {'trio', 'numpy'}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"loaded by the CLI at import: {done.stdout.strip()}"
