"""Object stores: pick one from a URL.

``open_store`` only builds the store (no network I/O); call ``store.check()`` to find out
whether it can be used (missing bucket, wrong credentials, unreachable endpoint).
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

from ckptfs.errors import StoreError
from ckptfs.store.base import ObjectStore
from ckptfs.store.base import redact_url as _redact

# botocore signs with the AWS CRT whenever awscrt is importable (ckptfs installs it for CRC32C
# alone): measured here, the daemon's RSS while uploading 8 MiB parts went from 210 to 326 MiB
# (tests/test_e2e.py backpressure test). botocore's own signer is kept unless the user chose.
# Set here, the package's first line run, so no module of the S3 store can import botocore first.
os.environ.setdefault("BOTO_DISABLE_CRT", "true")

# Loose on purpose: AWS wants 3-63 lowercase chars, but Swift, Ceph and MinIO allow more.
_BUCKET = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}\Z")
_USAGE = "use s3://bucket[/prefix] or file:///path"


def open_store(url: str | None, endpoint_url: str | None = None, max_connections: int = 16) -> ObjectStore:
    """The store for ``url``: s3://bucket[/prefix], file:///path, or None/"" for the embedded local store."""
    if not url:
        if endpoint_url:
            raise StoreError("--endpoint-url needs an s3:// store URL", errno_=errno.EINVAL)
        from ckptfs.config import default_store_dir
        from ckptfs.store.local import LocalStore

        return LocalStore.at(default_store_dir())
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if sep and scheme == "file":
        if endpoint_url:
            raise StoreError("--endpoint-url needs an s3:// store URL", errno_=errno.EINVAL)
        parts = urlsplit(url)
        if (
            parts.netloc not in ("", "localhost")
            or not parts.path.startswith("/")
            or "\0" in unquote(parts.path)
        ):
            raise StoreError(
                f"bad store URL {_redact(url)!r}: a file URL needs an absolute path, as in file:///path",
                errno_=errno.EINVAL,
            )
        from ckptfs.store.local import LocalStore

        return LocalStore.at(Path(unquote(parts.path)))
    if sep and scheme == "s3":
        bucket, _, prefix = rest.partition("/")
        if "@" in bucket:
            raise StoreError(
                f"bad store URL {_redact(url)!r}: do not put credentials in the URL; "
                "use the AWS credential chain (AWS_ACCESS_KEY_ID, profiles)",
                errno_=errno.EINVAL,
            )
        if not _BUCKET.match(bucket):
            raise StoreError(
                f"bad bucket name {bucket!r} in store URL {_redact(url)!r}: {_USAGE}", errno_=errno.EINVAL
            )
        if endpoint_url is not None and re.match(r"[^/]*//[^/?#]*@", endpoint_url):  # (S3 signs requests: no
            # use for them, and the daemon's command line, which anyone on the node can read, would show them)
            raise StoreError(
                f"bad endpoint URL {_redact(endpoint_url)!r}: do not put credentials in the URL; "
                "use the AWS credential chain (AWS_ACCESS_KEY_ID, profiles)",
                errno_=errno.EINVAL,
            )
        if endpoint_url is not None and not re.match(r"https?://[^/\s]+", endpoint_url):
            raise StoreError(
                f"bad endpoint URL {_redact(endpoint_url)!r}: use http://host:port or https://host",
                errno_=errno.EINVAL,
            )
        from ckptfs.store.s3 import S3Store  # imports boto3 (slow): only when needed

        return S3Store.connect(bucket, prefix, endpoint_url=endpoint_url, max_connections=max_connections)
    raise StoreError(f"unsupported store URL {_redact(url)!r}: {_USAGE}", errno_=errno.EINVAL)
