"""Reading and checking this process's TLS files: the CA bundle, its certificate and key.

Every problem a service could only discover at its first handshake is found here, before
it serves: a missing, unreadable or non-PEM file, a key that does not belong to the
certificate, a certificate outside its validity period, not signed by the CA, or naming
another role. Each is its own `TLSConfigError` type (a `ConfigError`: the process exits
non-zero with the message).
"""

from __future__ import annotations

import datetime as dt
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import NameOID

from services.common.config import ConfigError
from services.common.tls.roles import ROLES, role_from_names
from services.common.tls.settings import TLSConfig


class TLSConfigError(ConfigError):
    """A TLS file cannot be used; the message names the file and the field."""


class TLSFileMissing(TLSConfigError):
    pass


class TLSFileUnreadable(TLSConfigError):
    pass


class TLSNotPEM(TLSConfigError):
    pass


class TLSKeyMismatch(TLSConfigError):
    pass


class TLSCertExpired(TLSConfigError):
    pass


class TLSCertNotYetValid(TLSConfigError):
    pass


class TLSCertUntrusted(TLSConfigError):
    pass


class TLSRoleMismatch(TLSConfigError):
    pass


@dataclass(frozen=True)
class Identity:
    """The PEM bytes gRPC needs, checked, and the role the certificate names."""

    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes
    role: str | None
    not_after: dt.datetime


FileStamp = tuple[tuple[int, int, int], ...]


def file_stamp(tls: TLSConfig) -> FileStamp:
    """Changes whenever one of the three files is replaced or rewritten (a missing file
    stamps as zeros, so its return is a change too)."""
    stamps = []
    for path in (tls.ca_file, tls.cert_file, tls.key_file):
        try:
            st = os.stat(path)
            stamps.append((st.st_mtime_ns, st.st_size, st.st_ino))
        except OSError:
            stamps.append((0, 0, 0))
    return tuple(stamps)


def read_file(path: str, field: str) -> bytes:
    file = Path(path)
    if not file.exists():
        raise TLSFileMissing(f"config field '{field}': {path} does not exist")
    try:
        return file.read_bytes()
    except OSError as exc:
        raise TLSFileUnreadable(f"config field '{field}': cannot read {path}: {exc.strerror}") from None


def certificate_role(cert: x509.Certificate) -> str | None:
    """The Ballast role a certificate names: its URI SAN spiffe://ballast/<role>, else its CN."""
    names: list[str] = []
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names.extend(san.get_values_for_type(x509.UniformResourceIdentifier))
    except x509.ExtensionNotFound:
        pass
    common_names = [str(a.value) for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    return role_from_names(names, common_names)


def check_period(cert: x509.Certificate, path: str, field: str, now: dt.datetime) -> None:
    if now < cert.not_valid_before_utc:
        raise TLSCertNotYetValid(
            f"config field '{field}': {path} is valid only from {cert.not_valid_before_utc.isoformat()}"
        )
    if now > cert.not_valid_after_utc:
        raise TLSCertExpired(f"config field '{field}': {path} expired at {cert.not_valid_after_utc.isoformat()}")


def _issued_by_one_of(cert: x509.Certificate, cas: list[x509.Certificate]) -> bool:
    for ca in cas:
        try:
            cert.verify_directly_issued_by(ca)
            return True
        except (ValueError, TypeError, InvalidSignature):
            continue
    return False


def public_der(key) -> bytes:
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def load_identity(tls: TLSConfig, role: str | None = None, now: dt.datetime | None = None) -> Identity:
    """Reads and checks the files; `role`, when given, must be the role the certificate names."""
    now = now or dt.datetime.now(dt.timezone.utc)
    ca_pem = read_file(tls.ca_file, "tls.ca_file")
    cert_pem = read_file(tls.cert_file, "tls.cert_file")
    key_pem = read_file(tls.key_file, "tls.key_file")
    try:
        cas = x509.load_pem_x509_certificates(ca_pem)
    except ValueError:
        raise TLSNotPEM(f"config field 'tls.ca_file': {tls.ca_file} holds no PEM certificate") from None
    try:
        cert = x509.load_pem_x509_certificates(cert_pem)[0]
    except ValueError:
        raise TLSNotPEM(f"config field 'tls.cert_file': {tls.cert_file} holds no PEM certificate") from None
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError):
        # TypeError: an encrypted key; services cannot prompt for its password.
        raise TLSNotPEM(f"config field 'tls.key_file': {tls.key_file} holds no unencrypted PEM private key") from None
    if public_der(key.public_key()) != public_der(cert.public_key()):
        raise TLSKeyMismatch(f"config field 'tls.key_file': {tls.key_file} is not the key of {tls.cert_file}")
    for ca in cas:
        check_period(ca, tls.ca_file, "tls.ca_file", now)
    check_period(cert, tls.cert_file, "tls.cert_file", now)
    if not _issued_by_one_of(cert, cas):
        raise TLSCertUntrusted(f"config field 'tls.cert_file': {tls.cert_file} is not signed by a CA of {tls.ca_file}")
    named = certificate_role(cert)
    if role is not None and named != role:
        raise TLSRoleMismatch(
            f"config field 'tls.cert_file': {tls.cert_file} names role {named or 'none'}, "
            f"this process is {role} (one of {', '.join(ROLES)})"
        )
    return Identity(ca_pem, cert_pem, key_pem, named, cert.not_valid_after_utc)


def check_identity(tls: TLSConfig, role: str | None) -> None:
    """Refuses start-up (TLSConfigError) when TLS is on and its files cannot be used."""
    if tls.enabled:
        load_identity(tls, role)
