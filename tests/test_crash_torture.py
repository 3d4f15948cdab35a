"""Crash torture on the real S3 server: kill -9 the daemon at random moments of a checkpoint save.

Each trial runs ``tests/support/crash_writer.py`` in its own process: it saves a checkpoint (a few
files of varied sizes around the 8 MiB part size, sometimes a real ``torch.save``, sometimes
into a temp directory renamed into place) into ``trial-NNN/`` of one long-lived mount, then a
``latest`` pointer naming them, and logs every ``close()``/``rename`` that returned to a file
outside the mount. The test SIGKILLs the daemon in a phase of the save that trial i takes in
turn (i mod 4: during the writes, during the uploads, twice: during the uploads and again
during the recovery, after everything is durable; ``PHASES``), at a random moment inside it
(during the uploads, half the time its store worker processes first, a moment before it),
and fails if the kill did not land in that phase; the mount reaches the store through the
fault proxy, whose holds keep the uploads phases' window open. Then it remounts with the same
cache dir, syncs, and checks with xxh3 of bytes read straight from the store (boto3 on the
real endpoint):

- every file whose close returned is there, byte-identical (on the mount before the sync,
  in the store after it);
- nothing partial exists anywhere: every key in the store, at the kill and after the sync, is
  a file of this or an earlier trial with exactly its expected content (and its ``xxh3``
  metadata is right); every file on the mount too; no multipart upload is left after sync;
- ordered publish holds across the crash: whenever ``latest`` (or ``latest.tmp``) is in the
  store, every file it names is in the store;
- a directory rename is atomic across the crash (never both ``trial-N.tmp/`` and ``trial-N/``);
- after the sync the mounted view equals the store (names, sizes, bytes of this trial).

The mount and its cache dir are reused across trials, so the journal, the arenas and the
store accumulate state as a real job's restarts do; earlier trials' objects must stay intact
(same ETag). 6 trials per cache by default, 100 with CKPTFS_LONG=1 (CKPTFS_TORTURE_TRIALS overrides);
CKPTFS_TORTURE_SEED replays a run (the seed is printed in the summary line and in failures);
a run of 4 trials or more fails unless each phase was reached at least once;
CKPTFS_TORTURE_VERBOSE=1 prints a line per trial (when the kill landed).

Bugs the torture found are reproduced by the regular tests at the bottom, all fixed. The
TOLERATE_* switches let it run on while such a bug was open (tolerating exactly its symptom and
counting it); they are off: any symptom fails the torture.
"""

from __future__ import annotations

import errno
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import xxhash

from ckptfs.config import MountConfig
from ckptfs.objects.integrity import Checksums, IntegrityError, is_reserved, manifest_key
from tests.support import crash_writer
from tests.support.harness import proc_state
from tests.support.mounting import Mount, kill_daemon

LONG = os.environ.get("CKPTFS_LONG") == "1"
VERBOSE = os.environ.get("CKPTFS_TORTURE_VERBOSE") == "1"  # a line per trial: when the kill landed
TRIALS = int(os.environ.get("CKPTFS_TORTURE_TRIALS") or (100 if LONG else 6))
WRITER = Path(__file__).parent / "support" / "crash_writer.py"
PREFIX = "torture"
# A bug, fixed (test_read_racing_the_move_of_a_renamed_file): a read of an uncached file racing
# the server-side move of its rename (replayed after the crash) fails with EIO. True: read again
# once, count it and go on; False: fail on it.
TOLERATE_EIO_RACING_A_MOVE = False
# A bug, fixed (test_kill_during_create_multipart_leaks_no_upload): a kill while a
# CreateMultipartUpload is in flight leaks that upload. True: abort it, count it and go on.
TOLERATE_LEAKED_UPLOADS = False


def xxh(data: bytes) -> str:
    return xxhash.xxh3_64_hexdigest(data)


class Store:
    """The bucket prefix, read straight from the server with boto3 (never through ckptfs)."""

    def __init__(self, client, bucket: str, prefix: str):
        self.client, self.bucket, self.prefix = client, bucket, prefix

    def listing(self) -> dict[str, dict]:
        """key -> {"size", "etag"}, directory markers included (their keys end with /)."""
        out = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self.prefix + "/"
        ):
            for o in page.get("Contents", []):
                if not is_reserved(o["Key"][len(self.prefix) + 1 :]):  # (checksum manifests)
                    out[o["Key"][len(self.prefix) + 1 :]] = {"size": o["Size"], "etag": o["ETag"]}
        return out

    def get(self, key: str) -> tuple[bytes, dict] | None:
        try:
            r = self.client.get_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}")
        except self.client.exceptions.NoSuchKey:
            return None
        return r["Body"].read(), r.get("Metadata", {})

    def exists(self, key: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}")
            return True
        except self.client.exceptions.ClientError as exc:
            if exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                return False
            raise

    def multipart_uploads(self) -> list[tuple[str, str]]:
        r = self.client.list_multipart_uploads(Bucket=self.bucket, Prefix=self.prefix + "/")
        return [(u["Key"][len(self.prefix) + 1 :], u["UploadId"]) for u in r.get("Uploads", [])]

    def abort(self, key: str, upload_id: str) -> None:
        self.client.abort_multipart_upload(Bucket=self.bucket, Key=f"{self.prefix}/{key}", UploadId=upload_id)


def mount_tree(root: Path) -> tuple[dict[str, int], set[str]]:
    """Files (relative path -> size) and directories seen through the mount."""
    files, dirs = {}, set()
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        for d in dirnames:
            dirs.add(d if rel == "." else f"{rel}/{d}")
        for f in filenames:
            key = f if rel == "." else f"{rel}/{f}"
            files[key] = os.stat(os.path.join(dirpath, f)).st_size
    return files, dirs


class Trial:
    """What one trial may and must leave, and the checks."""

    def __init__(
        self,
        trial: int,
        store: Store,
        known: dict[str, dict],
        known_latest: bytes | None,
        scratch: Path,
        context: str,
    ):
        self.plan = crash_writer.plan(trial)
        self.store = store
        self.known = known  # the store after the previous trial's sync: key -> {"size", "etag"}
        self.known_latest = known_latest
        self.context = context
        self.expected = {e.name: crash_writer.expected_bytes(trial, e, scratch) for e in self.plan.entries}
        self.hashes = {name: xxh(data) for name, data in self.expected.items()}
        self.latest = self.plan.latest_text()
        self.confirmed: list[str] = []
        self.verified = 0
        self.eio_retries = 0
        self.leaked_uploads = 0

    def fail(self, message: str) -> None:
        pytest.fail(f"{self.context}: {message}", pytrace=False)

    # -- what a key may hold ---------------------------------------------------------------
    def allowed(self, key: str) -> list[str] | None:
        """The xxh3 digests ``key`` may hold now (None: any unchanged earlier object)."""
        p = self.plan
        parent, _, name = key.rpartition("/")
        if parent in {p.dir, p.write_dir} and name in self.expected:
            return [self.hashes[name]]
        if key == "latest":
            return [xxh(self.latest)] + ([xxh(self.known_latest)] if self.known_latest is not None else [])
        if key == "latest.tmp" and p.replace_latest:
            return [xxh(self.latest)]
        return None

    def check_store(self, phase: str) -> dict[str, dict]:
        """Nothing partial, nothing unknown, earlier trials intact, ordered publish."""
        listing = self.store.listing()
        for key, info in listing.items():
            if key.endswith("/"):
                continue  # a directory marker (empty object)
            before = self.known.get(key)
            if before is not None and before["etag"] == info["etag"]:
                continue  # an object an earlier trial verified, unchanged
            allowed = self.allowed(key)
            if allowed is None:
                self.fail(f"{phase}: unexpected object {key!r} in the store ({info['size']} bytes)")
            got = self.store.get(key)
            if got is None:
                continue  # deleted since the listing (a move or a replace going on)
            data, meta = got
            if xxh(data) not in allowed:
                self.fail(
                    f"{phase}: {key!r} in the store is torn or wrong: {len(data)} bytes, "
                    f"xxh3 {xxh(data)}, expected one of {allowed}"
                )
            if meta.get("xxh3") not in (None, xxh(data)):
                self.fail(
                    f"{phase}: {key!r} carries xxh3 metadata {meta.get('xxh3')} but its bytes hash to {xxh(data)}"
                )
            if meta.get("ckptfs-manifest"):  # a visible multipart object has its part checksums
                manifest = self.store.get(manifest_key(meta["ckptfs-upload"]))
                if manifest is None and self.store.exists(key):
                    self.fail(f"{phase}: {key!r} is in the store without its manifest")
                if manifest is not None:
                    try:
                        Checksums.from_manifest(manifest[0], len(data)).check(0, data)
                    except IntegrityError as exc:
                        self.fail(f"{phase}: {key!r} does not match its manifest: {exc}")
        for key, info in self.known.items():  # earlier trials' objects must stay (bar the pointer)
            if key in ("latest", "latest.tmp") or key.endswith("/"):
                continue
            now = listing.get(key)
            if now is None and self.store.exists(key):
                continue  # a listing that lags behind the object servers
            if now is None or now["etag"] != info["etag"]:
                self.fail(f"{phase}: {key!r} from an earlier trial changed or vanished: {info} -> {now}")
        self.check_ordered_publish(phase)
        return listing

    def check_ordered_publish(self, phase: str) -> None:
        # GET the pointer first, then HEAD what it names: anything published before the pointer
        # must be visible by then.
        for pointer in ("latest", "latest.tmp"):
            got = self.store.get(pointer)
            if got is None:
                continue
            named = got[0].decode().split("\n")[1:]
            missing = [k for k in named if k and not self.store.exists(k)]
            if missing:
                self.fail(
                    f"{phase}: ordered publish broken: {pointer!r} is in the store but "
                    f"{missing} it names are not"
                )

    # -- the mount ---------------------------------------------------------------------------------
    def read_mounted(self, path: Path) -> bytes:
        try:
            return path.read_bytes()
        except OSError as exc:
            if exc.errno != errno.EIO or not TOLERATE_EIO_RACING_A_MOVE:
                raise
        self.eio_retries += 1
        time.sleep(0.5)
        return path.read_bytes()

    def check_mount(self, root: Path, phase: str) -> bool:
        """Every confirmed file is on the mount with its bytes, nothing torn; returns whether
        the temp directory (if any) was renamed into place."""
        p = self.plan
        final, temp = root / p.dir, root / p.write_dir
        renamed = not p.temp_dir or final.exists()
        if p.temp_dir and final.exists() and temp.exists():
            self.fail(
                f"{phase}: directory rename not atomic: both {p.write_dir}/ and {p.dir}/ exist: "
                f"{sorted(os.listdir(temp))} / {sorted(os.listdir(final))}"
            )
        if "renamed " + p.dir in self.confirmed and not renamed:
            self.fail(f"{phase}: rename of {p.write_dir} returned but {p.dir}/ is not there")
        where = final if renamed else temp
        if where.exists():
            for name in os.listdir(where):
                data = self.read_mounted(where / name)
                if name not in self.expected or xxh(data) != self.hashes[name]:
                    self.fail(
                        f"{phase}: {where.name}/{name} on the mount is torn or unexpected ({len(data)} bytes)"
                    )
        for line in self.confirmed:
            if not line.startswith(f"closed {p.write_dir}/"):
                continue
            name = line.rsplit("/", 1)[1]
            if not (where / name).exists():
                self.fail(f"{phase}: {where.name}/{name} was closed before the kill but is not on the mount")
        latest = self.read_mounted(root / "latest") if (root / "latest").exists() else None
        if "closed latest" in self.confirmed and latest != self.latest:
            self.fail(f"{phase}: `latest` was closed before the kill but reads {latest!r}")
        if "closed latest.tmp" in self.confirmed and latest != self.latest:
            tmp = (root / "latest.tmp").read_bytes() if (root / "latest.tmp").exists() else None
            if tmp != self.latest:
                self.fail(
                    f"{phase}: latest.tmp was closed before the kill but neither it nor latest holds it"
                )
        if latest not in (self.latest, self.known_latest):
            self.fail(f"{phase}: `latest` on the mount is torn: {latest!r}")
        return renamed

    def check_after_sync(self, root: Path, store: Store) -> dict[str, dict]:
        p = self.plan
        listing = self.check_store("after sync")
        renamed = self.check_mount(root, "after sync")
        where = p.dir if renamed else p.write_dir
        for line in self.confirmed:  # every file whose close returned is in the store
            if line.startswith(f"closed {p.write_dir}/"):
                key = f"{where}/{line.rsplit('/', 1)[1]}"
                got = store.get(key)
                if got is None or xxh(got[0]) != self.hashes[key.rsplit("/", 1)[1]]:
                    self.fail(
                        f"after sync: {key!r} was closed before the kill but the store has "
                        f"{'nothing' if got is None else f'{len(got[0])} other bytes'}"
                    )
        if "closed latest" in self.confirmed and (store.get("latest") or (b"",))[0] != self.latest:
            self.fail("after sync: `latest` was closed before the kill but the store's differs")
        # The mounted view equals the store: names and sizes everywhere, bytes for this trial.
        files, dirs = mount_tree(root)
        store_files = {k: v["size"] for k, v in listing.items() if not k.endswith("/")}
        if files != store_files:
            diff = {
                k: (files.get(k), store_files.get(k))
                for k in set(files) | set(store_files)
                if files.get(k) != store_files.get(k)
            }
            self.fail(f"after sync: the mount and the store differ (mount size, store size): {diff}")
        store_dirs = {k.rstrip("/") for k in listing if k.endswith("/")}
        for key in listing:
            parts = key.rstrip("/").split("/")
            store_dirs |= {"/".join(parts[:i]) for i in range(1, len(parts))}
        if dirs != store_dirs:
            self.fail(
                f"after sync: directories differ: only on the mount {sorted(dirs - store_dirs)}, "
                f"only in the store {sorted(store_dirs - dirs)}"
            )
        for key in files:
            if key.startswith((p.dir + "/", p.write_dir + "/")) or key in ("latest", "latest.tmp"):
                mounted, stored = self.read_mounted(root / key), store.get(key)[0]
                if xxh(mounted) != xxh(stored):
                    self.fail(f"after sync: {key!r} reads differently through the mount and from the store")
                self.verified += 1
        deadline = time.monotonic() + 20  # aborts of stale uploads run in the background
        while (uploads := store.multipart_uploads()) and time.monotonic() < deadline:
            time.sleep(0.2)
        mine = (p.dir + "/", p.write_dir + "/", "latest")
        if uploads and TOLERATE_LEAKED_UPLOADS and all(key.startswith(mine) for key, _ in uploads):
            for key, upload_id in uploads:  # the known leak: clean it up so later trials see none
                store.abort(key, upload_id)
            self.leaked_uploads = len(uploads)
        elif uploads:
            self.fail(f"after sync: multipart uploads left in the store: {uploads}")
        return listing


def _read_log(path: Path) -> list[tuple[str, float]]:
    """The writer's log: (what returned, time.monotonic() when it returned)."""
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        what, _, when = line.partition("\t")
        out.append((what, float(when)))
    return out


def _stop_writer(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGCONT)  # a writer that stopped itself (the writes phase)
    try:
        proc.wait(timeout=15)  # it gets ENOTCONN/EIO from the dead mount and exits
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


# roomy: 4 RAM slots, checkpoints spill to the disk tier. tight: 3 slots in all, fewer than the
# largest file has blocks: streamed parts are evicted from files still being written, so kills
# land while the journal names uploads that only the store holds parts of.
CACHES = {"roomy": ("32MiB", "2GiB"), "tight": ("8MiB", "16MiB")}


# The kill phases, in the order trial i takes them (phase i mod 4): every run of 4 trials or more
# reaches each of them, whatever the seed (the moments inside a phase are random). The writes: the
# writer stops itself at a random point of its writes (a file open, half written) unless the
# random kill moment comes first. The uploads: the pointer's upload (`latest` or `latest.tmp`,
# the last one a save makes) or, in the roomy cache, a random data file's first request is held
# at the fault proxy when the kill lands, then dropped or sent on. Again during recovery: as the
# uploads (the pointer held, then dropped), then the remounted daemon is killed while its
# recovery's upload of the pointer is held. After all was durable: once the store holds every
# file and the new pointer.
PHASES = (
    "killed during writes",
    "killed during uploads",
    "killed again during recovery",
    "killed after all was durable",
)
POINTER = rf"/{PREFIX}/latest(\.tmp)?$"


@pytest.mark.timeout(3600 if LONG else 600)
@pytest.mark.parametrize("cache", list(CACHES))
def test_crash_torture(s3_server, s3_bucket, tmp_path, capsys, cache):
    from tests.support.faultproxy import FaultProxy, Rule, hold

    seed = int(os.environ.get("CKPTFS_TORTURE_SEED") or random.SystemRandom().randrange(1 << 32))
    rng = random.Random(seed)
    store = Store(s3_server.client(), s3_bucket, PREFIX)
    ram_cache, cache_size = CACHES[cache]
    proxy = FaultProxy(s3_server.endpoint).start()  # the mount's way to the store: its holds
    m = Mount(
        f"s3://{s3_bucket}/{PREFIX}",
        tmp_path / "m",
        endpoint_url=proxy.url,
        ram_cache=ram_cache,
        cache_size=cache_size,
        extra=("--upload-concurrency", "3"),
    )  # uploads last a little longer: more kills land in them
    logs = tmp_path / "logs"
    logs.mkdir()
    known: dict[str, dict] = {}
    known_latest: bytes | None = None
    stats: Counter = Counter()
    writer: subprocess.Popen | None = None
    started = time.monotonic()
    try:
        m.start()
        for trial in range(TRIALS):
            planned = PHASES[trial % len(PHASES)]
            t = Trial(
                trial,
                store,
                known,
                known_latest,
                tmp_path / "scratch",
                f"trial {trial} (seed {seed}, {planned}, plan {crash_writer.plan(trial)})",
            )
            stop = []
            if planned == "killed during writes":
                entry = rng.choice(t.plan.entries)
                stop = [f"{entry.index}:{rng.randint(0, crash_writer.chunks(entry))}"]
            gate = None
            if planned == "killed during uploads" and cache == "roomy" and rng.random() < 0.5:
                # A data file's first request held (its put, or its multipart upload's create,
                # part or completion); the roomy cache only: in the tight one a file whose blocks
                # cannot go out stalls the writes.
                entry = rng.choice(t.plan.entries)
                path = rf"/{PREFIX}/{t.plan.dir}(\.tmp)?/{re.escape(entry.name)}$"
                kinds = ("put", "create_multipart", "upload_part", "complete_multipart", "copy")
                gate = proxy.add_rule(Rule(hold(), kind=kinds, path=path, count=1))
            elif planned in ("killed during uploads", "killed again during recovery"):
                gate = proxy.add_rule(Rule(hold(), kind=("put", "copy"), path=POINTER, count=1))
            log = logs / f"trial-{trial:03d}.log"
            with open(logs / f"trial-{trial:03d}.out", "wb") as out:
                writer = subprocess.Popen(
                    [sys.executable, str(WRITER), str(m.path), str(trial), str(log), *stop],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            deadline = time.monotonic() + 60
            while not _read_log(log):
                if writer.poll() is not None or time.monotonic() > deadline:
                    t.fail(f"the writer did not start: {(logs / f'trial-{trial:03d}.out').read_text()}")
                time.sleep(0.01)
            if planned == "killed during writes":  # a random moment, at the latest its stop
                until = time.monotonic() + rng.uniform(0, 0.5)
                while time.monotonic() < until and proc_state(writer.pid) != "T":
                    if writer.poll() is not None:
                        t.fail(f"the writer exited: {(logs / f'trial-{trial:03d}.out').read_text()}")
                    time.sleep(0.005)
            else:
                _wait_for_done(t, writer, log)
                if gate is not None:
                    gate.wait_held(60)  # an upload's request is at the proxy, held
                    time.sleep(rng.uniform(0, 0.25))
                else:
                    deadline = time.monotonic() + 120
                    while not _all_durable(t, store):
                        if time.monotonic() > deadline:
                            t.fail("the save did not become durable in 120 s")
                        time.sleep(0.05)
                    time.sleep(rng.uniform(0, 1.0))
            if planned == "killed during uploads" and rng.random() < 0.5:
                # Its store workers first (issue 42): the parts they held go again, or the
                # daemon's own kill, a moment later, lands while they do.
                stats["store workers killed"] += _kill_store_workers(m)
                time.sleep(rng.uniform(0, 0.3))
            killed_at = time.monotonic()
            kill_daemon(m)
            _stop_writer(writer)  # it gets ENOTCONN/EIO (a stopped one once continued) and exits
            events = _read_log(log)
            t.confirmed = [what for what, _ in events]
            ready_at = events[0][1]
            if "done" not in t.confirmed:
                observed = "killed during writes"
                phase = f"during writes, after {t.confirmed[1:] or 'nothing'}"
            else:  # every file and the pointer committed: were they all uploaded?
                everything = _all_durable(t, store)
                observed = "killed after all was durable" if everything else "killed during uploads"
                phase = f"{killed_at - events[-1][1]:.3f} s after the writer's last close, " + (
                    "everything durable" if everything else "uploads pending"
                )
            if gate is not None:
                phase += f" ({gate.held[0].kind} {gate.held[0].path} held)"
            stats[observed] += 1
            first = "killed during uploads" if planned == "killed again during recovery" else planned
            if observed != first:
                t.fail(f"the kill was planned {first} but landed {phase}")
            if gate is not None:
                assert not gate.held[0].done.is_set(), "the pointer's held upload went on before the kill"
                forward = planned == "killed during uploads" and rng.random() < 0.5
                gate.release(forward=forward)  # an in-flight request that reaches the store, or not
                gate.held[0].done.wait(30)
                proxy.remove_rule(gate)
            t.check_store("right after the kill")
            if VERBOSE:
                with capsys.disabled():
                    print(
                        f"\ntrial {trial}: kill at {killed_at - ready_at:.3f} s, {phase}; "
                        f"writes took {events[-1][1] - ready_at:.3f} s",
                        end="",
                    )
            if planned == "killed again during recovery":
                # The pointer never reached the store: the recovery uploads it; kill it then.
                again = proxy.add_rule(Rule(hold(), kind=("put", "copy"), path=POINTER, count=1))
                m.start()
                again.wait_held(60)
                time.sleep(rng.uniform(0, 0.25))
                kill_daemon(m)
                assert not again.held[0].done.is_set()
                stats["killed again during recovery"] += 1
                again.release(forward=False)
                again.held[0].done.wait(30)
                proxy.remove_rule(again)
                t.check_store("right after the second kill")
            m.start()
            t.check_mount(m.path, "after the remount, before sync")
            m.sync(timeout=240)
            known = t.check_after_sync(m.path, store)
            known_latest = (store.get("latest") or (None,))[0]
            stats["files verified"] += t.verified
            if t.leaked_uploads:
                stats["multipart uploads leaked by the known bug"] += t.leaked_uploads
            if t.eio_retries:
                stats["reads that hit the known EIO-racing-a-move bug"] += t.eio_retries
            stats["closes confirmed"] += sum(1 for line in t.confirmed if line.startswith("closed "))
        m.stop()
    finally:
        _stop_writer(writer)
        proxy.clear()
        m.cleanup()
        proxy.stop()
    summary = ", ".join(f"{v} {k}" for k, v in sorted(stats.items()))
    with capsys.disabled():
        print(
            f"\ncrash torture ({cache} cache): {TRIALS} trials in {time.monotonic() - started:.0f} s, "
            f"seed {seed}: {summary}"
        )
    if TRIALS >= len(PHASES):
        missing = [p for p in PHASES if not stats[p]]
        assert not missing, f"seed {seed}: no kill landed {missing}: {summary}"


def _wait_for_done(t: Trial, writer: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 60
    while "done" not in [what for what, _ in _read_log(log)]:
        if writer.poll() is not None or time.monotonic() > deadline:
            t.fail(f"the writer {'exited' if writer.poll() is not None else 'hangs'} before it was done")
        time.sleep(0.005)


def _all_durable(t: Trial, store: Store) -> bool:
    """The store holds every file of the trial (under its final directory) and the new pointer."""
    if (store.get("latest") or (None,))[0] != t.latest:
        return False
    return all(store.exists(f"{t.plan.dir}/{e.name}") for e in t.plan.entries)


# -- minimal reproductions of bugs the torture found ----------------------------------------------


def _kill_store_workers(m: Mount) -> int:
    """SIGKILL the mount's store worker processes (transfer/workers.py); how many there were."""
    pids = (m.status().get("store_workers") or {"pids": []})["pids"]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(pids)


def test_mount_right_after_sigkill_clears_the_stale_mount(tmp_path):
    from ckptfs.daemon.mount_paths import prepare_mountpoint
    from ckptfs.errors import CkptfsError

    m = Mount(f"file://{tmp_path / 'store'}", tmp_path / "m")
    try:
        m.start()
        os.stat(m.path)  # the kernel caches the root's attributes (as any use of the mount does)
        pid = m.pid
        os.kill(pid, signal.SIGKILL)
        while proc_state(pid) not in (None, "Z"):  # dead: its FUSE connection is gone
            time.sleep(0.005)
        m.pid = None
        config = MountConfig(mountpoint=str(m.path), store_url=m.store_url, cache_dir=str(m.cache_dir))
        try:
            prepare_mountpoint(config.mountpoint)  # what the daemon does first
        except CkptfsError as exc:
            pytest.fail(f"a dead daemon's mount is taken for a live one: {exc}")
    finally:
        m.cleanup()


@pytest.mark.timeout(120)
def test_renamed_directory_does_not_come_back_after_a_crash(s3_server, s3_bucket, tmp_path):
    """Found by the torture (fixed since): a directory rename journaled the old directory's
    delete before its children's moves; replay skipped the delete (the directory still had
    children then) and the old name came back, empty, after a crash."""
    m = Mount(f"s3://{s3_bucket}/run", tmp_path / "m", endpoint_url=s3_server.endpoint)
    try:
        m.start()
        (m.path / "ckpt.tmp").mkdir()
        (m.path / "ckpt.tmp" / "shard.bin").write_bytes(b"x" * 1000)
        m.sync()  # durable: the rename below is a server-side move
        (m.path / "big.bin").write_bytes(os.urandom(256 << 20))  # keeps the publisher busy a while
        os.rename(m.path / "ckpt.tmp", m.path / "ckpt")  # HF Trainer's temp dir + rename
        assert (
            os.getxattr(m.path / "big.bin", "user.ckptfs.state") == b"pending"
        )  # rename not yet in the store
        kill_daemon(m)
        m.start()
        assert (m.path / "ckpt" / "shard.bin").read_bytes() == b"x" * 1000
        assert sorted(os.listdir(m.path)) == ["big.bin", "ckpt"]
    finally:
        m.cleanup()


@pytest.mark.timeout(120)
def test_read_racing_the_move_of_a_renamed_file(s3_server, s3_bucket, tmp_path):
    """Found by the torture (fixed since): a read of an uncached block raced the server-side
    move of a rename: the fetcher took content.key, the publisher copied and deleted the
    object, the GET reached the store after the delete and the reader got EIO ('is gone from
    the store'). The fetcher now follows content.key on NotFound, waiting for the move."""
    from tests.support.faultproxy import FaultProxy, Rule, hold

    data = os.urandom(1 << 20)
    client = s3_server.client()
    with FaultProxy(s3_server.endpoint) as proxy:
        writer = Mount(f"s3://{s3_bucket}/run", tmp_path / "w", endpoint_url=proxy.url)
        # (reads through the daemon: not fetched whole at the open, before the gate is set)
        reader = Mount(
            f"s3://{s3_bucket}/run", tmp_path / "r", endpoint_url=proxy.url, extra=("--fetch-whole", "0")
        )
        try:
            writer.start()
            (writer.path / "ckpt.tmp").mkdir()
            (writer.path / "ckpt.tmp" / "shard.bin").write_bytes(data)
            writer.stop()  # durable
            reader.start()  # another cache dir: nothing cached, reads go to the store
            # O_DIRECT: one FUSE read per call. Through the page cache the kernel retries a failed
            # read once, which hides the error unless the retry races too (as in the torture).
            fd = os.open(reader.path / "ckpt.tmp" / "shard.bin", os.O_RDONLY | os.O_DIRECT)
            gate = proxy.add_rule(Rule(hold(), kind="get", path=r"/ckpt\.tmp/shard\.bin$", count=1))
            try:
                result = {}

                def read():
                    try:
                        result["data"] = os.pread(fd, len(data), 0)
                    except OSError as exc:
                        result["error"] = exc

                thread = threading.Thread(target=read)
                thread.start()
                get = gate.wait_held(30)  # the fetcher took the old key; its GET is at the proxy
                os.rename(reader.path / "ckpt.tmp", reader.path / "ckpt")  # a move: copy + delete
                deadline = time.monotonic() + 30  # the publisher moves the object meanwhile
                while "run/ckpt.tmp/shard.bin" in (keys := _keys(client, s3_bucket)) or (
                    "run/ckpt/shard.bin" not in keys
                ):
                    assert time.monotonic() < deadline, f"the move did not happen: {keys}"
                    time.sleep(0.05)
                assert not get.done.is_set(), "the GET was not held through the move"
                gate.release()  # the GET reaches the store after the delete
                assert get.done.wait(30)
                assert get.status == 404, f"the held GET was answered {get.status}: the race was missed"
                thread.join(30)
                assert result.get("data") == data, f"the read failed: {result.get('error')!r}"
            finally:
                gate.release()
                os.close(fd)
        finally:
            reader.cleanup()
            writer.cleanup()


def _keys(client, bucket: str) -> list[str]:
    """The bucket's object keys, checksum manifests left out."""
    return sorted(
        o["Key"]
        for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])
        if not is_reserved(o["Key"].removeprefix("run/"))
    )


@pytest.mark.timeout(120)
def test_rename_while_the_multipart_upload_is_being_created(s3_server, s3_bucket, tmp_path):
    """Found by the torture (fixed since): a rename retargeting a put while its
    CreateMultipartUpload was in flight recorded the upload under the new key; the parts then
    failed with NoSuchUpload, the publisher stalled 30 s and the first upload leaked."""
    from tests.support.faultproxy import FaultProxy, Rule, hold

    data = os.urandom(20 << 20)
    with FaultProxy(s3_server.endpoint) as proxy:
        m = Mount(f"s3://{s3_bucket}/run", tmp_path / "m", endpoint_url=proxy.url)
        gate = proxy.add_rule(Rule(hold(), kind="create_multipart", count=1))
        try:
            m.start()
            (m.path / "ckpt.tmp").write_bytes(data)  # committed: hashing, then the create (held)
            create = gate.wait_held(60)
            assert create.path.endswith("/run/ckpt.tmp")
            os.rename(m.path / "ckpt.tmp", m.path / "ckpt")  # retargets the pending put
            assert not create.done.is_set(), "the rename came after the create was answered"
            gate.release()
            assert create.done.wait(30) and create.status == 200
            started = time.monotonic()
            m.sync(timeout=60)
            assert time.monotonic() - started < 15, "the upload stalled"
            client = s3_server.client()
            assert client.get_object(Bucket=s3_bucket, Key="run/ckpt")["Body"].read() == data
            assert _keys(client, s3_bucket) == ["run/ckpt"]  # (checksum manifests left out)
            deadline = time.monotonic() + 10  # aborts run in the background
            while (
                uploads := client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])
            ) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert uploads == [], f"leaked multipart uploads: {[u['Key'] for u in uploads]}"
            assert m.status()["errors"] == []
            m.stop()
        finally:
            gate.release()
            m.cleanup()


def _open_uploads(client, bucket: str, wait_s: float = 10) -> list[str]:
    """Keys of in-progress multipart uploads, once those being aborted in the background are gone."""
    deadline = time.monotonic() + wait_s
    while (
        uploads := client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    ) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [u["Key"] for u in uploads]


@pytest.mark.timeout(120)
def test_kill_during_create_multipart_leaks_no_upload(s3_server, s3_bucket, tmp_path):
    from tests.support.faultproxy import FaultProxy, Rule, hold

    data = os.urandom(12 << 20)  # two parts: a multipart upload
    client = s3_server.client()
    with FaultProxy(s3_server.endpoint) as proxy:
        m = Mount(f"s3://{s3_bucket}/run", tmp_path / "m", endpoint_url=proxy.url)
        gate = proxy.add_rule(Rule(hold(), kind="create_multipart", count=1))
        try:
            m.start()
            (m.path / "shard.bin").write_bytes(data)  # committed; its upload starts
            create = gate.wait_held(60)  # CreateMultipartUpload is on its way, held at the proxy
            assert create.path.endswith("/run/shard.bin")
            kill_daemon(m)
            assert not create.done.is_set(), "the create was answered before the kill"
            assert _open_uploads(client, s3_bucket, wait_s=0) == []
            gate.release()  # the store creates the upload; nobody hears its id
            assert create.done.wait(30) and create.status == 200
            assert _open_uploads(client, s3_bucket, wait_s=0) == ["run/shard.bin"]  # the orphan
            m.start()
            m.sync(timeout=60)
            assert client.get_object(Bucket=s3_bucket, Key="run/shard.bin")["Body"].read() == data
            assert _open_uploads(client, s3_bucket) == []
            m.stop()
        finally:
            gate.release()
            m.cleanup()
            for u in client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []):
                client.abort_multipart_upload(Bucket=s3_bucket, Key=u["Key"], UploadId=u["UploadId"])


@pytest.mark.timeout(120)
def test_lost_create_multipart_answer_leaks_no_upload(s3_server, s3_bucket, tmp_path):
    from tests.support.faultproxy import FaultProxy, Rule, drop_response

    data = os.urandom(12 << 20)
    client = s3_server.client()
    with FaultProxy(s3_server.endpoint) as proxy:
        m = Mount(f"s3://{s3_bucket}/run", tmp_path / "m", endpoint_url=proxy.url)
        try:
            m.start()
            proxy.add_rule(
                Rule(drop_response(), kind="create_multipart", count=1)
            )  # the store acts, the answer is lost
            (m.path / "shard.bin").write_bytes(data)
            m.sync(timeout=60)
            assert client.get_object(Bucket=s3_bucket, Key="run/shard.bin")["Body"].read() == data
            assert _open_uploads(client, s3_bucket) == []
            m.stop()
        finally:
            m.cleanup()
            for u in client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []):
                client.abort_multipart_upload(Bucket=s3_bucket, Key=u["Key"], UploadId=u["UploadId"])
