"""ckptfs: a FUSE filesystem for AI training checkpoints.

The Python API for training scripts (see docs/admin.md, "Python API"); importing ckptfs loads
none of the daemon's libraries (no boto3, no pyfuse3).
"""

from .api import NotACkptfsMount, SyncResult, mount_of, state, sync, wait_durable
from .errors import CkptfsError, TimedOut

# ckptfs.checkpoints(url): the checkpoint series of a store or mount (its own module, added
# with `ckptfs checkpoints`), re-exported here:
# from .checkpoints import checkpoints

__all__ = ["CkptfsError", "NotACkptfsMount", "SyncResult", "TimedOut", "mount_of", "state", "sync", "wait_durable"]
