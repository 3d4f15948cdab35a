"""CPU seconds per GiB of each checksum ckptfs could put on a part (docs/architecture.md, Integrity).

    .venv/bin/python -m bench.checksum_cost [--mib 1024]

Hashes 8 MiB parts (the default part size) of random bytes, already in memory, and reports the
process CPU time per GiB for: xxh3-64 and xxh3-128 (the xxhash package ckptfs uses), SHA-256
(what SigV4 payload signing costs botocore), MD5 (what S3/Swift compute for a part's ETag),
CRC32 through botocore's own (zlib) checksum class, CRC32C / CRC64NVME where botocore can
compute them (only with awscrt installed), and what ckptfs itself sends where the server verifies
S3 checksums: the CRC32C header value (store/s3_client.py crc32c_b64, awscrt directly), on top of xxh3.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time
import zlib

import xxhash

PART = 8 << 20


def _botocore(name: str):
    """A botocore flexible-checksum class by name, or None when this install cannot compute it."""
    try:
        from botocore import httpchecksum

        cls = getattr(httpchecksum, name)
        cls().update(b"x")
        return cls
    except Exception:  # noqa: BLE001 - awscrt missing: the Crt* classes fail to build
        return None


def candidates() -> dict[str, object]:
    out = {
        "xxh3-64": lambda b: xxhash.xxh3_64_hexdigest(b),
        "xxh3-128": lambda b: xxhash.xxh3_128_hexdigest(b),
        "crc32 (zlib)": lambda b: zlib.crc32(b),
        "sha256 (SigV4 payload)": lambda b: hashlib.sha256(b).hexdigest(),
        "md5 (S3 part ETag)": lambda b: hashlib.md5(b).hexdigest(),
    }
    try:
        from ckptfs.store.s3_client import crc32c_b64

        if crc32c_b64(b"x") is not None:
            out["crc32c header (ckptfs, awscrt)"] = crc32c_b64
            out["xxh3 + crc32c (a part, S3 checks)"] = lambda b: (xxhash.xxh3_64_hexdigest(b), crc32c_b64(b))
    except ImportError:  # boto3 missing
        pass
    for label, name in (
        ("crc32c (botocore/awscrt)", "CrtCrc32cChecksum"),
        ("crc64nvme (botocore/awscrt)", "CrtCrc64NvmeChecksum"),
    ):
        cls = _botocore(name)
        if cls is None:
            out[label] = None
        else:

            def crc(b, cls=cls):
                c = cls()
                c.update(b)
                return c.digest()

            out[label] = crc
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="bytes hashed per checksum, in MiB")
    args = parser.parse_args()
    parts = max(1, args.mib * (1 << 20) // PART)
    data = bytearray(os.urandom(PART))
    gib = parts * PART / (1 << 30)
    print(f"{parts} parts of {PART >> 20} MiB ({gib:.2f} GiB) per checksum, one thread")
    from ckptfs.objects.integrity import Checksums, part_hash

    checks = Checksums(parts * PART, PART, [part_hash(data)] * parts)
    print(f"  {'ckptfs read check':34s}", end=" ")
    cpu = time.process_time()
    for i in range(parts):
        checks.check(i * PART, data)
    print(f"{(time.process_time() - cpu) / gib:6.3f} CPU s/GiB")
    for label, fn in candidates().items():
        if fn is None:
            print(f"  {label:34s} not available here (needs awscrt)")
            continue
        fn(data)  # warm up
        cpu = time.process_time()
        for _ in range(parts):
            fn(data)
        cpu = time.process_time() - cpu
        print(f"  {label:34s} {cpu / gib:6.3f} CPU s/GiB")


if __name__ == "__main__":
    main()
