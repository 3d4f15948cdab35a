"""Shared pytest fixtures for the ckptfs test suite.

Sections (add new ones below, each self-contained); one meaning per fixture name:
  - S3 server: `s3_server` (session), `s3_bucket` (function)
  - object stores in process: `local` (ckptfs's LocalStore; test modules name theirs `object_store`)
  - mounts: `store` (a view of a place to mount), `proxied_store`, `mount_factory`, `client`,
    `bucket_read`, `s3_mounts`, `proxy`
  - a cluster of nodes on one store: `cluster`
  - moto: `moto_endpoint`, `moto`, `verifying`
  - a second local user: `other_user`
  - test layers: the unit/store/e2e/slow markers

Helpers that are not fixtures: tests/support/harness.py (test data, waits, trio), tests/support/mounting.py
(real mounts), tests/support/inprocess.py (the namespace in process).
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import shutil
import tempfile
import uuid
import warnings
from pathlib import Path

import pytest

from tests.support.harness import private_shm_dir
from tests.support.rgw import RgwServer
from tests.support.swift import ACCESS_KEY, REGION, SECRET_KEY, S3Endpoint, SwiftServer

# =============================================================================================
# S3 server
# =============================================================================================
#
# s3_server: the real S3 server of the session on 127.0.0.1: OpenStack Swift + s3api, or Ceph's
#   RADOS Gateway with CKPTFS_TEST_S3_SERVER=rgw (scripts/test runs its chosen files a second
#   time so: tests/support/rgw.py).
#   - CKPTFS_TEST_S3_ENDPOINT set: use that server, credentials from AWS_ACCESS_KEY_ID /
#     AWS_SECRET_ACCESS_KEY / AWS_DEFAULT_REGION (the test servers' defaults if unset).
#   - otherwise: start one in a temporary directory for the session, stop it and remove the
#     directory at the end.
#   Returns an S3Endpoint: .endpoint, .access_key, .secret_key, .region, .client(), .env(),
#   .make_bucket(name). For the whole session os.environ carries CKPTFS_TEST_S3_ENDPOINT,
#   AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION, AWS_REGION (so subprocesses
#   such as a ckptfs daemon inherit them), with AWS settings that could redirect or break a
#   client removed (profiles, session tokens, endpoint overrides, the CA bundle, config files).
#
# s3_bucket: a fresh, uniquely named, empty bucket on s3_server (its name); emptied (objects and
#   in-progress multipart uploads) and deleted afterwards, best effort.

# Variables that would make boto3 (or a peer tool) ignore or break the test credentials.
_AWS_ENV_REMOVED = (
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_CA_BUNDLE",  # plain http to 127.0.0.1; rclone refuses to start while it is set
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
)


def _use_s3_env(mp: pytest.MonkeyPatch, server: S3Endpoint) -> None:
    for name in _AWS_ENV_REMOVED:
        mp.delenv(name, raising=False)
    mp.setenv("AWS_CONFIG_FILE", os.devnull)
    mp.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for name, value in server.env().items():
        mp.setenv(name, value)
    mp.setenv("AWS_REGION", server.region)


def _check_reachable(server: S3Endpoint) -> None:
    try:
        server.client(connect_timeout=5, read_timeout=30, retries={"max_attempts": 2}).list_buckets()
    except Exception as e:  # noqa: BLE001 - report any failure the same way
        raise RuntimeError(
            f"CKPTFS_TEST_S3_ENDPOINT={server.endpoint} does not answer ListBuckets with the "
            f"given credentials (access key {server.access_key!r}): {e!r}"
        ) from e


@pytest.fixture(scope="session")
def s3_server():
    endpoint = os.environ.get("CKPTFS_TEST_S3_ENDPOINT")
    with pytest.MonkeyPatch.context() as mp:
        if endpoint:
            server = S3Endpoint(
                endpoint,
                access_key=os.environ.get("AWS_ACCESS_KEY_ID", ACCESS_KEY),
                secret_key=os.environ.get("AWS_SECRET_ACCESS_KEY", SECRET_KEY),
                region=os.environ.get("AWS_DEFAULT_REGION", REGION),
            )
            _use_s3_env(mp, server)
            _check_reachable(server)
            yield server
            return
        kind = os.environ.get("CKPTFS_TEST_S3_SERVER", "swift")
        if kind not in ("swift", "rgw"):
            raise RuntimeError(f"CKPTFS_TEST_S3_SERVER={kind!r}: swift or rgw")
        root = Path(tempfile.mkdtemp(prefix=f"ckptfs-{kind}-"))
        server = SwiftServer(root) if kind == "swift" else RgwServer(root)
        try:
            server.start()
            _use_s3_env(mp, server)
            yield server
        finally:
            server.stop()
            shutil.rmtree(root, ignore_errors=True)


def _bucket_name(test_name: str) -> str:
    stem = re.sub(r"[^a-z0-9]+", "-", test_name.lower()).strip("-")[:32].strip("-") or "test"
    return f"t-{stem}-{uuid.uuid4().hex[:10]}"


def _add_content_md5(request, **kwargs) -> None:
    # Swift's s3api (2.30) rejects DeleteObjects without Content-MD5 ("Missing required header"),
    # and botocore >= 1.36 sends a CRC32 checksum header instead. Add the MD5 ourselves.
    body = request.body or b""
    if isinstance(body, str):
        body = body.encode()
    request.headers["Content-MD5"] = base64.b64encode(hashlib.md5(body).digest()).decode()


def _destroy_bucket(client, bucket: str) -> None:
    """Abort in-progress multipart uploads, delete every object, delete the bucket."""
    client.meta.events.register("before-sign.s3.DeleteObjects", _add_content_md5)
    for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket):
        for up in page.get("Uploads", []):
            client.abort_multipart_upload(Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
    client.delete_bucket(Bucket=bucket)


@pytest.fixture
def s3_bucket(s3_server, request):
    client = s3_server.client()
    name = _bucket_name(request.node.name)
    client.create_bucket(Bucket=name)
    yield name
    try:
        _destroy_bucket(client, name)
    except Exception as e:  # noqa: BLE001 - cleanup is best effort
        warnings.warn(f"could not remove test bucket {name}: {e!r}", stacklevel=1)


# =============================================================================================
# Object stores in process
# =============================================================================================
#
# local: a checked, empty LocalStore (ckptfs's own store object) in tmp_path/"store": what the
#   namespace, uploader and fetcher tests drive in process (tests/support/inprocess.py).


@pytest.fixture
def local(tmp_path):
    from ckptfs.store.local import LocalStore

    store = LocalStore.at(tmp_path / "store")
    store.check()
    return store


# =============================================================================================
# Mounts
# =============================================================================================
#
# store: a place to mount (a view of the store, not ckptfs's store object: that one is
#   `object_store` or `local` where a test module has one), parametrized over both stores:
#   .url, .endpoint (None for local), .read(key) -> bytes straight from the store (not through
#   ckptfs), .keys() -> set of keys (reserved ones hidden); on S3 also .sizes(), .assert_holds(files)
#   and .multipart_uploads(). A module whose tests need one kind overrides `store` (S3 only:
#   `S3StoreView(s3_server, s3_bucket)`; through the fault proxy: `return proxied_store`).
# proxied_store: the S3 `store` reached through `proxy` (s3://<s3_bucket>/run); mounts made on it
#   keep their RAM tiers in a tmpfs directory of their own (--shm-dir) and the proxy is cleared
#   before they are cleaned up (a stop waits for the uploads, so the store must be back).
# mount_factory(name=None, extra=(), **kwargs): a Mount on `store` in tmp_path/<name> (m0, m1, ...
#   by default), not started; every mount it made is unmounted (and its daemon stopped) at the end
#   of the test, pass or fail.

from tests.support.mounting import Mount  # noqa: E402


class LocalStoreView:
    def __init__(self, root: Path):
        self.root = root
        self.url = f"file://{root}"
        self.endpoint = None
        self.fault_proxy = None
        self.mount_extra: tuple[str, ...] = ()

    def read(self, key: str) -> bytes:
        return (self.root / key).read_bytes()

    def keys(self) -> set[str]:
        return {
            str(p.relative_to(self.root))
            for p in self.root.rglob("*")
            if p.is_file() and not str(p.relative_to(self.root)).startswith(".ckptfs-")
        }


class S3StoreView:
    def __init__(
        self, server, bucket: str, prefix: str = "run1", proxy=None, mount_extra: tuple[str, ...] = ()
    ):
        self.client = server.client()
        self.bucket = bucket
        self.prefix = prefix
        self.url = f"s3://{bucket}/{prefix}"
        self.fault_proxy = proxy
        self.endpoint = server.endpoint if proxy is None else proxy.url
        self.mount_extra = mount_extra

    def read(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}")["Body"].read()

    def sizes(self) -> dict[str, int]:
        """key -> size of every file (no directory markers, no reserved keys such as manifests)."""
        out = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self.prefix + "/"
        ):
            out |= {
                o["Key"][len(self.prefix) + 1 :]: o["Size"]
                for o in page.get("Contents", [])
                if not o["Key"].endswith("/") and not o["Key"][len(self.prefix) + 1 :].startswith(".ckptfs-")
            }
        return out

    def keys(self) -> set[str]:
        return set(self.sizes())

    def assert_holds(self, files: dict[str, bytes]) -> None:
        """The store holds exactly these files, byte for byte."""
        assert self.sizes() == {k: len(v) for k, v in files.items()}
        for key, data in files.items():
            assert self.read(key) == data, f"{key} differs in the store"

    def multipart_uploads(self) -> list:
        return self.client.list_multipart_uploads(Bucket=self.bucket).get("Uploads", [])


# client: a boto3 client of s3_server, to look at (or damage) the bucket behind ckptfs's back.
@pytest.fixture
def client(s3_server):
    return s3_server.client()


# bucket_read: read(name) -> the bytes of s3://<s3_bucket>/run/<name>, straight from the server.
@pytest.fixture
def bucket_read(client, s3_bucket):
    return lambda name: client.get_object(Bucket=s3_bucket, Key=f"run/{name}")["Body"].read()


# s3_mounts: make(root, endpoint, *extra) -> a started Mount of s3://<s3_bucket>/run (endpoint:
# the server's or a proxy's); every mount made is stopped at the end of the test.
@pytest.fixture
def s3_mounts(s3_bucket):
    made: list[Mount] = []

    def make(root, endpoint: str, *extra: str, **kwargs) -> Mount:
        m = Mount(f"s3://{s3_bucket}/run", root, endpoint_url=endpoint, extra=extra, **kwargs)
        made.append(m)
        return m.start()

    yield make
    for m in made:
        m.cleanup()


# proxy: a FaultProxy (tests/support/faultproxy.py) in front of s3_server, stopped after the test.
@pytest.fixture
def proxy(s3_server):
    from tests.support.faultproxy import FaultProxy

    with FaultProxy(s3_server.endpoint) as p:
        yield p


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return LocalStoreView(tmp_path / "store")
    server = request.getfixturevalue("s3_server")
    bucket = request.getfixturevalue("s3_bucket")
    return S3StoreView(server, bucket)


@pytest.fixture
def proxied_store(s3_server, s3_bucket, proxy):
    shm = private_shm_dir()
    try:
        yield S3StoreView(
            s3_server, s3_bucket, prefix="run", proxy=proxy, mount_extra=("--shm-dir", str(shm))
        )
    finally:
        shutil.rmtree(shm, ignore_errors=True)


@pytest.fixture
def mount_factory(store, tmp_path):
    mounts: list[Mount] = []

    def make(name: str | None = None, extra: tuple[str, ...] = (), **kwargs) -> Mount:
        m = Mount(
            store.url,
            tmp_path / (name or f"m{len(mounts)}"),
            endpoint_url=store.endpoint,
            extra=(*store.mount_extra, *extra),
            **kwargs,
        )
        mounts.append(m)
        return m

    yield make
    if store.fault_proxy is not None:
        store.fault_proxy.clear()
    for m in mounts:
        m.cleanup()


# =============================================================================================
# A cluster: several nodes, each with its own mount of one store
# =============================================================================================
#
# cluster: a Cluster (tests/support/cluster.py) on `store` (both stores), in tmp_path/"cluster".
#   .node(name, extra=(), netns=False, rate=None, **mount_kwargs) -> a started Node: its own
#   mountpoint (.path), cache dir, RAM tier and link to the store (S3: a FaultProxy of its own;
#   local: its daemon under a seccomp filter of its own, tests/support/hold_syscalls.py), so
#   that .hold_uploads() holds that node's changes to the store while the others' flow; .lose()
#   kills it for good. .store: the store view; .checkpoints(): `ckptfs checkpoints <store url>
#   --json`. After the test, pass or fail, every node is stopped (or killed) and unmounted, and
#   every proxy, hold_syscalls server, network namespace, veth and RAM tier is gone.

from tests.support.cluster import Cluster  # noqa: E402 (a global: the layer markers see it reached)


@pytest.fixture
def cluster(store, tmp_path):
    made = Cluster(store, tmp_path / "cluster")
    try:
        yield made
    finally:
        made.cleanup()


# =============================================================================================
# moto: a second S3 server, one that keeps S3's checksums (tests of issue 15)
# =============================================================================================
#
# moto_endpoint (module): moto's standalone S3 server on 127.0.0.1, its URL.
# moto: (endpoint, client, bucket) with a fresh bucket; os.environ carries moto's credentials.
# verifying: (proxy, client, bucket): a FaultProxy in front of moto that refuses a body whose
#   CRC32C does not match (400 BadDigest), as AWS S3 does.

import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from tests.support.faultproxy import FaultProxy  # noqa: E402 (a global: the layer markers see it reached)


@pytest.fixture(scope="module")
def moto_endpoint(tmp_path_factory):
    """moto's standalone S3 server on 127.0.0.1 (a process of its own), stopped after the module."""
    from tests.support.harness import free_port

    port = free_port()
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("moto.server did not start") from None
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


@pytest.fixture
def moto(moto_endpoint, monkeypatch):
    """(endpoint, client, bucket) with a fresh bucket; the mounts inherit moto's (any) credentials."""
    import boto3
    from botocore.config import Config

    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    }.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    client = boto3.client(
        "s3",
        endpoint_url=moto_endpoint,
        config=Config(
            s3={"addressing_style": "path"},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        ),
    )
    bucket = f"ckptfs-checks-{os.urandom(4).hex()}"
    client.create_bucket(Bucket=bucket)
    return moto_endpoint, client, bucket


@pytest.fixture
def verifying(moto):
    """A fault proxy in front of moto that refuses bodies not matching their CRC32C."""
    endpoint, client, bucket = moto
    with FaultProxy(endpoint) as proxy:
        proxy.verify_checksums = True
        yield proxy, client, bucket


# =============================================================================================
# A second, unprivileged local user (the hostile neighbour on a shared node)
# =============================================================================================
#
# other_user: the user `ckptfs-tester` (scripts/test creates it); the test is skipped when it is
#   missing or when the suite does not run as root. .uid, .gid, .name;
#   .run(argv, **kw) -> CompletedProcess: argv run as that user (no extra groups, cwd /);
#   .python(code, *args) -> CompletedProcess: the suite's interpreter runs `code` as that user;
#   .reach(path): lets that user traverse every directory above `path` that this test session
#   created (pytest's temporary directories are 0700), so it can reach a mount placed there.

import pwd  # noqa: E402

OTHER_USER = "ckptfs-tester"


class OtherUser:
    def __init__(self, entry: pwd.struct_passwd, session_root: Path):
        self.name, self.uid, self.gid = entry.pw_name, entry.pw_uid, entry.pw_gid
        self._session_root = session_root

    def run(self, argv: list[str], timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/nonexistent", "LANG": "C.UTF-8"}
        env.update(kwargs.pop("env", {}))
        return subprocess.run(
            argv,
            user=self.uid,
            group=self.gid,
            extra_groups=[],
            cwd="/",
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            **kwargs,
        )

    def python(self, code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """``code`` run as that user by an interpreter it can reach, with ckptfs and its dependencies
        importable (the suite's own interpreter may sit under root's 0700 home)."""
        return self.run([_other_python(), "-c", code, *args], timeout=timeout, env=_other_pythonpath())

    def ckptfs(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """The ckptfs command, run as that user."""
        return self.run([_other_python(), "-m", "ckptfs", *args], timeout=timeout, env=_other_pythonpath())

    def reach(self, path: Path) -> None:
        path = Path(path).resolve()
        for directory in [path, *path.parents]:
            if directory == self._session_root or self._session_root in directory.parents:
                directory.chmod(
                    directory.stat().st_mode | 0o011
                )  # search (x) for group and others; no listing


def _other_python() -> str:
    system = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")
    return str(system) if system.exists() else sys.executable


def _other_pythonpath() -> dict[str, str]:
    import sysconfig

    repo = Path(__file__).resolve().parent.parent
    return {
        "PYTHONPATH": os.pathsep.join(
            [str(repo), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
        )
    }


_other_user_usable: str | None = None  # why not, once found out


@pytest.fixture
def other_user(tmp_path_factory) -> OtherUser:
    if os.geteuid() != 0:
        pytest.skip("the shared-node tests run as root")
    try:
        entry = pwd.getpwnam(OTHER_USER)
    except KeyError:
        pytest.skip(f"no user {OTHER_USER} (scripts/test creates it)")
    # The session's own temporary tree: what `reach` may open up (never /tmp or / itself).
    basetemp = tmp_path_factory.getbasetemp().resolve()
    root = Path(os.path.commonpath([basetemp, Path(tempfile.gettempdir()).resolve()]))
    if root in (Path("/"), Path("/tmp"), Path("/var/tmp")):
        root = basetemp.parent
    user = OtherUser(entry, root)
    global _other_user_usable
    if _other_user_usable is None:
        done = user.python("import ckptfs.cli.main")
        _other_user_usable = "" if done.returncode == 0 else (done.stderr.strip().splitlines() or ["?"])[-1]
    if _other_user_usable:
        pytest.skip(f"{OTHER_USER} cannot run ckptfs from this checkout: {_other_user_usable}")
    return user


# =============================================================================================
# Test layers (markers): declared by a module wholly of one layer, else guessed from what a test reaches
# =============================================================================================
#
# A test module whose tests are all of one layer says so at its top (`pytestmark =
# pytest.mark.unit`; or store, e2e, or [e2e, store]): an explicit unit/store/e2e mark (the
# module's, a class's, a test's, a parameter's) always wins. The guess below is the fallback, for
# the modules that mix layers (tests/test_markers.py checks that every module of one layer
# declares it, and that a declared layer wins). The slow marker is always guessed.
#
#   unit   neither of the two below: the code in-process, a local store, seconds in all
#   store  needs the S3 server: the s3_server/s3_bucket/proxy fixtures, the `store` fixture on
#          its "s3" parameter, or Swift / the fault proxy / an S3 endpoint used directly
#   e2e    mounts ckptfs through FUSE: the mount_factory fixture, or tests.support.mounting's Mount (or a
#          subclass) / `ckptfs` command used by the test, its fixtures or the helpers they call
#   slow   the long ones: a test reading the module's LONG (CKPTFS_LONG) switch, a hypothesis
#          state-machine run (run_state_machine_as_test; a plain @given test is not slow by
#          itself), or one whose timeout mark allows 10 minutes or more
#
# "Reaches" is found by reading code, not by running it: the names the test function, its
# fixtures' functions and (transitively) the helper functions and classes of tests/ they name
# refer to. A test the guess gets wrong carries its mark itself. `scripts/test -m unit` runs the
# unit layer without starting Swift (the s3_server fixture starts it only for a test that needs it).

LAYERS = ("unit", "store", "e2e")
_S3_FIXTURES = {"s3_server", "s3_bucket", "proxy"}
_SLOW_TIMEOUT_S = 600


def _reach_targets() -> dict[int, str]:
    from tests.support import faultproxy, mounting, rgw, swift

    return {
        id(mounting.Mount): "e2e",
        id(mounting.ckptfs): "e2e",
        id(swift.SwiftServer): "store",
        id(rgw.RgwServer): "store",
        id(swift.S3Endpoint): "store",
        id(faultproxy.FaultProxy): "store",
    }


def _codes(code):
    yield code
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            yield from _codes(const)


def _reached(obj, targets: dict[int, str], seen: set[int], out: set[str]) -> None:
    """Add to `out` the kinds (e2e, store, slow) the function or class `obj` reaches."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    try:
        _reached_from(obj, targets, seen, out)
    except Exception:  # noqa: BLE001 - an object this reading does not understand: the fixture rules still hold
        pass


def _reached_from(obj, targets: dict[int, str], seen: set[int], out: set[str]) -> None:
    import inspect
    import types

    if id(obj) in targets:
        out.add(targets[id(obj)])
    if inspect.isclass(obj):
        for base in obj.__mro__:
            if id(base) in targets:
                out.add(targets[id(base)])
        if obj.__module__.startswith("tests"):
            for member in vars(obj).values():
                member = getattr(member, "__func__", member)
                if isinstance(member, (types.FunctionType, property)):
                    _reached(member.fget if isinstance(member, property) else member, targets, seen, out)
        return
    func = inspect.unwrap(obj) if callable(obj) else obj
    if not isinstance(func, types.FunctionType):
        return
    module_globals = func.__globals__
    for code in _codes(func.__code__):
        for name in code.co_names:
            if name == "LONG" and "LONG" in module_globals:
                out.add("slow")
            if name == "run_state_machine_as_test":
                out.add("slow")
            value = module_globals.get(name)
            if value is None:
                continue
            if isinstance(value, types.ModuleType):
                # `mounting.Mount(...)`: look the other names up in that module, one level deep
                for attr in code.co_names:
                    target = getattr(value, attr, None)
                    if target is not None and id(target) in targets:
                        out.add(targets[id(target)])
                continue
            module = getattr(value, "__module__", None)
            if isinstance(module, str) and module.startswith("tests"):
                _reached(value, targets, seen, out)
            elif id(value) in targets:
                out.add(targets[id(value)])


def _asks_for_s3(func) -> bool:
    import inspect

    code = getattr(inspect.unwrap(func), "__code__", None)
    return code is not None and any(
        const in _S3_FIXTURES for c in _codes(code) for const in c.co_consts if isinstance(const, str)
    )


def _layers_of(item, targets: dict[int, str]) -> set[str]:
    kinds: set[str] = set()
    names = set(getattr(item, "fixturenames", ()))
    if names & _S3_FIXTURES:
        kinds.add("store")
    if "mount_factory" in names:
        kinds.add("e2e")
    params = getattr(getattr(item, "callspec", None), "params", {})
    seen: set[int] = set()
    if getattr(item, "function", None) is not None:
        _reached(item.function, targets, seen, kinds)
    fixtureinfo = getattr(item, "_fixtureinfo", None)
    for name in names:
        for fixturedef in fixtureinfo.name2fixturedefs.get(name, ()) if fixtureinfo else ():
            _reached(fixturedef.func, targets, seen, kinds)
            # request.getfixturevalue("s3_server"): always, or (a parametrised fixture such as
            # `store`) only on its "s3" parameter
            if _asks_for_s3(fixturedef.func) and (fixturedef.params is None or params.get(name) == "s3"):
                kinds.add("store")
    timeout = item.get_closest_marker("timeout")
    if timeout is not None and timeout.args and isinstance(timeout.args[0], (int, float)):
        if timeout.args[0] >= _SLOW_TIMEOUT_S:
            kinds.add("slow")
    return kinds


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by these markers
def pytest_collection_modifyitems(config, items):
    targets = _reach_targets()
    for item in items:
        # declared (by its module, class, function or parameter): it wins, the guess adds nothing
        explicit = {layer for layer in LAYERS if item.get_closest_marker(layer) is not None}
        kinds = _layers_of(item, targets)
        layers = explicit or ({"store", "e2e"} & kinds) or {"unit"}
        for layer in sorted(layers - explicit):
            item.add_marker(layer)
        if "slow" in kinds and item.get_closest_marker("slow") is None:
            item.add_marker("slow")
    if os.environ.get("CKPTFS_TEST_S3_SERVER", "swift") != "swift":
        # A run against another server (scripts/test's second pass): only what talks to it.
        kept = [item for item in items if item.get_closest_marker("store") is not None]
        config.hook.pytest_deselected(
            items=[item for item in items if item.get_closest_marker("store") is None]
        )
        items[:] = kept


@pytest.fixture
def reachable(store):
    """(root, make): a directory the other user may traverse, and a factory of mounts under it.
    Not under pytest's /tmp/pytest-of-root, which each pytest session starting on the node
    (other suites run in parallel) chmods back to 0700, locking the other user out mid-test."""
    root = Path(tempfile.mkdtemp(prefix="ckptfs-sec-", dir="/tmp"))
    root.chmod(0o711)
    made: list[Mount] = []

    def make(*extra: str) -> Mount:
        m = Mount(store.url, root / f"m{len(made)}", endpoint_url=store.endpoint, extra=extra)
        made.append(m)
        return m

    yield root, make
    for m in made:
        m.cleanup()
    shutil.rmtree(root, ignore_errors=True)
