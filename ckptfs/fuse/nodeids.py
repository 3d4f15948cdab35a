"""The kernel's node ids for the namespace's inodes, and the kernel's passthrough rules.

Mostly a node id is the inode number. Passthrough binds a kernel inode to one backing file
while any passthrough open of it lasts, and the kernel then refuses every other open of it
(EIO): a writer's open, or a reader of a newer version. So such an open is answered ESTALE and
the node id *retired*: the kernel looks the name up again (open(2) retries a stale answer once
with a fresh lookup) and the lookup hands out a new node id, an alias of the same inode, on which
the open proceeds. Readers already in keep the version they opened. Only the current node id of
an inode gets opens other than passthrough opens of the file it is bound to, so its page cache
is the only one the namespace's keep-cache decisions describe.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass

ALIAS_BASE = 1 << 56  # aliases never meet the namespace's own inode numbers


@dataclass
class Bound:
    """A node id bound to a backing file: its passthrough opens, the file's identity, and a
    descriptor of it of our own (its size: what those opens read and map)."""

    opens: int
    identity: tuple[int, int]
    fd: int = -1


def identity(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


class NodeIds:
    def __init__(self):
        self.current: dict[int, int] = {}  # ino -> the node id lookups hand out (absent: the ino)
        self.alias_ino: dict[int, int] = {}  # alias -> ino
        self.alias_lookups: Counter[int] = Counter()  # alias -> lookups the kernel holds
        self.next_alias = ALIAS_BASE
        self.cached_opens: Counter[int] = Counter()  # node id -> opens through its page cache
        self.bound: dict[int, Bound] = {}  # node id -> its backing file, while passthrough opens last
        self.opened: dict[int, tuple[int, str]] = {}  # fh -> (node id, "cached" | "passthrough" | "direct")

    def ino(self, nodeid: int) -> int:
        return self.alias_ino.get(nodeid, nodeid)

    def for_ino(self, ino: int) -> int:
        """The node id an entry of ``ino`` carries now."""
        return self.current.get(ino, ino)

    def handed_out(self, nodeid: int) -> None:
        """The kernel took an entry with ``nodeid`` (a lookup it will forget)."""
        if nodeid in self.alias_ino:
            self.alias_lookups[nodeid] += 1

    def forgot(self, nodeid: int, count: int) -> int:
        """The kernel forgot ``count`` lookups of ``nodeid``: the inode they were of."""
        ino = self.ino(nodeid)
        if nodeid in self.alias_ino:
            self.alias_lookups[nodeid] -= count
            if self.alias_lookups[nodeid] <= 0 and self.current.get(ino) != nodeid:
                del self.alias_ino[nodeid], self.alias_lookups[nodeid]
        return ino

    def retire(self, nodeid: int) -> None:
        """Lookups of its inode get a new node id from now on."""
        ino = self.ino(nodeid)
        if self.for_ino(ino) != nodeid:
            return
        alias = self.next_alias
        self.next_alias += 1
        old = self.current.get(ino)
        self.current[ino] = alias
        self.alias_ino[alias] = ino
        if old is not None and self.alias_lookups[old] <= 0:
            del self.alias_ino[old], self.alias_lookups[old]

    def open_refused(self, nodeid: int, passthrough_fd: int | None) -> bool:
        """Whether the kernel could not serve this open on ``nodeid`` (answer ESTALE and retire
        it): the node id is bound to another file (a reader's version, a writer's working file),
        or is no longer current and the open would go through its page cache."""
        bound = self.bound.get(nodeid)
        if bound is not None:
            return passthrough_fd is None or identity(passthrough_fd) != bound.identity
        return nodeid != self.for_ino(self.ino(nodeid)) and passthrough_fd is None

    def kept_size(self, nodeid: int) -> int | None:
        """A retired node id whose passthrough readers keep an older version: that version's size
        (what they read and map), else None."""
        bound = self.bound.get(nodeid)
        if bound is None or nodeid == self.for_ino(self.ino(nodeid)):
            return None
        return os.fstat(bound.fd).st_size

    def may_bind(self, nodeid: int) -> bool:
        """Passthrough needs a node id with no open through its page cache."""
        return self.cached_opens[nodeid] == 0

    def opened_with(self, fh: int, nodeid: int, kind: str, fd: int | None = None) -> None:
        self.opened[fh] = (nodeid, kind)
        if kind == "cached":
            self.cached_opens[nodeid] += 1
        elif kind == "passthrough":
            assert fd is not None
            bound = self.bound.get(nodeid)
            if bound is None:
                bound = self.bound[nodeid] = Bound(0, identity(fd), os.dup(fd))
            bound.opens += 1

    def released(self, fh: int) -> None:
        nodeid, kind = self.opened.pop(fh, (0, ""))
        if kind == "cached":
            self.cached_opens[nodeid] -= 1
            if self.cached_opens[nodeid] <= 0:
                del self.cached_opens[nodeid]
        elif kind == "passthrough":
            bound = self.bound[nodeid]
            bound.opens -= 1
            if bound.opens <= 0:
                del self.bound[nodeid]
                os.close(bound.fd)

    def passthrough_refused(self, fh: int) -> None:
        """The kernel took a passthrough answer as a cached open (passthrough was refused)."""
        nodeid, kind = self.opened.get(fh, (0, ""))
        if kind == "passthrough":
            self.released(fh)
            self.opened_with(fh, nodeid, "cached")
