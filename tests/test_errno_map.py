"""The errno map (``errors.to_errno``) and the FUSE glue's boundary that uses it.

``to_errno``: an FsError and an OSError keep their errno (EIO where an OSError has none); a
StoreError keeps its errno only where a local disk would return the same for the same cause
(store full, too large, name too long, read-only) and is EIO otherwise (NotFound included: the
name is the mount's, the object behind it is what went missing); anything else is EIO;
cancellation and KeyboardInterrupt are raised again, never turned into an errno.

The boundary: every request handler of ``fuse_ops.Operations`` is behind one, since an exception
escaping a handler would reach the transport's safety net unlogged by level; forget, which has
no reply, behind one that raises nothing at all.
"""

from __future__ import annotations

import errno
import logging

import pytest
import trio

from ckptfs.errors import STORE_ERRNOS_KEPT, FsError, NotFound, StoreError, to_errno
from ckptfs.fuse.nodeids import NodeIds
from ckptfs.fuse.ops import Operations, _errno_boundary, _no_reply_boundary
from ckptfs.fusewire.face import ENOATTR, Filesystem, FuseError
from tests.support.harness import trio_test

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "number",
    [errno.ENOENT, errno.ENOSPC, errno.ENAMETOOLONG, errno.EROFS, errno.EIO, errno.EBUSY, ENOATTR],
)
def test_fs_error_keeps_its_errno(number):
    assert to_errno(FsError(number, "why")) == number


def test_os_error_keeps_its_errno_or_is_eio():
    assert to_errno(OSError(errno.ENOSPC, "disk full")) == errno.ENOSPC
    assert to_errno(PermissionError(errno.EACCES, "no")) == errno.EACCES
    assert to_errno(FileNotFoundError(errno.ENOENT, "gone")) == errno.ENOENT
    assert to_errno(OSError("no errno")) == errno.EIO


@pytest.mark.parametrize("number", sorted(STORE_ERRNOS_KEPT))
def test_store_error_keeps_what_a_disk_would_say(number):
    assert to_errno(StoreError("store says so", errno_=number)) == number


@pytest.mark.parametrize(
    "exc",
    [
        NotFound("object gone"),
        StoreError("throttled", transient=True, errno_=errno.EAGAIN),
        StoreError("AccessDenied", errno_=errno.EACCES),
        StoreError("timed out", transient=True, errno_=errno.ETIMEDOUT),
        StoreError("bad request", errno_=errno.EINVAL),
        StoreError("unknown"),
    ],
)
def test_any_other_store_error_is_eio(exc):
    assert to_errno(exc) == errno.EIO


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("bug"),
        KeyError("k"),
        AssertionError("broken invariant"),
        ValueError("v"),
        ExceptionGroup("many", [FsError(errno.ENOSPC)]),
    ],
)
def test_anything_else_is_eio(exc):
    assert to_errno(exc) == errno.EIO


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), SystemExit(3), GeneratorExit()])
def test_what_is_not_a_failure_is_raised_again(exc):
    with pytest.raises(type(exc)):
        to_errno(exc)


@trio_test
async def test_cancellation_is_raised_again():
    with trio.CancelScope() as scope:
        scope.cancel()
        try:
            await trio.sleep(1)
        except trio.Cancelled as cancelled:
            to_errno(cancelled)  # raises it again: the scope absorbs it
            raise AssertionError("to_errno swallowed trio.Cancelled") from None
    assert scope.cancelled_caught


# -- the boundary ----------------------------------------------------------------------------


def answer(exc: BaseException) -> int:
    """The errno a handler raising ``exc`` answers the kernel with."""

    @_errno_boundary
    async def handler():
        raise exc

    with pytest.raises(FuseError) as raised:
        trio.run(handler)
    return raised.value.errno


@pytest.mark.parametrize(
    "exc",
    [
        FsError(errno.ENOSPC),
        OSError(errno.EROFS, "ro"),
        OSError("none"),
        NotFound("gone"),
        StoreError("full", errno_=errno.ENOSPC),
        RuntimeError("bug"),
    ],
)
def test_the_boundary_answers_to_errno(exc):
    assert answer(exc) == to_errno(exc)


def test_fuse_error_passes_through():
    assert answer(FuseError(errno.EXDEV)) == errno.EXDEV


def test_a_bug_is_logged_once_with_its_traceback_at_debug(caplog):
    with caplog.at_level(logging.INFO, logger="ckptfs.fuse.ops"):
        assert answer(RuntimeError("bug")) == errno.EIO
    assert [(r.levelno, bool(r.exc_info)) for r in caplog.records] == [(logging.ERROR, False)]
    assert "handler failed unexpectedly: RuntimeError: bug" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="ckptfs.fuse.ops"):
        assert answer(RuntimeError("bug")) == errno.EIO
    assert len(caplog.records) == 1 and caplog.records[0].exc_info
    assert "Traceback" in caplog.text


def test_expected_refusals_are_not_logged_and_store_errors_are(caplog):
    with caplog.at_level(logging.DEBUG, logger="ckptfs.fuse.ops"):
        answer(FsError(errno.ENOENT))
        answer(FsError(ENOATTR))
        assert not caplog.records
        answer(NotFound("no object 'a/b'"))
    assert [r.levelno for r in caplog.records] == [logging.ERROR]
    assert "no object 'a/b'" in caplog.text


def test_cancellation_passes_the_boundary():
    @_errno_boundary
    async def handler():
        await trio.sleep(1)

    async def main():
        with trio.CancelScope() as scope:
            scope.cancel()
            await handler()  # a FUSEError here would escape the scope and fail the test
        assert scope.cancelled_caught

    trio.run(main)
    with pytest.raises(KeyboardInterrupt):
        answer(KeyboardInterrupt())


def test_a_handler_that_returns_is_untouched():
    @_errno_boundary
    async def handler(x, y=0):
        return x + y

    assert trio.run(lambda: handler(2, y=3)) == 5
    assert handler.__name__ == "handler"


def test_forget_never_raises(caplog):
    class Namespace:  # stands in for the namespace: forget fails on inode 2
        forgotten: list[int] = []

        def forget(self, inode, count):
            if inode == 2:
                raise RuntimeError("bug in forget")
            self.forgotten.append(inode)

    ops = Operations.__new__(Operations)
    ops.ns = Namespace()
    ops.nodes = NodeIds()
    with caplog.at_level(logging.ERROR, logger="ckptfs.fuse.ops"):
        assert ops.forget([(1, 1), (2, 1)]) is None
        assert ops.forget([(3, 1)]) is None
    assert ops.ns.forgotten == [1, 3]
    assert "forget failed unexpectedly: RuntimeError: bug in forget" in caplog.text

    @_no_reply_boundary
    def fails_with_an_errno():
        raise FuseError(errno.EIO)

    assert fails_with_an_errno() is None


def test_every_request_handler_is_behind_a_boundary():
    handlers = {
        name: fn
        for name, fn in vars(Operations).items()
        if callable(fn) and not name.startswith("_") and hasattr(Filesystem, name)
    }
    assert len(handlers) > 20
    assert {name for name, fn in handlers.items() if not hasattr(fn, "__wrapped__")} == set()
    assert {"forget", "entry_sent", "releasedir", "fsyncdir", "setxattr", "removexattr"} <= handlers.keys()


def test_setxattr_and_removexattr_still_refuse():
    ops = Operations.__new__(Operations)
    for call in (
        lambda: ops.setxattr(1, b"user.x", b"v", 0, None),
        lambda: ops.removexattr(1, b"user.x", None),
    ):
        with pytest.raises(FuseError) as raised:
            trio.run(call)
        assert raised.value.errno == errno.ENOTSUP
