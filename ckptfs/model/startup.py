"""Start-up: the tree is the store's listing with the journal's pending ops laid over it.

The store is the source of truth; what the last run journaled but did not finish is replayed
on top, in order, and handed back to the uploader.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from ckptfs.cache.clean_index import CleanEntry
from ckptfs.cache.contents import Content
from ckptfs.cache.journal import ATTR, DELETE, MKDIR, MOVE, PUT, Op
from ckptfs.model.commits import Commits
from ckptfs.model.tree import (
    apply_attr_metadata,
    release_blocks,
    show_store_version,
    split_key,
    store_content,
)
from ckptfs.objects import integrity
from ckptfs.store.base import ObjectInfo, PartInfo
from ckptfs.transfer.upload_tasks import Upload

log = logging.getLogger(__name__)


def load(
    commits: Commits,
    listing: Iterable[ObjectInfo],
    pending: list[Op],
    clean: dict[str, CleanEntry] | None = None,
) -> None:
    """The store's listing, then the journal's pending ops on top (in order). ``clean``:
    blocks the last mount left cached, kept for the files the store still holds unchanged."""
    tree, cache = commits.tree, commits.cache
    clean = dict(clean or {})
    for info in listing:
        if integrity.is_reserved(info.key):
            continue  # checksum manifests, not files
        parts = split_key(info.key)
        if parts is None:
            log.warning("not shown: store key %r cannot be a path on the mount", info.key)
            continue
        if info.key.endswith("/"):
            marked = tree.ensure_dir(parts)
            if marked is not None:
                marked.attrs_known = False  # its marker may carry attributes (read at lookup)
            continue
        parent = tree.ensure_dir(parts[:-1])
        if parent is None or parts[-1] in parent.children:
            log.warning("not shown: store key %r clashes with a directory", info.key)
            continue
        content = store_content(cache, info)
        entry = clean.pop(info.key, None)
        if entry is not None and entry.unchanged_in_store(info.size, info.mtime):
            content.blocks, content.verify, content.durable_at = (
                list(entry.blocks),
                entry.digest,
                entry.durable_at,
            )
        elif entry is not None:
            release_blocks(cache, entry.blocks)  # the store has another version now
        show_store_version(tree.add(parent, parts[-1], is_dir=False), content, info)
    for entry in clean.values():  # gone from the store
        release_blocks(cache, entry.blocks)
    for op in pending:
        replay(commits, op)
    now = tree.now()
    for node in tree.root.walk():  # the listing just read covers every directory
        if node.is_dir:
            node.listed_at = now
    commits.retention.loaded([n for n in tree.files() if n.version is not None and n.version.content.verify])


def replay(commits: Commits, op: Op) -> None:
    """One pending op of the last run: into the tree, and to the uploader again."""
    tree, uploader = commits.tree, commits.uploader
    parts = split_key(op.key)
    node = tree.find(parts) if parts is not None else None
    if op.kind == PUT and parts is not None:
        parent = tree.ensure_dir(parts[:-1])
        content = Content(commits.cache, op.size, list(op.blocks))
        if op.upload:  # parts evicted before the crash: readable once the upload completes
            # (its parts by part index: each stands for the blocks its layout gives it)
            layout, bs = uploader.schedule.layout(op.size, op.grown), commits.cache.block_size
            content.remote = {
                block: PartInfo(index + 1, token, op.hashes.get(index, ""))
                for index, token in op.parts.items()
                for block in layout.blocks(index, bs)
                if block < len(content.blocks)
            }
            content.upload = Upload(*op.upload)
        if parent is not None and (node is None or not node.is_dir):
            node = node or tree.add(parent, parts[-1], is_dir=False)
            commits.set_version(node, content, op)
            if op.meta:
                apply_attr_metadata(node, op.meta)
            uploader.submit(op, content, commits.on_durable(node))
            return
        log.error("journal: cannot show %r (a directory is in the way); uploading it anyway", op.key)
        uploader.submit(op, content)
        return
    if op.kind == DELETE and node is not None and (not node.is_dir or not node.children):
        commits.detach(node)
    elif op.kind in (MKDIR, ATTR) and parts is not None:
        target = tree.ensure_dir(parts) if op.kind == MKDIR else node
        if target is not None and op.meta:
            apply_attr_metadata(target, op.meta)
    elif op.kind == MOVE and parts is not None:
        src = tree.find(split_key(op.src) or [])
        parent = tree.ensure_dir(parts[:-1])
        if src is not None and parent is not None and src is not node:
            if node is not None and not node.is_dir:
                commits.detach(node)  # a rename over an existing file
            if parts[-1] not in parent.children:
                tree.move(src, parent, parts[-1])
                node = src
    uploader.submit(op, None, commits.on_moved(node) if op.kind == MOVE else None)
