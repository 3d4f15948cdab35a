"""Streaming upload of working files the kernel writes itself: tail and verify.

A file open for writing through passthrough (cache/backing.py) is written by the kernel, and
the daemon sees none of its writes: not their offsets, so no change stamps. What it can see is
the file growing. Every ``TAIL_POLL_S`` the ``Tailer`` looks at each such file's size; a block
the size has passed by a whole block more (the writer is past it) is handed to the uploader's
stream of the file as a part, which keeps the xxh3 of the bytes it sent. At the commit every
part sent is read and hashed again (by a store worker where there are some), and one whose
bytes changed since is sent again (``PartSender._adopt_stream``): correct for any write
pattern, at the cost of one read of the streamed bytes at memory speed, after the close (the
close itself waits for none of it).

A file is streamed only once it has been open for ``STREAM_AFTER_S``. The kernel writes at
page-cache speed (a GiB in a fraction of a second), so streaming a shorter save could take at
most that fraction off its time to durable, while its reads, hashes and sends compete with the
writer for the node's CPU and memory: measured on the 2-core VM (`scripts/bench --scenarios
node`), streaming from the first block held one 1 GiB writer to 0.37-0.46x the cache disk's
speed and torch.save to 1.8-2.5x its time, against 0.8-1.15x and 0.95-1.07x without. A long
save (many GiB, or a slow writer) is streamed from then on, as before.

It also counts what the files take on disk against the disk budget as they grow, evicting
clean data when they pass it, and notes a cache disk seen full meanwhile: the writer may have
had ENOSPC, which the daemon never sees, so that file is not committed.
"""

from __future__ import annotations

import time

import trio

from ckptfs.cache.backing import WorkingFile
from ckptfs.model.files import Files
from ckptfs.model.tree import attr_metadata

TAIL_POLL_S = 0.05  # how often the working files' sizes are looked at
STREAM_AFTER_S = 1.0  # a working file is streamed once open this long (the module's docstring)


class Tailer:
    def __init__(self, files: Files):
        self.files = files
        self.cache = files.cache
        self.uploader = files.uploader
        self.streamed_blocks = 0  # blocks handed to streams (status)
        self.stream_after = STREAM_AFTER_S

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await trio.sleep(TAIL_POLL_S)
            self.poll()

    def poll(self) -> None:
        over = False
        now = time.monotonic()
        full = bool(self.files.tailed) and self.cache.disk_nearly_full()
        for writing, node in list(self.files.tailed.items()):
            staged = writing.staged
            assert isinstance(staged, WorkingFile)  # only working files are tailed (Files._writing)
            self.cache.measure_backing(staged.tier)
            over = True
            size = staged.size
            if full and size > writing.polled_size:
                writing.disk_full = True  # (growing on a full disk: a write may have had ENOSPC)
            writing.polled_size = size
            if (
                node.unlinked
                or writing.error
                or writing.frozen
                or now - writing.opened_at < self.stream_after
            ):
                continue
            sealed = size // self.cache.block_size - 1  # (the writer is in the block after)
            while writing.tailed < sealed:
                if writing.stream is None:
                    writing.stream = self.uploader.open_stream(node.key())
                    writing.stream.meta = attr_metadata(node, mtime=False)  # (its mtime: the completion's)
                    writing.stream.verify = True
                ref = staged.block_ref(writing.tailed)
                self.uploader.stream_part(writing.stream, writing.tailed, ref, 0)
                self.cache.decref(ref)  # (the stream holds its own)
                writing.tailed += 1
                self.streamed_blocks += 1
        if over:
            self.cache.room_for_file(0)  # (past the disk budget: clean data goes)
