"""The errno boundary of the FUSE glue: what each kind of exception from the namespace becomes.

fuse_ops has no mapping function to call (issue 16 asks for one ``to_errno()``); the mapping
lives in the decorator ``_errno_boundary`` that wraps every handler, so this tests the
decorator on a handler of its own: FsError keeps its errno, an OSError keeps its errno (EIO
when it has none), FUSEError passes through, anything else (a StoreError included) is EIO and
never escapes (an exception escaping a handler would take the whole mount down).
"""

from __future__ import annotations

import errno
import logging

import pyfuse3
import pytest
import trio

from ckptfs.errors import FsError
from ckptfs.fuse_ops import _errno_boundary
from ckptfs.store.base import NotFound, StoreError


def answer(exc: BaseException) -> int:
    """The errno a handler raising ``exc`` answers the kernel with."""
    @_errno_boundary
    async def handler():
        raise exc

    with pytest.raises(pyfuse3.FUSEError) as raised:
        trio.run(handler)
    return raised.value.errno


@pytest.mark.parametrize("number", [errno.ENOENT, errno.ENOSPC, errno.ENAMETOOLONG, errno.EROFS, errno.EIO,
                                    pyfuse3.ENOATTR])
def test_fs_error_keeps_its_errno(number):
    assert answer(FsError(number, "why")) == number


def test_os_error_keeps_its_errno_or_is_eio():
    assert answer(OSError(errno.ENOSPC, "disk full")) == errno.ENOSPC
    assert answer(PermissionError(errno.EACCES, "no")) == errno.EACCES
    assert answer(OSError("no errno")) == errno.EIO


def test_fuse_error_passes_through():
    assert answer(pyfuse3.FUSEError(errno.EXDEV)) == errno.EXDEV


@pytest.mark.parametrize("exc", [RuntimeError("bug"), KeyError("k"), AssertionError("broken invariant"),
                                 StoreError("throttled", transient=True, errno_=errno.EAGAIN),
                                 NotFound("gone")])
def test_anything_else_is_eio_and_logged(exc, caplog):
    # A StoreError's own errno is not used here today: the namespace turns store failures into
    # FsError before they reach the boundary; one that does not is a bug, answered EIO.
    with caplog.at_level(logging.ERROR, logger="ckptfs.fuse_ops"):
        assert answer(exc) == errno.EIO
    assert "handler failed unexpectedly" in caplog.text


def test_a_handler_that_returns_is_untouched():
    @_errno_boundary
    async def handler(x, y=0):
        return x + y

    assert trio.run(lambda: handler(2, y=3)) == 5
    assert handler.__name__ == "handler"


# Handlers left outside the boundary: they only drop local state or raise FUSEError themselves.
# (forget calls the namespace; pyfuse3 logs what escapes it, as forget has no reply.)
UNGUARDED = {"forget", "releasedir", "fsyncdir", "setxattr", "removexattr"}


def test_every_other_request_handler_is_behind_the_boundary():
    from ckptfs.fuse_ops import Operations

    handlers = {name for name, fn in vars(Operations).items()
                if callable(fn) and not name.startswith("_") and hasattr(pyfuse3.Operations, name)}
    assert len(handlers) > 20
    assert {name for name in handlers if not hasattr(vars(Operations)[name], "__wrapped__")} == UNGUARDED
