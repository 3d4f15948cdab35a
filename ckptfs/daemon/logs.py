"""Logging of the daemon: levels, one handler, and what never reaches a log.

The log of a root daemon on a shared node is read by admins and support tickets: it must never
hold credentials, signatures or checkpoint bytes, at any level. So:

- At every level but TRACE only ckptfs's own lines below WARNING are kept: the libraries under
  us (botocore, boto3, urllib3, s3transfer, awscrt) log every request's signed headers and whole
  bodies at DEBUG; their loggers stay at WARNING.
- TRACE (below DEBUG, ``--log-level trace``) adds the libraries' lines, for debugging the store
  protocol. Even then every line goes through ``Redactor``: byte strings in the arguments (request
  and response bodies) become ``<N bytes>``, headers and URL parameters that carry credentials or
  signatures are masked, and a line is cut at MAX_MESSAGE characters.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import sys
from typing import IO, Any

from ckptfs.errors import MountError

TRACE = 5
LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR")
LIBRARIES = ("botocore", "boto3", "urllib3", "s3transfer", "awscrt")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
MAX_MESSAGE = 16 << 10  # characters of one log line, traceback aside
MASK = "***"

logging.addLevelName(TRACE, "TRACE")

# Names whose value is a credential or a signature, as HTTP headers, URL parameters, dict keys
# or config settings: `Authorization: ...`, `'X-Amz-Security-Token': b'...'`, `password=...`.
_SECRET_NAMES = (
    r"authorization|proxy-authorization|x-amz-security-token|x-amz-signature|x-amz-credential"
    r"|x-amz-server-side-encryption-customer-key(?:-md5)?|aws_secret_access_key|secret_access_key"
    r"|secretaccesskey|aws_session_token|sessiontoken|session_token|security_token|password|passwd"
    r"|secret_key|secret"
)
_NAMED_SECRET = re.compile(
    rf"""(?ix)
    (?P<name>\b(?:{_SECRET_NAMES}))
    (?P<sep>['"]?\s*[:=]\s*)
    (?P<value>b?'[^']*'|b?"[^"]*"|[^\s,;&'"}})\]]+)
    """
)
_SIGV4_FIELD = re.compile(r"(?i)\b(Credential|Signature)=[^\s,&'\"]+")  # inside an Authorization value
_SIGNATURE_LINE = re.compile(r"(?i)(Signature:\s*)[0-9a-f]{16,}")  # botocore.auth's "Signature:\n<hex>"
_URL_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@'\"]+@")


def redact(text: str, secrets: tuple[str, ...] = ()) -> str:
    """``text`` with credentials, signatures and URL passwords masked."""
    for secret in secrets:
        text = text.replace(secret, MASK)
    text = _NAMED_SECRET.sub(lambda m: m["name"] + m["sep"] + MASK, text)
    text = _SIGV4_FIELD.sub(lambda m: f"{m[1]}={MASK}", text)
    text = _SIGNATURE_LINE.sub(lambda m: m[1] + MASK, text)
    return _URL_USERINFO.sub(lambda m: m[1] + MASK + "@", text)


def _without_bytes(value: Any, depth: int = 0) -> Any:
    """``value`` with every byte string in it (a request or response body) replaced by its size."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return f"<{len(value) if not isinstance(value, memoryview) else value.nbytes} bytes>"
    if depth > 6:
        return value
    if isinstance(value, dict):
        return {k: _without_bytes(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_bytes(v, depth + 1) for v in value]
    if isinstance(value, tuple):  # a named tuple becomes a plain one: its repr may change, never leak
        return tuple(_without_bytes(v, depth + 1) for v in value)
    return value


def _ours(name: str) -> bool:
    return name == "ckptfs" or name.startswith("ckptfs.")


class Redactor(logging.Filter):
    """A handler filter: drops the libraries' lines below WARNING unless ``libraries``, and
    rewrites every record it keeps so it holds no body, credential or signature."""

    def __init__(self, libraries: bool = False, secrets: tuple[str, ...] = ()):
        super().__init__()
        self.libraries = libraries
        # Only secrets long enough not to mask ordinary words (real AWS secrets are 40 characters).
        self.secrets = tuple(sorted({s for s in secrets if len(s) >= 8}, key=len, reverse=True))

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.libraries and record.levelno < logging.WARNING and not _ours(record.name):
            return False
        if getattr(record, "_ckptfs_redacted", False):
            return True  # another handler's filter did it already
        try:
            if record.args:
                record.args = _without_bytes(record.args)
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a broken format string must not print its raw arguments
            message = f"(a log line from {record.name} that could not be formatted)"
        if isinstance(record.msg, (bytes, bytearray)):
            message = _without_bytes(record.msg)
        if len(message) > MAX_MESSAGE:
            message = (
                message[:MAX_MESSAGE] + f" [... {len(message) - MAX_MESSAGE} more characters not logged]"
            )
        record.msg, record.args = redact(message, self.secrets), None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text, self.secrets)
        if record.stack_info:
            record.stack_info = redact(record.stack_info, self.secrets)
        record._ckptfs_redacted = True
        return True


def _secrets_from_environment() -> tuple[str, ...]:
    names = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")
    return tuple(os.environ[n] for n in names if os.environ.get(n))


def level_number(level: str) -> int:
    """The logging level for one of LEVELS (any case)."""
    level = level.upper()
    if level not in LEVELS:
        raise ValueError(f"unknown log level {level!r}: one of {', '.join(LEVELS)}")
    return TRACE if level == "TRACE" else logging.getLevelName(level)


def setup(level: str, stream: IO[str] = sys.stderr) -> logging.Handler:
    """Send the process's log to ``stream`` at ``level`` (one of LEVELS), through a Redactor;
    replaces any handler the root logger had."""
    number = level_number(level)
    trace = number <= TRACE
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(Redactor(libraries=trace, secrets=_secrets_from_environment()))
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(number)
    for name in LIBRARIES:  # so the libraries do not even build their debug lines
        logging.getLogger(name).setLevel(TRACE if trace else logging.WARNING)
    return handler


def open_log_file(path: str | os.PathLike) -> int:
    """A descriptor to append the daemon's log to ``path``: created 0600, never through a symbolic
    link; an existing one must be a regular file of ours with no other name (else MountError),
    and is made 0600 if it was more open."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, 0o600)  # O_NONBLOCK: a fifo put there must not hang us
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO):
            raise MountError(
                f"refusing the log file {path}: it is a symbolic link or not a regular file "
                "(remove it, or use another --cache-dir)"
            ) from None
        raise MountError(f"cannot open the log file {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
            raise MountError(
                f"refusing the log file {path}: not a regular file owned by uid {os.geteuid()} "
                "with a single name (remove it, or use another --cache-dir)"
            )
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.fchmod(fd, 0o600)  # a log from an older ckptfs (0644)
    except BaseException:
        os.close(fd)
        raise
    return fd
