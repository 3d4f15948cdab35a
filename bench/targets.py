"""The targets: where a checkpoint can go, how to save into and load from each, how to find the
filesystem daemon (for CPU and RSS) and where its store is polled for durability.

Filesystem targets are directories (`root`): the workloads use plain `torch.save`/`open` on
them. Client targets (boto3, s3torchconnector) override the save and load verbs. Every S3 target
has its own bucket on the same Swift server.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench import sysinfo
from bench.durable import DirView, S3View
from bench.mounts import CkptfsMount, ForegroundMount

MiB = 1 << 20
PART = 8 * MiB  # multipart part size for every peer where it can be set
IN_FLIGHT = 8  # parts in flight, likewise
CLIENT_THREADS = 8  # threads of the client targets for many small files


@dataclass
class Context:
    """What every target needs: the work directory, the S3 server, the checkpoint size."""

    work: Path
    endpoint: str
    access_key: str
    secret_key: str
    region: str
    size: int  # bytes of the main checkpoint
    clients: dict = field(default_factory=dict)

    def client(self):
        """One boto3 client per process (boto3 clients are thread-safe)."""
        if "s3" not in self.clients:
            from tests.support.swift import S3Endpoint

            self.clients["s3"] = S3Endpoint(
                self.endpoint, self.access_key, self.secret_key, self.region
            ).client(max_pool_connections=2 * IN_FLIGHT)
        return self.clients["s3"]


def load(path) -> object:
    return torch.load(path, weights_only=False)


@dataclass
class ColdLoad:
    seconds: float
    app_cpu: float  # CPU seconds of this process: the reader (torch.load) or the client library
    daemon_cpu: float | None  # of the fresh mount's daemon over the same window; None: no daemon
    daemon_main_cpu: float | None = None  # of that, its own process (its main interpreter)

    @property
    def client_cpu(self) -> float:
        return self.app_cpu + (self.daemon_cpu or 0.0)


def timed_load(read, daemon_pid: int | None = None) -> ColdLoad:
    """Run `read()`: its wall time, this process's CPU and the daemon's over it. Nothing else of
    the bench runs meanwhile (no poller), so this process's CPU is the reader's or the library's."""
    daemon0 = sysinfo.cpu_seconds(daemon_pid) if daemon_pid else None
    main0 = sysinfo.main_cpu_seconds(daemon_pid) if daemon_pid else None
    app0, start = sysinfo.own_cpu_seconds(), time.monotonic()
    read()
    seconds, app = time.monotonic() - start, sysinfo.own_cpu_seconds() - app0
    if not daemon_pid:
        return ColdLoad(seconds, app, None)
    assert daemon0 is not None and main0 is not None
    daemon, main = sysinfo.cpu_seconds(daemon_pid) - daemon0, sysinfo.main_cpu_seconds(daemon_pid) - main0
    return ColdLoad(seconds, app, daemon, main)


class Target:
    """A filesystem target: `root` is a directory; saves are plain file writes."""

    name = "?"
    role = "peer"  # floor | ckptfs | peer | null
    note = ""  # how it is configured, for the report

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.root: Path | None = None
        self.view = None  # where durability is polled; None: nothing to poll (the floor)

    # --- life cycle ---
    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    @property
    def pid(self) -> int | None:
        """The filesystem daemon, if there is one."""
        return None

    # --- verbs ---
    def key(self, rel: str) -> str:
        return rel

    def save(self, state, rel: str) -> dict:
        """torch.save into the target; returns extra figures (e.g. an upload time), usually none."""
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, path)
        return {}

    def saved_size(self, rel: str) -> int | None:
        """Size of what was saved, for the durability poll (None: the save is durable on return)."""
        return (self.root / rel).stat().st_size if self.view is not None else None

    def write_files(self, files: list[tuple[str, bytes]]) -> None:
        for rel, data in files:
            path = self.root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)

    def rank_spec(self, rel: str) -> tuple:
        """How a rank process saves `rel` (see bench.ranks)."""
        (self.root / rel).parent.mkdir(parents=True, exist_ok=True)
        return ("file", str(self.root / rel))

    def settle(self) -> None:
        """Wait (untimed) for what the filesystem does on its own once a save is durable."""

    def warm_load(self, rel: str) -> None:
        load(self.root / rel)

    @contextlib.contextmanager
    def fresh(self) -> Iterator[tuple[Path, int | None]]:
        """A view of the store as another node sees it: a new mount with an empty cache; with the
        PID of its daemon (None: no daemon)."""
        yield self.root, None

    def cold_load(self, rel: str, drop_page_cache) -> ColdLoad:
        with self.fresh() as (root, pid):
            drop_page_cache()
            return timed_load(lambda: load(root / rel), pid)

    def remove(self, rel: str) -> None:
        path = self.root / rel
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


# --- the floor and the do-nothing filesystem ---------------------------------------------------


class CacheDisk(Target):
    name, role = "cache-disk", "floor"
    note = "a directory on the disk that holds the ckptfs caches (page cache as the kernel keeps it)"

    def start(self) -> None:
        self.root = self.ctx.work / "cache-disk"
        self.root.mkdir()


class NullFs(Target):
    name, role = "nullfs", "null"
    note = (
        "bench/nullfs.py: a do-nothing filesystem on ckptfs's own FUSE transport (fusewire) that discards"
        " writes (direct_io, same options as ckptfs)"
    )

    def start(self) -> None:
        import sys

        self.root = self.ctx.work / "nullfs-mnt"
        self.mount = ForegroundMount(
            "nullfs",
            [sys.executable, "-m", "bench.nullfs", str(self.root)],
            self.root,
            self.ctx.work / "nullfs.log",
            stop_signal=signal.SIGTERM,
        ).start()

    def stop(self) -> None:
        if getattr(self, "mount", None) is not None:
            self.mount.stop()

    @property
    def pid(self) -> int:
        return self.mount.pid


# --- ckptfs --------------------------------------------------------------------------------------


class Ckptfs(Target):
    role = "ckptfs"
    mount_prefix: tuple[str, ...] = ()  # what `ckptfs mount` runs under (CkptfsMount's prefix)

    def __init__(self, ctx: Context, ram_cache: int | None = None):
        super().__init__(ctx)
        # one checkpoint and a quarter more (ckptfs's default is 1 GiB): the save stays in RAM
        self.ram_cache = ram_cache or max(1024 * MiB, (ctx.size * 5 // 4) // MiB * MiB)
        self.cache_size = max(4096 * MiB, 16 * ctx.size)
        self.mounts = 0

    def store(self) -> tuple[str, str | None]:
        raise NotImplementedError

    def _mount(self) -> CkptfsMount:
        self.mounts += 1
        tag = f"{self.name}-{self.mounts}"
        url, endpoint = self.store()
        return CkptfsMount(
            url,
            self.ctx.work / f"{tag}-mnt",
            self.ctx.work / f"{tag}-cache",
            self.ram_cache,
            self.cache_size,
            endpoint,
            prefix=self.mount_prefix,
        ).start()

    def start(self) -> None:
        self.mount = self._mount()
        self.root = self.mount.mountpoint

    def stop(self) -> None:
        if getattr(self, "mount", None) is not None:
            self.mount.stop()

    @property
    def pid(self) -> int:
        return self.mount.pid

    def settle(self, timeout: float = 30) -> None:
        """Wait (untimed) until the daemon has pushed the durable checkpoint into the page cache,
        as it does while the job is idle: what a load some time after the save finds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self.mount.status()
            if not status["pending"]["files"] and not status["page_cache_queued_files"]:
                return
            time.sleep(0.05)

    @contextlib.contextmanager
    def fresh(self) -> Iterator[tuple[Path, int | None]]:
        with self.fresh_mount() as mount:
            yield mount.mountpoint, mount.pid

    @contextlib.contextmanager
    def fresh_mount(self) -> Iterator[CkptfsMount]:
        """``fresh``, with the mount itself (its daemon's pid)."""
        mount = self._mount()
        try:
            yield mount
        finally:
            mount.stop()

    def describe(self) -> str:
        return (
            f"RAM tier {self.ram_cache // MiB} MiB, disk tier {self.cache_size // MiB} MiB, "
            f"8 MiB parts, 8 in flight (defaults)"
        )


class CkptfsLocal(Ckptfs):
    name = "ckptfs-local"

    def start(self) -> None:
        store = self.ctx.work / "local-store"
        store.mkdir(exist_ok=True)
        self.view = DirView(store)
        super().start()
        self.note = f"ckptfs on a local-directory store (file://) on the same disk; {self.describe()}"

    def store(self):
        return f"file://{self.ctx.work / 'local-store'}", None


class CkptfsS3(Ckptfs):
    name = "ckptfs-s3"

    def __init__(self, ctx: Context, ram_cache: int | None = None, bucket: str = "ckptfs-s3"):
        super().__init__(ctx, ram_cache)
        self.bucket = bucket

    def start(self) -> None:
        self.ctx.client().create_bucket(Bucket=self.bucket)
        self.view = S3View(self.ctx.client(), self.bucket)
        super().start()
        self.note = f"ckptfs on the Swift server (s3://{self.bucket}); {self.describe()}"

    def store(self):
        return f"s3://{self.bucket}", self.ctx.endpoint


ASSUME_CHECKSUMS_ENV = "CKPTFS_S3_CHECKSUMS"  # (ckptfs/store/s3_client.py)


class CkptfsS3Crc(CkptfsS3):
    """ckptfs-s3 in the integrity mode an AWS bucket gets (and s3torchconnector uses everywhere):
    bodies UNSIGNED-PAYLOAD with their CRC32C (Swift ignores the header); issue 42 compares time
    to durable in the same integrity mode."""

    name = "ckptfs-s3-crc32c"

    def __init__(self, ctx: Context, ram_cache: int | None = None):
        super().__init__(ctx, ram_cache, bucket="ckptfs-s3-crc")

    def start(self) -> None:
        super().start()
        self.note = (
            f"ckptfs on the Swift server (s3://{self.bucket}), parts UNSIGNED-PAYLOAD with their CRC32C"
            f" (CKPTFS_S3_CHECKSUMS=crc32c, as on AWS); {self.describe()}"
        )

    mount_prefix = ("env", f"{ASSUME_CHECKSUMS_ENV}=crc32c")


# --- FUSE peers ----------------------------------------------------------------------------------


class FusePeer(Target):
    """A FUSE filesystem of the same bucket, run in the foreground by us."""

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        self.bucket = self.name
        self.mounts = 0

    def _mount(self) -> ForegroundMount:
        raise NotImplementedError

    def start(self) -> None:
        self.ctx.client().create_bucket(Bucket=self.bucket)
        self.view = S3View(self.ctx.client(), self.bucket)
        self.mount = self._mount()
        self.root = self.mount.mountpoint

    def stop(self) -> None:
        if getattr(self, "mount", None) is not None:
            self.mount.stop()

    @property
    def pid(self) -> int:
        return self.mount.pid

    @contextlib.contextmanager
    def fresh(self) -> Iterator[tuple[Path, int | None]]:
        with self.fresh_mount() as mount:
            yield mount.mountpoint, mount.pid

    @contextlib.contextmanager
    def fresh_mount(self) -> Iterator[CkptfsMount]:
        """``fresh``, with the mount itself (its daemon's pid)."""
        mount = self._mount()
        try:
            yield mount
        finally:
            mount.stop()


class S3fs(FusePeer):
    name = "s3fs"
    note = (
        "s3fs-fuse, foreground (-f), path-style, url=http://127.0.0.1:PORT, multipart_size=8 (MiB), "
        "parallel_count=8, its temp files under the work directory; other options default"
    )

    def _mount(self) -> ForegroundMount:
        self.mounts += 1
        work = self.ctx.work
        passwd = work / "s3fs.passwd"
        passwd.write_text(f"{self.bucket}:{self.ctx.access_key}:{self.ctx.secret_key}\n")
        passwd.chmod(0o600)
        tmp = work / f"s3fs-{self.mounts}-tmp"
        tmp.mkdir()
        options = [
            f"url={self.ctx.endpoint}",
            "use_path_request_style",
            f"endpoint={self.ctx.region}",
            f"passwd_file={passwd}",
            f"multipart_size={PART // MiB}",
            f"parallel_count={IN_FLIGHT}",
            f"tmpdir={tmp}",
        ]
        mnt = work / f"s3fs-{self.mounts}-mnt"
        return ForegroundMount(
            "s3fs", ["s3fs", self.bucket, str(mnt), "-f", "-o", ",".join(options)], mnt, work / "s3fs.log"
        ).start()


class Rclone(FusePeer):
    name = "rclone"
    note = (
        "rclone mount --vfs-cache-mode writes (write-back after the default 5 s), its own cache dir, "
        "S3 remote from environment variables (provider Other, path style), --s3-chunk-size 8Mi, "
        "--s3-upload-concurrency 8; other options default"
    )

    def _mount(self) -> ForegroundMount:
        self.mounts += 1
        work = self.ctx.work
        remote = {
            "TYPE": "s3",
            "PROVIDER": "Other",
            "ENDPOINT": self.ctx.endpoint,
            "REGION": self.ctx.region,
            "ACCESS_KEY_ID": self.ctx.access_key,
            "SECRET_ACCESS_KEY": self.ctx.secret_key,
            "FORCE_PATH_STYLE": "true",
        }
        env = {k: v for k, v in os.environ.items() if k != "AWS_CA_BUNDLE"}  # rclone refuses to start with it
        env.update({f"RCLONE_CONFIG_BENCH_{k}": v for k, v in remote.items()})
        mnt = work / f"rclone-{self.mounts}-mnt"
        argv = [
            "rclone",
            "mount",
            f"bench:{self.bucket}",
            str(mnt),
            "--config",
            "/dev/null",
            "--vfs-cache-mode",
            "writes",
            "--cache-dir",
            str(work / f"rclone-{self.mounts}-cache"),
            "--s3-chunk-size",
            f"{PART // MiB}Mi",
            "--s3-upload-concurrency",
            str(IN_FLIGHT),
        ]
        return ForegroundMount("rclone", argv, mnt, work / "rclone.log", env).start()


# --- client libraries ----------------------------------------------------------------------------


class ClientTarget(Target):
    """Saves go straight to the store through a library: durable when the call returns."""

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        self.bucket = self.name

    def start(self) -> None:
        self.ctx.client().create_bucket(Bucket=self.bucket)

    def saved_size(self, rel: str) -> None:
        return None

    def write_files(self, files: list[tuple[str, bytes]]) -> None:
        with ThreadPoolExecutor(CLIENT_THREADS) as pool:
            list(pool.map(lambda item: self.put(*item), files))

    def put(self, rel: str, data: bytes) -> None:
        raise NotImplementedError

    def remove(self, rel: str) -> None:
        client = self.ctx.client()  # one DELETE per key: Swift wants a Content-MD5 on DeleteObjects
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=rel):
            for entry in page.get("Contents", ()):
                client.delete_object(Bucket=self.bucket, Key=entry["Key"])


def transfer_config():
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(multipart_threshold=PART, multipart_chunksize=PART, max_concurrency=IN_FLIGHT)


class Boto3(ClientTarget):
    name = "boto3"
    note = (
        "boto3 upload_fileobj / download_fileobj, 8 MiB parts, 8 in flight; save stall = torch.save into "
        "memory + upload, time to durable = the upload alone of the bytes already in memory, "
        "cold load = download_fileobj into memory, then the same torch.load from it"
    )

    def save(self, state, rel: str) -> dict:
        start = time.monotonic()
        buf = io.BytesIO()
        torch.save(state, buf)
        serialized = time.monotonic()
        buf.seek(0)
        self.ctx.client().upload_fileobj(buf, self.bucket, rel, Config=transfer_config())
        return {"upload": time.monotonic() - serialized, "serialize": serialized - start}

    def put(self, rel: str, data: bytes) -> None:
        self.ctx.client().put_object(Bucket=self.bucket, Key=rel, Body=data)

    def rank_spec(self, rel: str) -> tuple:
        return ("boto3", self.bucket, rel)

    def cold_load(self, rel: str, drop_page_cache) -> ColdLoad:
        """The download, then the same ``torch.load`` from memory (issue 42: a restore is both)."""
        drop_page_cache()
        client = self.ctx.client()

        def download_and_load() -> None:
            body = io.BytesIO()
            client.download_fileobj(self.bucket, rel, body, Config=transfer_config())
            body.seek(0)
            load(body)

        return timed_load(download_and_load)


def s3torch_checkpoint(ctx_or_endpoint, region: str = "us-east-1"):
    from s3torchconnector import S3Checkpoint, S3ClientConfig

    endpoint = getattr(ctx_or_endpoint, "endpoint", ctx_or_endpoint)
    region = getattr(ctx_or_endpoint, "region", region)
    return S3Checkpoint(
        region=region,
        endpoint=endpoint,
        s3client_config=S3ClientConfig(force_path_style=True, part_size=PART),
    )


class S3Torch(ClientTarget):
    name = "s3torchconnector"
    note = (
        "AWS's S3 connector for PyTorch: S3Checkpoint writer (torch.save streams into it; durable at "
        "close) and reader (torch.load from it), S3ClientConfig(force_path_style=True, part_size=8 MiB), "
        "endpoint=http://127.0.0.1:PORT, credentials from AWS_* variables"
    )

    def start(self) -> None:
        super().start()
        self.checkpoint = s3torch_checkpoint(self.ctx)

    def url(self, rel: str) -> str:
        return f"s3://{self.bucket}/{rel}"

    def save(self, state, rel: str) -> dict:
        with self.checkpoint.writer(self.url(rel)) as writer:
            torch.save(state, writer)
        return {}

    def put(self, rel: str, data: bytes) -> None:
        with self.checkpoint.writer(self.url(rel)) as writer:
            writer.write(data)

    def rank_spec(self, rel: str) -> tuple:
        return ("s3torch", self.bucket, rel)

    def cold_load(self, rel: str, drop_page_cache) -> ColdLoad:
        drop_page_cache()

        def read():
            with self.checkpoint.reader(self.url(rel)) as reader:
                load(reader)

        return timed_load(read)


TARGETS = {
    cls.name: cls
    for cls in (CacheDisk, CkptfsLocal, CkptfsS3, CkptfsS3Crc, S3fs, Rclone, Boto3, S3Torch, NullFs)
}
