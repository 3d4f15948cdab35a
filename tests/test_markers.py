"""The automatic test layers of tests/conftest.py, on tests of this suite whose layer is known.

Collects (does not run) a few test files in a fresh pytest and reads the markers each test got.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PLUGIN = """
def pytest_collection_finish(session):
    for item in session.items:
        marks = sorted(m for m in ("unit", "store", "e2e", "slow") if item.get_closest_marker(m))
        print("LAYERS", item.nodeid, ",".join(marks))
"""

EXPECTED = {
    "tests/test_store.py::test_put_get_head_with_metadata[local]": "unit",
    "tests/test_store.py::test_put_get_head_with_metadata[s3]": "store",  # the parametrised `store`
    "tests/test_store.py::test_s3_prefix_isolation": "store",  # request.getfixturevalue("s3_server")
    "tests/test_store.py::test_s3_unreachable_is_transient_and_fast": "unit",  # no server needed
    "tests/test_e2e.py::test_directory_rename[local]": "e2e",
    "tests/test_e2e.py::test_directory_rename[s3]": "e2e,store",
    "tests/test_e2e.py::test_writers_larger_than_the_cache_flow_at_the_upload_rate[local]": "e2e,slow",  # LONG
    "tests/test_reads.py::test_file_evicted_mid_read": "e2e,store",  # Mount through module helpers
    "tests/test_faultproxy.py::test_classify": "unit",
    "tests/test_faultproxy.py::test_delay": "store",  # the proxy fixture
    "tests/test_model.py::test_model": "e2e,slow",  # a subclass of Mount in a state machine
    "tests/test_crash_torture.py::test_crash_torture[roomy]": "e2e,slow,store",
    "tests/test_fetcher_unit.py::test_readers_of_one_block_share_one_fetch": "unit",
}


def test_layers_are_assigned_from_what_each_test_reaches(tmp_path):
    (tmp_path / "layers_probe.py").write_text(PLUGIN)
    files = sorted({nodeid.split("::")[0] for nodeid in EXPECTED})
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
            *files,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env={**_env(), "PYTHONPATH": str(tmp_path)},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    got = dict(
        line.removeprefix("LAYERS ").rsplit(" ", 1)
        for line in done.stdout.splitlines()
        if line.startswith("LAYERS ")
    )
    assert {nodeid: got.get(nodeid) for nodeid in EXPECTED} == EXPECTED
    for nodeid, marks in got.items():  # a layer each; unit never with another layer
        layers = set(marks.split(",")) - {"slow"}
        assert layers in ({"unit"}, {"store"}, {"e2e"}, {"e2e", "store"}), (nodeid, marks)


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
