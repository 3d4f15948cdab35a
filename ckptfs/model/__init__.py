"""The filesystem model behind ``ckptfs.model.namespace.Namespace`` (see docs/architecture.md):

- ``tree``: inodes, the tree, open handles, store key codec and name checks;
- ``policy``: which cached bytes may go (the latest checkpoint, clean files, sent blocks);
- ``commits``: the only writer of journal ops and submitter to the uploader; fsync shadows;
- ``startup``: the tree from the store's listing plus the journal's pending ops;
- ``refresh``: what other mounts made durable (listings, a negative cache, single flight);
- ``files`` and ``dirs``: the operations the kernel asks for.
"""
