"""Orphan manifests (issue 15): the manifest of an object overwritten or deleted behind ckptfs's
back, or of an upload that never completed, is collected; a manifest some object names, or whose
upload may still complete (on another mount), never is. On the real S3 server (Swift), the store
changed by hand through boto3 as another tool or a down daemon would leave it."""

from __future__ import annotations

import os
import time

import pytest

from ckptfs.objects import integrity
from ckptfs.store.s3 import S3Store
from tests.support.harness import wait_until
from tests.support.mounting import Mount

pytestmark = [pytest.mark.e2e, pytest.mark.store, pytest.mark.timeout(240)]

PREFIX = "run"
MiB = 1 << 20


@pytest.fixture
def object_store(s3_server, s3_bucket):
    s = S3Store.connect(s3_bucket, PREFIX, endpoint_url=s3_server.endpoint)
    yield s
    s.close()


@pytest.fixture
def written(s3_server, s3_bucket, tmp_path):
    """Four multipart files (each with a manifest) written through a mount, which is then stopped:
    what happens next happens while no daemon runs."""
    m = Mount(f"s3://{s3_bucket}/{PREFIX}", tmp_path / "w", endpoint_url=s3_server.endpoint)
    names = ["kept.bin", "overwritten.bin", "deleted.bin", "renamed.bin"]
    try:
        m.start()
        for name in names:
            (m.path / name).write_bytes(os.urandom(9 * MiB))
        m.stop()
        yield m
    finally:
        m.cleanup()


def upload_of(client, bucket: str, name: str) -> str:
    return client.head_object(Bucket=bucket, Key=f"{PREFIX}/{name}")["Metadata"]["ckptfs-upload"]


def manifest_names(client, bucket: str) -> set[str]:
    answer = client.list_objects_v2(Bucket=bucket, Prefix=f"{PREFIX}/{integrity.MANIFEST_PREFIX}")
    return {o["Key"].rsplit("/", 1)[1] for o in answer.get("Contents", [])}


def test_orphans_are_collected_and_live_manifests_kept(s3_bucket, client, object_store, written):
    ups = {
        name: upload_of(client, s3_bucket, name)
        for name in ("kept.bin", "overwritten.bin", "deleted.bin", "renamed.bin")
    }
    assert set(ups.values()) <= manifest_names(client, s3_bucket)
    # Behind ckptfs's back: an overwrite by another tool, a delete, a rename by server-side copy
    # (the copy keeps the metadata naming the manifest), and a leftover checksum probe.
    client.put_object(Bucket=s3_bucket, Key=f"{PREFIX}/overwritten.bin", Body=os.urandom(9 * MiB))
    client.delete_object(Bucket=s3_bucket, Key=f"{PREFIX}/deleted.bin")
    client.copy_object(
        Bucket=s3_bucket,
        Key=f"{PREFIX}/a-new-name.bin",
        CopySource={"Bucket": s3_bucket, "Key": f"{PREFIX}/renamed.bin"},
        MetadataDirective="COPY",
    )
    client.delete_object(Bucket=s3_bucket, Key=f"{PREFIX}/renamed.bin")
    client.put_object(
        Bucket=s3_bucket, Key=f"{PREFIX}/{integrity.MANIFEST_PREFIX}{integrity.PROBE_NAME}x", Body=b""
    )

    # Young manifests are never judged.
    assert integrity.orphan_manifests(object_store, time.time(), min_age=3600) == []
    # A sweep judges at most `limit` manifests (a random sample of the old ones).
    assert len(integrity.orphan_manifests(object_store, time.time() + 1, min_age=0, limit=1)) <= 1
    found = integrity.orphan_manifests(object_store, time.time() + 1, min_age=0)
    assert sorted(found) == sorted(
        [
            integrity.manifest_key(ups["overwritten.bin"]),
            integrity.manifest_key(ups["deleted.bin"]),
            integrity.MANIFEST_PREFIX + integrity.PROBE_NAME + "x",
        ]
    )


def test_the_manifest_of_an_upload_that_may_still_complete_is_kept(s3_bucket, client, object_store, written):
    """Another mount between its manifest PUT and its CompleteMultipartUpload (or retrying the
    Complete through an outage): its upload is in progress, started before the manifest was
    written, so no manifest written after that start is collected until the upload ends."""
    upload_of_gone = upload_of(client, s3_bucket, "deleted.bin")
    client.delete_object(Bucket=s3_bucket, Key=f"{PREFIX}/deleted.bin")
    orphan = integrity.manifest_key(upload_of(client, s3_bucket, "kept.bin") + "x")
    time.sleep(1.1)  # (deleted.bin's manifest, just written by the mount, is then older than the upload)
    upload = client.create_multipart_upload(Bucket=s3_bucket, Key=f"{PREFIX}/other-mount.bin")["UploadId"]
    time.sleep(1.1)  # (the server's times have one-second resolution)
    object_store.put(
        orphan, integrity.Checksums(9 * MiB, 8 * MiB, ["0", "1"], "", "u", "manifest").to_manifest()
    )
    deleted = integrity.manifest_key(upload_of_gone)
    # Kept while that upload may complete; deleted.bin's, written before the upload started, goes.
    assert integrity.orphan_manifests(object_store, time.time() + 1, min_age=0) == [deleted]
    client.abort_multipart_upload(Bucket=s3_bucket, Key=f"{PREFIX}/other-mount.bin", UploadId=upload)
    found = integrity.orphan_manifests(object_store, time.time() + 1, min_age=0)
    assert orphan in found and integrity.manifest_key(upload_of(client, s3_bucket, "kept.bin")) not in found
    assert len(found) == 2  # and deleted.bin's


def sweep_line(m: Mount) -> str:
    """The daemon's line saying whether it swept (once it has decided), from its log."""
    lines = (m.cache_dir / "ckptfs.log").read_text(errors="replace").splitlines()
    return next((line for line in lines if "manifest sweep: " in line), "")


def test_a_mount_sweeps_at_most_once_a_day_over_all_mounts(
    s3_server, s3_bucket, client, object_store, written, tmp_path
):
    """The mount in ``written`` swept at its start (the stamp is there, its log says so); a second
    mount within the day does not (its log says so, the stamp is the first's), and the sweep
    never deleted a live manifest."""
    assert "orphan manifests deleted" in sweep_line(written)
    stamp = client.head_object(Bucket=s3_bucket, Key=f"{PREFIX}/{integrity.SWEEP_STAMP}")
    assert time.time() - stamp["LastModified"].timestamp() < 600
    assert integrity.sweep_due(object_store, time.time()) is False
    assert integrity.sweep_due(object_store, time.time() + integrity.SWEEP_EVERY_S + 1) is True
    stamp = client.head_object(Bucket=s3_bucket, Key=f"{PREFIX}/{integrity.SWEEP_STAMP}")  # (stamped again)
    m = Mount(f"s3://{s3_bucket}/{PREFIX}", tmp_path / "r", endpoint_url=s3_server.endpoint)
    try:
        m.start()
        line = wait_until(lambda: sweep_line(m), 60, what="the second mount's sweep decision")
        assert "manifest sweep: not due" in line, line
        again = client.head_object(Bucket=s3_bucket, Key=f"{PREFIX}/{integrity.SWEEP_STAMP}")
        assert again["ETag"] == stamp["ETag"] and again["LastModified"] == stamp["LastModified"]
        assert sorted(os.listdir(m.path)) == ["deleted.bin", "kept.bin", "overwritten.bin", "renamed.bin"]
        assert (m.path / "kept.bin").stat().st_size == 9 * MiB
        assert len((m.path / "renamed.bin").read_bytes()) == 9 * MiB  # its manifest is there: it reads
    finally:
        m.cleanup()
