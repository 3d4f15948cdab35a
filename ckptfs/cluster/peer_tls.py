"""The peer channel's keys: each node's own TLS key and self-signed certificate, and the
contexts that admit only the certificates the cluster's members published in the store.

A node makes an EC P-256 key and a certificate for it once, kept 0600 in its cache dir (a
restarted node keeps its identity). Its member record in the store carries the certificate
(``cluster/members.py``); so only who can write the store (holds its credentials) can become a
peer. Both ends present a certificate and both check it (mutual TLS 1.3): a server admits a
client only if its certificate is one of the live members', a client talks to a server only if
it shows the certificate that server's record names. Nothing else is trusted (no CA, no
hostname: peers are known by their certificates).
"""

from __future__ import annotations

import datetime
import hashlib
import ssl
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from ckptfs.util import private_files

KEY_FILE, CERT_FILE = "peer.key", "peer.crt"
VALID_DAYS = 3650  # never the reason a peer is refused: a node's key lives as long as its cache dir


class Identity:
    """This node's key and certificate (PEM), made on first use and kept in ``cache_dir``."""

    def __init__(self, cache_dir: Path, node: str):
        self.key_path, self.cert_path = cache_dir / KEY_FILE, cache_dir / CERT_FILE
        try:
            private_files.read_file(self.key_path)  # (checks it is ours, 0600, not a link)
            self.cert_pem = private_files.read_file(self.cert_path)
            x509.load_pem_x509_certificate(self.cert_pem)
        except (FileNotFoundError, ValueError):
            key_pem, self.cert_pem = _make(node)
            private_files.write_file(self.key_path, key_pem)
            private_files.write_file(self.cert_path, self.cert_pem)
        self.fingerprint = fingerprint(self.cert_pem)

    def context(self, server: bool, trusted: list[bytes]) -> ssl.SSLContext:
        """A TLS 1.3 context that shows this node's certificate and accepts only ``trusted``."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_cert_chain(self.cert_path, self.key_path)  # (ours, 0600, in the 0700 cache dir)
        if trusted:
            ctx.load_verify_locations(cadata=b"".join(trusted).decode("ascii"))
        return ctx


def fingerprint(cert_pem: bytes) -> str:
    """The SHA-256 of a certificate's DER bytes, as hex."""
    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(cert_pem.decode("ascii"))).hexdigest()


def der_fingerprint(der: bytes) -> str:
    return hashlib.sha256(der).hexdigest()


def valid_cert(cert_pem: bytes) -> bool:
    """Whether ``cert_pem`` is exactly one certificate OpenSSL takes as a trust anchor (what a
    server context will be given: a record that is anything else must not reach it)."""
    try:
        text = cert_pem.decode("ascii")
        if text.count("-----BEGIN") != 1:
            return False
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=text)
        x509.load_pem_x509_certificate(cert_pem)
    except (UnicodeDecodeError, ValueError, ssl.SSLError):
        return False
    return True


def _make(node: str) -> tuple[bytes, bytes]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"ckptfs-node-{node}")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        # its own trust anchor: OpenSSL accepts a self-signed certificate in the trust store as a CA
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return key_pem, cert.public_bytes(serialization.Encoding.PEM)
