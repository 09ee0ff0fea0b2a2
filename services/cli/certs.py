"""Development certificates: a local CA and one certificate per Ballast role.

`ballast certs init DIR` and `ballast up --secure` use this. Keys are EC P-256; every
certificate names its role twice (URI SAN spiffe://ballast/<role> and CN) and carries the
loopback names (127.0.0.1, ::1, localhost), so the local mesh verifies as it dials. Not
for production: the CA key sits next to the certificates it signs.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from services.common.tls.roles import ROLES, role_uri

CA_CERT = "ca.crt"
# Server certificates of a secured local etcd and Redis (`ballast up --secure`).
BACKING_SERVERS = ("etcd", "redis", "kafka")
CA_KEY = "ca.key"
DEFAULT_DAYS = 365
LOOPBACK_NAMES = ("localhost",)
LOOPBACK_IPS = ("127.0.0.1", "::1")


@dataclass(frozen=True)
class Authority:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _pem_cert(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _write(path: Path, data: bytes, private: bool = False) -> None:
    # Written aside and renamed: a service reloading at that moment never reads half a file.
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    if private:
        os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def new_authority(name: str = "Ballast local CA", days: int = DEFAULT_DAYS) -> Authority:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return Authority(cert, key)


def issue(
    authority: Authority, role: str, not_before: dt.datetime | None = None, not_after: dt.datetime | None = None
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A certificate for `role`, valid for client and server use on loopback addresses."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    not_before = not_before or now - dt.timedelta(minutes=5)
    not_after = not_after or now + dt.timedelta(days=DEFAULT_DAYS)
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(role_uri(role))]
    names += [x509.DNSName(n) for n in LOOPBACK_NAMES]
    names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in LOOPBACK_IPS]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, role)]))
        .issuer_name(authority.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(authority.key.public_key()), critical=False)
        .sign(authority.key, hashes.SHA256())
    )
    return cert, key


def cert_path(directory: Path, role: str) -> Path:
    return Path(directory) / f"{role}.crt"


def key_path(directory: Path, role: str) -> Path:
    return Path(directory) / f"{role}.key"


def write_authority(directory: Path, authority: Authority) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    _write(directory / CA_KEY, _pem_key(authority.key), private=True)
    _write(directory / CA_CERT, _pem_cert(authority.cert))


def load_authority(directory: Path) -> Authority:
    cert = x509.load_pem_x509_certificate((Path(directory) / CA_CERT).read_bytes())
    key = serialization.load_pem_private_key((Path(directory) / CA_KEY).read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{Path(directory) / CA_KEY} is not an EC key")
    return Authority(cert, key)


def write_role(directory: Path, authority: Authority, role: str, **validity) -> None:
    """Issues `role`'s certificate and replaces its files (the key first: a reload between
    the two sees a mismatch and keeps the old pair until the certificate follows)."""
    cert, key = issue(authority, role, **validity)
    _write(key_path(directory, role), _pem_key(key), private=True)
    _write(cert_path(directory, role), _pem_cert(cert))


def init_certs(directory: Path, roles: tuple[str, ...] = ROLES + BACKING_SERVERS) -> Path:
    """A CA (kept if DIR already has one) and a fresh certificate per role (and per backing
    server), in `directory`."""
    directory = Path(directory)
    if (directory / CA_CERT).exists() and (directory / CA_KEY).exists():
        authority = load_authority(directory)
    else:
        authority = new_authority()
        write_authority(directory, authority)
    for role in roles:
        write_role(directory, authority, role)
    return directory


def config_lines(directory: Path, role: str = "cli") -> str:
    """The ballast.yaml lines that use these certificates (`role`: whose files)."""
    directory = Path(directory).resolve()
    return "\n".join(
        [
            "tls:",
            "  enabled: true",
            f"  ca_file: {directory / CA_CERT}",
            f"  cert_file: {cert_path(directory, role)}",
            f"  key_file: {key_path(directory, role)}",
        ]
    )


def role_env(directory: Path, role: str, backing: tuple[str, ...] = ()) -> dict[str, str]:
    """Environment that points one service at its own certificate and key, for the `tls`
    section and for each config section named in `backing` (e.g. "etcd": etcd.tls)."""
    directory = Path(directory).resolve()
    env = {}
    for section in ("TLS", *(f"{name.upper()}__TLS" for name in backing)):
        env[f"BALLAST__{section}__CERT_FILE"] = str(cert_path(directory, role))
        env[f"BALLAST__{section}__KEY_FILE"] = str(key_path(directory, role))
    return env


def backing_password(directory: Path) -> str:
    """The password of the local etcd and Redis user: made once, kept (mode 0600) in
    `directory`."""
    import secrets

    path = Path(directory) / "backing.password"
    if not path.exists():
        Path(directory).mkdir(parents=True, exist_ok=True)
        _write(path, secrets.token_urlsafe(24).encode(), private=True)
    return path.read_text().strip()
