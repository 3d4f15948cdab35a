"""The import rules of ckptfs/, checked by reading every module with ``ast`` (imports inside
functions and under ``if TYPE_CHECKING`` count too), so the layering cannot rot silently:

- no module imports pyfuse3 (ckptfs speaks the FUSE protocol itself: fusewire/);
  only the S3 store's modules (store/s3.py, s3_client.py, s3_multipart.py: S3_ALLOWED) import
  boto3, botocore, s3transfer or awscrt; importing the package, the CLI or any other module
  loads neither (checked in a fresh interpreter, which also catches a dependency that pulls them
  in), and the CLI loads neither trio nor numpy;
- each module imports only from packages of lower layers (LAYERS below, bottom first), or from
  its own package: inside model/ and store/ only modules of lower rows of SUBLAYERS, inside any
  other package any module, as long as the modules import no cycle (test_no_import_cycles).
  Every module takes its layer from its package: a new module needs no line here, except in
  model/ and store/ (and a new package or top-level module needs a row);
- no class inherits from a class of another ckptfs module (a mixin: its state and the methods
  it calls live in another file) other than an interface (ALLOWED_BASES: the store's ABC,
  Protocols, exceptions), and no such base class calls what only its subclasses define.

Calls handed up at run time (the Protocols a lower layer declares and a higher one implements,
such as the cache's ``EvictionPolicy`` and prefill's ``KernelCache``, and the callbacks it is
given) are calls, not imports: docs/architecture.md lists them ("Who calls whom").
"""

from __future__ import annotations

import ast
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ckptfs"

# Bottom first. An entry is a package ("store": its __init__ and every module below it) or a
# module ("errors", "cluster.dcpmeta"); the most specific entry naming a module gives its layer.
# "" is the package's own __init__ (ckptfs/__init__.py).
LAYERS: list[tuple[str, set[str]]] = [
    ("leaves: import nothing of ckptfs", {"errors", "config", "blocks", "parts", "cluster.dcpmeta"}),
    ("util: threads, single flight, figures, private files", {"util"}),
    ("fusewire: the FUSE kernel protocol, spoken by ckptfs itself", {"fusewire"}),
    ("store: the object stores", {"store"}),
    ("objects, cache: what objects hold and their checksums; the node's cache", {"objects", "cache"}),
    ("transfer: uploads, fetches, retries", {"transfer"}),
    ("cluster: what the nodes of one store tell each other through it; checkpoint markers", {"cluster"}),
    ("model: the filesystem behind the FUSE glue", {"model"}),
    ("fuse, control: the kernel's calls; the control socket", {"fuse", "control"}),
    ("admin: catalogs, series, targets, verify", {"admin"}),
    ("daemon: wiring, commands, the run loop", {"daemon"}),
    ("cli: the commands", {"cli"}),
    ("api: the Python API", {"api"}),
    ("the package, python -m ckptfs", {"", "__main__"}),
]

# Inside these packages a module imports only modules of lower rows (bottom first; the package
# name itself is its __init__). Every module of the package needs a row.
SUBLAYERS: dict[str, list[set[str]]] = {
    "model": [
        {"model.tree", "model.passthrough"},
        {"model.prefill", "model.policy", "model.gate"},
        {"model.commits"},
        {"model.startup", "model.refresh", "model.files", "model.dirs"},
        {"model.tailing"},
        {"model.namespace"},
        {"model"},
    ],
    "store": [
        {"store.base", "store.localfs", "store.health", "store.s3_crt"},
        {"store.local_tree", "store.s3_client"},
        {"store.local_multipart", "store.s3_multipart"},
        {"store.local", "store.s3"},
        {"store"},  # open_store
    ],
}

PYFUSE3_ALLOWED: set[str] = set()  # (none: fusewire speaks the protocol)
S3_LIBRARIES = {"boto3", "botocore", "s3transfer", "awscrt"}
S3_ALLOWED = {"store.s3", "store.s3_client", "store.s3_multipart", "store.s3_crt"}  # the S3 store's modules

# Classes of ckptfs that a class of another module may inherit from: interfaces (an ABC or a
# Protocol: test_the_class_reader_sees_known_bases checks) and the exceptions of errors.py.
# (Bases from outside ckptfs, typing's included, are free.)
ALLOWED_BASES: dict[tuple[str, str], str] = {
    ("store.base", "ObjectStore"): "the object-store interface (an ABC)",
    ("cache.cache", "EvictionPolicy"): "what the cache asks of the model (a Protocol)",
    ("model.prefill", "KernelCache"): "what prefill asks of the kernel, through the FUSE glue (a Protocol)",
    ("fusewire.face", "Filesystem"): "what the FUSE transport asks of a filesystem (its defaults: ENOSYS)",
    ("fusewire.face", "Deferred"): "a handler's copy left to the FUSE reader thread (an ABC)",
    **{
        ("errors", name): "an exception"
        for name in (
            "CkptfsError",
            "UsageError",
            "MountError",
            "ControlError",
            "TimedOut",
            "FsError",
            "StoreError",
            "NotFound",
        )
    },
}


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


def where(name: str) -> str:
    return str(MODULES[name].relative_to(ROOT))


@cache
def parsed(name: str) -> ast.Module:
    return ast.parse(MODULES[name].read_text(), str(MODULES[name]))


def _from_module(name: str, node: ast.ImportFrom) -> str | None:
    """The ckptfs module (dotted, "" for the package) a `from X import ...` in ``name`` reads
    from, or None when X is outside ckptfs."""
    if node.level:
        package = name.split(".") if MODULES[name].name == "__init__.py" else name.split(".")[:-1]
        base = package[: len(package) - (node.level - 1)] + (node.module.split(".") if node.module else [])
        return ".".join(base)
    if node.module == "ckptfs" or node.module.startswith("ckptfs."):
        return node.module.removeprefix("ckptfs").lstrip(".")
    return None


def _joined(base: str, attr: str) -> str:
    return f"{base}.{attr}" if base else attr


@cache
def imports(name: str) -> tuple[dict[str, int], dict[str, int]]:
    """(ckptfs modules, top-level packages outside ckptfs) that module ``name`` imports anywhere
    in it, each with the line of its first import. `from ckptfs.x import y` imports the module
    x.y if there is one, else (a name of x) x; "" is the package itself."""
    ours: dict[str, int] = {}
    outside: dict[str, int] = {}
    for node in ast.walk(parsed(name)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "ckptfs" or alias.name.startswith("ckptfs."):
                    ours.setdefault(alias.name.removeprefix("ckptfs").lstrip("."), node.lineno)
                else:
                    outside.setdefault(alias.name.split(".")[0], node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = _from_module(name, node)
            if base is None:
                outside.setdefault(node.module.split(".")[0], node.lineno)
                continue
            for alias in node.names:
                candidate = _joined(base, alias.name)
                ours.setdefault(candidate if candidate in MODULES else base, node.lineno)
    ours.pop(name, None)
    return ours, outside


# -- layers ------------------------------------------------------------------------------------


def package_of(name: str) -> str | None:
    """The package a module belongs to ("store" for store.s3 and store/__init__), None for a
    module directly under ckptfs/ (errors, api, the package itself)."""
    if "." in name or (name and MODULES[name].name == "__init__.py"):
        return name.split(".")[0]
    return None


def rank(name: str) -> int | None:
    """The LAYERS row of the most specific entry naming ``name`` (itself, else its package)."""
    for key in (name, package_of(name)):
        for row, (_, entries) in enumerate(LAYERS):
            if key is not None and key in entries:
                return row
    return None


def sub_rank(name: str) -> int | None:
    for row, entries in enumerate(SUBLAYERS.get(package_of(name) or "", ())):
        if name in entries:
            return row
    return None


def may_import(importer: str, imported: str) -> bool:
    if rank(imported) < rank(importer):
        return True
    package = package_of(importer)
    if rank(imported) > rank(importer) or package is None or package_of(imported) != package:
        return False
    if package in SUBLAYERS:
        return sub_rank(imported) < sub_rank(importer)
    return True  # any module of its own package (test_no_import_cycles keeps them in an order)


def describe_place(name: str) -> str:
    text = f"{name or 'ckptfs'}: " + LAYERS[rank(name)][0].split(":")[0]
    if sub_rank(name) is not None:
        text += f", row {sub_rank(name)} of SUBLAYERS[{package_of(name)!r}]"
    return text


def test_the_parser_sees_known_imports():
    # (a guard against this test going blind: these imports exist today)
    assert {"model.namespace", "fuse.openers", "errors"} <= imports("fuse.ops")[0].keys()
    assert "fusewire.face" in imports("fuse.ops")[0] and "fusewire.session" in imports("daemon.run")[0]
    assert "boto3" in imports("store.s3_client")[1]
    assert {"store.s3_client", "store.s3_multipart", "store.base"} <= imports("store.s3")[0].keys()
    assert {"store.local", "store.s3", "store.base"} <= imports("store")[0].keys()  # (inside open_store)
    assert {"cli.mount", "cli.control", "cli.catalog", "cli.verify"} <= imports("cli.main")[0].keys()
    assert {"api", "admin.catalog"} <= imports("")[0].keys()
    assert "cli.main" in imports("__main__")[0]
    assert {"model.tree", "model.commits", "cache.journal"} <= imports("model.namespace")[0].keys()


def test_every_module_has_a_layer():
    unplaced = sorted(name for name in MODULES if rank(name) is None)
    assert not unplaced, f"place {unplaced} in a row of tests/test_layering.py LAYERS"
    for package in SUBLAYERS:
        unordered = sorted(n for n in MODULES if package_of(n) == package and sub_rank(n) is None)
        assert not unordered, f"place {unordered} in a row of tests/test_layering.py SUBLAYERS[{package!r}]"
    named = {entry for _, entries in LAYERS for entry in entries}
    named |= {entry for rows in SUBLAYERS.values() for entries in rows for entry in entries}
    packages = {package_of(n) for n in MODULES}
    stale = sorted(entry for entry in named if entry not in MODULES and entry not in packages)
    assert not stale, f"LAYERS or SUBLAYERS name what ckptfs/ no longer has: {stale}"


@pytest.mark.parametrize("name", sorted(MODULES), ids=lambda name: name or "ckptfs")
def test_imports_go_down_the_layers(name):
    if rank(name) is None:
        pytest.skip("not placed (test_every_module_has_a_layer)")
    ours = imports(name)[0]
    upward = sorted(
        target
        for target in ours
        if target in MODULES and rank(target) is not None and not may_import(name, target)
    )
    assert not upward, (
        f"{where(name)} ({describe_place(name)}) imports "
        + ", ".join(f"{describe_place(t)} (line {ours[t]})" for t in upward)
        + ": only lower layers may be imported"
    )


def test_no_import_cycles():
    graph = {name: sorted(t for t in imports(name)[0] if t in MODULES) for name in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(name: str) -> None:  # Tarjan's strongly connected components
        index[name] = low[name] = len(index)
        stack.append(name)
        for target in graph[name]:
            if target not in index:
                visit(target)
                low[name] = min(low[name], low[target])
            elif target in stack:
                low[name] = min(low[name], index[target])
        if low[name] == index[name]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == name:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for name in graph:
        if name not in index:
            visit(name)
    described = []
    for component in cycles:  # one cycle through each: the shortest way from its first module back
        start = component[0]
        paths = {target: [start, target] for target in graph[start] if target in component}
        while start not in paths:
            paths = {
                target: path + [target]
                for path in paths.values()
                for target in graph[path[-1]]
                if target in component and target not in paths
            } | paths
        cycle = paths[start]
        steps = [f"{where(a)}:{imports(a)[0][b]}" for a, b in zip(cycle, cycle[1:])]
        described.append(" -> ".join(steps + [where(start)]))
    assert not cycles, "import cycles among ckptfs modules (file:line of each import): " + " | ".join(
        described
    )


# -- inheritance across modules ----------------------------------------------------------------


@cache
def bindings(name: str) -> dict[str, tuple[str, str | None]]:
    """What the names module ``name`` imports from ckptfs stand for: (module, None) for a module,
    (module, attribute) for a name of one."""
    bound: dict[str, tuple[str, str | None]] = {}
    for node in ast.walk(parsed(name)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "ckptfs" or alias.name.startswith("ckptfs."):
                    if alias.asname:
                        bound[alias.asname] = (alias.name.removeprefix("ckptfs").lstrip("."), None)
                    else:
                        bound["ckptfs"] = ("", None)
        elif isinstance(node, ast.ImportFrom) and (base := _from_module(name, node)) is not None:
            for alias in node.names:
                candidate = _joined(base, alias.name)
                local = alias.asname or alias.name
                bound[local] = (candidate, None) if candidate in MODULES else (base, alias.name)
    return bound


@cache
def classes(name: str) -> dict[str, ast.ClassDef]:
    return {node.name: node for node in parsed(name).body if isinstance(node, ast.ClassDef)}


def resolve_class(module: str, name: str, depth: int = 0) -> tuple[str, str] | None:
    """(module, class) that ``name`` in ``module`` is, following re-exports; None if not a class."""
    if name in classes(module):
        return module, name
    bound = bindings(module).get(name)
    if bound is None or bound[1] is None or depth > 10:
        return None
    return resolve_class(bound[0], bound[1], depth + 1)


def resolve_base(module: str, expr: ast.expr) -> tuple[str, str] | None:
    """The ckptfs class a base-class expression of ``module`` names (Name or dotted Attribute)."""
    dotted = []
    while isinstance(expr, ast.Attribute):
        dotted.insert(0, expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name):
        return None
    if not dotted:
        return resolve_class(module, expr.id)
    bound = bindings(module).get(expr.id)
    if bound is None or bound[1] is not None:
        return None
    target = bound[0]
    while len(dotted) > 1 and _joined(target, dotted[0]) in MODULES:
        target = _joined(target, dotted.pop(0))
    return resolve_class(target, dotted[0]) if len(dotted) == 1 else None


def bases(cls: tuple[str, str]) -> list[tuple[str, str]]:
    module, name = cls
    found = (resolve_base(module, expr) for expr in classes(module)[name].bases)
    return [base for base in found if base is not None]


def lineage(cls: tuple[str, str]) -> list[tuple[str, str]]:
    """``cls`` and all its ckptfs ancestors."""
    out = [cls]
    for base in bases(cls):
        out += [c for c in lineage(base) if c not in out]
    return out


def declared(cls: tuple[str, str]) -> set[str]:
    """The attributes a class defines: methods (abstract ones too), class attributes, and
    what its methods assign to ``self.``."""
    names = set()
    for node in ast.walk(classes(cls[0])[cls[1]]):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)  # (also a method's locals: more declared means fewer findings)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                names.add(node.attr)
    return names


def read(cls: tuple[str, str]) -> dict[str, int]:
    """``self.x`` / ``cls.x`` the class reads (or calls), with the first line."""
    found: dict[str, int] = {}
    for node in ast.walk(classes(cls[0])[cls[1]]):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                found.setdefault(node.attr, node.lineno)
    return found


def inheritance_across_modules() -> list[tuple[tuple[str, str], tuple[str, str]]]:
    """(class, base) pairs where the base is a ckptfs class of another module."""
    pairs = []
    for module in MODULES:
        for name in classes(module):
            pairs += [((module, name), base) for base in bases((module, name)) if base[0] != module]
    return pairs


def show(cls: tuple[str, str]) -> str:
    return f"{where(cls[0])}:{classes(cls[0])[cls[1]].lineno} {cls[1]}"


def test_the_class_reader_sees_known_bases():
    # (a guard against the test below going blind: these classes exist today)
    assert bases(("store.s3", "S3Store")) == [("store.base", "ObjectStore")]
    assert bases(("objects.logical_store", "LogicalStore")) == [("store.base", "ObjectStore")]
    assert ("errors", "ControlError") in bases(("control.client", "NoDaemon"))
    assert lineage(("store.local", "LocalStore")) == [
        ("store.local", "LocalStore"),
        ("store.base", "ObjectStore"),
    ]
    assert {"head", "put", "list"} <= declared(("store.base", "ObjectStore"))
    assert "client" in read(("store.s3_multipart", "S3Multipart"))
    for cls in ALLOWED_BASES:
        assert cls[1] in classes(cls[0]), f"{cls} (ALLOWED_BASES) is gone: remove it"
    for cls in ALLOWED_BASES:  # interfaces only: an ABC or a Protocol, or an exception of errors.py
        direct = {ast.unparse(base).split(".")[-1] for base in classes(cls[0])[cls[1]].bases}
        assert cls[0] == "errors" or direct & {"ABC", "Protocol"}, f"{cls} is no ABC or Protocol"


def test_no_mixins_across_modules():
    """A class may inherit from a class of another ckptfs module only if that is an interface or
    an exception (ALLOWED_BASES); and no such base reads or calls what only its subclasses define
    (a mixin in disguise). Compose instead: pass the object, keep it in an attribute (as each
    store holds its client or tree and its multipart uploads)."""
    found = []
    for cls, base in inheritance_across_modules():
        if base not in ALLOWED_BASES:
            found.append(
                f"{show(cls)} inherits {show(base)}: a mixin (another module's class that is "
                "not an interface: ALLOWED_BASES)"
            )
        below = set().union(*(declared(c) for c in lineage(base)))
        above = set().union(*(declared(c) for c in lineage(cls) if c not in lineage(base)))
        for ancestor in lineage(base):
            callbacks = {attr: line for attr, line in read(ancestor).items() if attr in above - below}
            if callbacks:
                found.append(
                    f"{show(ancestor)} reads what only its subclass {cls[1]} defines: "
                    + ", ".join(f"self.{a} (line {line})" for a, line in sorted(callbacks.items()))
                )
    assert not found, "\n".join(sorted(set(found)))


def test_no_class_reads_the_privates_of_what_it_holds():
    """Composition without reaching in: a class calls what the objects it holds offer, never
    their private attributes (``self.tree._xattrs``): a collaborator's state stays its own."""
    found = []
    for module in MODULES:
        for node in ast.walk(parsed(module)):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and isinstance(node.value, ast.Attribute)
                and isinstance(node.value.value, ast.Name)
                and node.value.value.id in ("self", "cls")
            ):
                found.append(f"{where(module)}:{node.lineno} {ast.unparse(node)}")
    assert not found, "reads of a held object's private attributes: " + ", ".join(found)


# -- what importing loads ------------------------------------------------------------------------


def test_no_module_imports_pyfuse3():
    users = {name for name in MODULES if "pyfuse3" in imports(name)[1]}
    assert users <= PYFUSE3_ALLOWED, (
        f"pyfuse3 imported outside {sorted(PYFUSE3_ALLOWED)}: {sorted(users - PYFUSE3_ALLOWED)}"
    )


def test_only_the_s3_store_imports_boto3():
    users = {name: sorted(imports(name)[1].keys() & S3_LIBRARIES) for name in MODULES}
    assert {name: libs for name, libs in users.items() if libs and name not in S3_ALLOWED} == {}


def test_the_package_and_the_lower_layers_load_neither_at_import():
    """In a fresh interpreter: `import ckptfs`, the CLI and every other module (bar the S3 store)
    load neither pyfuse3 nor an S3 library."""
    light = sorted(
        name for name in MODULES if name and name != "__main__" and name not in S3_ALLOWED | PYFUSE3_ALLOWED
    )
    assert {"cli.main", "model.namespace", "daemon.wiring", "store"} <= set(light)
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


def test_the_command_line_starts_without_trio_or_numpy():
    """Every `ckptfs` command pays for what `import ckptfs.cli.main` loads (the tests call it
    hundreds of times): the event loop and numpy load only in the commands that use them."""
    code = (
        "import sys, ckptfs.cli.main\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'trio', 'numpy', 'pyfuse3', 'boto3'}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"loaded by the CLI at import: {done.stdout.strip()}"
