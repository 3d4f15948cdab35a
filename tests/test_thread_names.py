"""The FUSE reader threads carry their name for the kernel too (`/proc/PID/task/TID/comm`), where
top -H, perf and the bench's node scenario (bench/node_path.py) find them."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from ckptfs.fusewire.session import name_os_thread

pytestmark = pytest.mark.unit


def _comm_of(name: str) -> str:
    seen = {}

    def run():
        name_os_thread(name)
        seen["comm"] = Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return seen["comm"]


def test_the_kernel_sees_the_thread_name():
    assert _comm_of("ckptfs-fuse-3") == "ckptfs-fuse-3"


def test_a_long_name_is_cut_to_15_bytes():
    assert _comm_of("ckptfs-fuse-notify") == "ckptfs-fuse-not"
