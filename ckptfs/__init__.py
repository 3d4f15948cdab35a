"""ckptfs: a FUSE filesystem for AI training checkpoints.

The Python API for training scripts (see docs/admin.md, "Python API"); importing ckptfs loads
none of the daemon's libraries (no boto3, no trio).
"""

from ckptfs.api import NotACkptfsMount, SyncResult, mount_of, state, sync, wait_durable
from ckptfs.errors import CkptfsError, TimedOut

__all__ = [
    "CkptfsError",
    "NotACkptfsMount",
    "SyncResult",
    "TimedOut",
    "checkpoints",
    "mount_of",
    "state",
    "sync",
    "wait_durable",
]


def __getattr__(name: str):
    # ckptfs.checkpoints(url_or_mountpoint): the checkpoint series (ckptfs/admin/catalog.py), loaded on
    # first use: the catalog reads stores, which `import ckptfs` alone must not pull in.
    if name == "checkpoints":
        from ckptfs.admin.catalog import checkpoints

        return checkpoints
    raise AttributeError(f"module 'ckptfs' has no attribute {name!r}")
