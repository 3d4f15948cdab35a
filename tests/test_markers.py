"""The test layers of tests/conftest.py: a test module wholly of one layer declares it
(``pytestmark = pytest.mark.unit``, or store, e2e, both of those), an explicit mark wins, and the
guess from what a test reaches is the fallback for the modules that mix layers.

Collects (does not run) the suite in a fresh pytest and reads, for each test, the layer marks
it had before tests/conftest.py's hook, what the guess says and the marks it ends up with.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from tests import conftest
from tests.support.mounting import Mount

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent

PLUGIN = """
import json

LAYERS = ("unit", "store", "e2e")
declared = {}


def pytest_itemcollected(item):  # before any pytest_collection_modifyitems
    declared[item.nodeid] = [m for m in LAYERS if item.get_closest_marker(m)]


def pytest_collection_finish(session):
    conftest = next(p for p in session.config.pluginmanager.get_plugins() if hasattr(p, "_layers_of"))
    targets = conftest._reach_targets()
    for item in session.items:
        kinds = conftest._layers_of(item, targets)
        module_marks = getattr(item.module, "pytestmark", [])
        module_marks = module_marks if isinstance(module_marks, list) else [module_marks]
        print("LAYERS", json.dumps({
            "nodeid": item.nodeid,
            "final": sorted(m for m in LAYERS + ("slow",) if item.get_closest_marker(m)),
            "guess": sorted((({"store", "e2e"} & kinds) or {"unit"}) | ({"slow"} & kinds)),
            "declared": declared[item.nodeid],
            "module": sorted(m.name for m in module_marks if m.name in LAYERS),
        }))
"""

# The marks some tests of this suite get, known by reading them.
EXPECTED = {
    "tests/test_store.py::test_put_get_head_with_metadata[local]": "unit",
    "tests/test_store.py::test_put_get_head_with_metadata[s3]": "store",  # the `store` fixture's s3 param
    "tests/test_store.py::test_s3_prefix_isolation": "store",  # request.getfixturevalue("s3_server")
    "tests/test_store.py::test_s3_unreachable_is_transient_and_fast": "unit",  # no server needed
    "tests/test_e2e.py::test_directory_rename[local]": "e2e",
    "tests/test_e2e.py::test_directory_rename[s3]": "e2e,store",
    "tests/test_e2e.py::test_writers_larger_than_the_cache_flow_at_the_upload_rate[local]": "e2e,slow",  # LONG
    "tests/test_reads.py::test_file_evicted_mid_read": "e2e,store",  # Mount through module helpers
    "tests/test_faultproxy.py::test_classify": "unit",
    "tests/test_faultproxy.py::test_delay": "store",  # the proxy fixture
    "tests/test_reference_model.py::test_model": "e2e,slow",  # a subclass of Mount in a state machine
    "tests/test_crash_torture.py::test_crash_torture[roomy]": "e2e,slow,store",
    "tests/test_fetcher_unit.py::test_readers_of_one_block_share_one_fetch": "unit",
    "tests/test_markers.py::test_an_explicit_layer_mark_wins_over_the_guess": "unit",  # this module's mark
}
# What the guess alone says of some tests of modules that declare their layer: it still holds
# for them (the guess is no worse for it), except where a mark is there to overrule it.
GUESSED = {
    "tests/test_reference_model.py::test_model": "e2e,slow",
    "tests/test_fetcher_unit.py::test_readers_of_one_block_share_one_fetch": "unit",
    "tests/test_swift_server.py::test_multipart_upload": "store",
    "tests/test_markers.py::test_an_explicit_layer_mark_wins_over_the_guess": "e2e",  # names a Mount
}
VALID = ({"unit"}, {"store"}, {"e2e"}, {"e2e", "store"})  # a layer each; unit never with another


@pytest.fixture(scope="module")
def collected(tmp_path_factory) -> dict[str, dict]:
    probe = tmp_path_factory.mktemp("probe")
    (probe / "layers_probe.py").write_text(PLUGIN)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "layers_probe",
            "--collect-only",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env={**_env(), "PYTHONPATH": str(probe)},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    tests = [
        json.loads(line.removeprefix("LAYERS "))
        for line in done.stdout.splitlines()
        if line.startswith("LAYERS ")
    ]
    assert len(tests) > 100, done.stdout[-2000:]
    return {test["nodeid"]: test for test in tests}


def test_layers_are_assigned_from_what_each_test_reaches(collected):
    def marks(key: str, nodeids: dict[str, str]) -> dict[str, str | None]:
        return {n: ",".join(collected[n][key]) if n in collected else None for n in nodeids}

    assert marks("final", EXPECTED) == EXPECTED
    assert marks("guess", GUESSED) == GUESSED


def test_a_declared_layer_wins_and_the_guess_fills_in_the_rest(collected):
    for nodeid, test in collected.items():
        layers = set(test["final"]) - {"slow"}
        assert layers == (set(test["declared"]) or set(test["guess"]) - {"slow"}), (nodeid, test)
        assert layers in VALID, (nodeid, test)
        assert ("slow" in test["final"]) >= ("slow" in test["guess"]), (nodeid, test)  # slow is still guessed


def test_a_module_wholly_of_one_layer_declares_it(collected):
    """The guess is for the modules that mix layers: one whose tests all get the same layers
    says so with `pytestmark`, and a module's mark matches what its tests get."""
    layers_of: dict[str, set[tuple[str, ...]]] = defaultdict(set)
    declared: dict[str, tuple[str, ...]] = {}
    for nodeid, test in collected.items():
        module = nodeid.split("::")[0]
        layers_of[module].add(tuple(m for m in test["final"] if m != "slow"))
        declared[module] = tuple(test["module"])
    undeclared = sorted(m for m, layers in layers_of.items() if len(layers) == 1 and not declared[m])
    assert not undeclared, (
        "these modules' tests are all of one layer: give each a module-level pytestmark "
        + ", ".join(f"{m} ({'+'.join(next(iter(layers_of[m])))})" for m in undeclared)
    )
    mixed = sorted(m for m, layers in layers_of.items() if len(layers) > 1 and declared[m])
    assert not mixed, f"a module-level layer mark, yet tests of other layers: {mixed}"


# -- the hook on its own ---------------------------------------------------------------------------


class _Item:
    """What tests/conftest.py's hook reads of a collected test."""

    def __init__(self, function, *marks: str):
        self.function = function
        self.fixturenames: list[str] = []
        self.marks = {name: getattr(pytest.mark, name).mark for name in marks}

    def get_closest_marker(self, name: str):
        return self.marks.get(name)

    def add_marker(self, name: str) -> None:
        self.marks[name] = getattr(pytest.mark, name).mark


def _writes_through_a_mount(tmp_path: Path) -> None:  # (never called: read by the guess)
    with open(Mount("file:///nowhere", tmp_path).path / "f", "wb"):
        pass


def test_an_explicit_layer_mark_wins_over_the_guess():
    guessed = _Item(_writes_through_a_mount)
    declared = _Item(_writes_through_a_mount, "unit")
    slow = _Item(_writes_through_a_mount, "store")
    slow.marks["timeout"] = pytest.mark.timeout(900).mark  # 10 minutes or more: slow
    conftest.pytest_collection_modifyitems(None, [guessed, declared, slow])
    assert set(guessed.marks) == {"e2e"}
    assert set(declared.marks) == {"unit"}
    assert set(slow.marks) == {"store", "timeout", "slow"}  # declared store, guessed slow


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
