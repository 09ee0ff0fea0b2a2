"""Start-up checks of the TLS files a service uses towards etcd, Redis and Kafka.

The same problems `material` finds in the `tls` section (a missing, unreadable or non-PEM
file, a key that is not its certificate's, a certificate outside its validity period) refuse
start-up here too, naming the field, instead of surfacing later as a dependency that never
comes up. The server's CA and the client certificate may come from another authority than
Ballast's own, so no chain to a Ballast CA is required.
"""

from __future__ import annotations

import datetime as dt

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from services.common.config import BackingTLSConfig
from services.common.tls.material import TLSKeyMismatch, TLSNotPEM, check_period, public_der, read_file


def check_backing_tls(tls: BackingTLSConfig, section: str, now: dt.datetime | None = None) -> None:
    """Raises a TLSConfigError when `section`'s TLS (e.g. "etcd.tls") is on and unusable."""
    if not tls.enabled:
        return
    now = now or dt.datetime.now(dt.timezone.utc)
    if tls.ca_file:
        field = f"{section}.ca_file"
        try:
            cas = x509.load_pem_x509_certificates(read_file(tls.ca_file, field))
        except ValueError:
            raise TLSNotPEM(f"config field '{field}': {tls.ca_file} holds no PEM certificate") from None
        for ca in cas:
            check_period(ca, tls.ca_file, field, now)
    if tls.cert_file:
        cert_field, key_field = f"{section}.cert_file", f"{section}.key_file"
        try:
            cert = x509.load_pem_x509_certificates(read_file(tls.cert_file, cert_field))[0]
        except ValueError:
            raise TLSNotPEM(f"config field '{cert_field}': {tls.cert_file} holds no PEM certificate") from None
        try:
            key = serialization.load_pem_private_key(read_file(tls.key_file, key_field), password=None)
        except (ValueError, TypeError):
            raise TLSNotPEM(
                f"config field '{key_field}': {tls.key_file} holds no unencrypted PEM private key"
            ) from None
        if public_der(key.public_key()) != public_der(cert.public_key()):
            raise TLSKeyMismatch(f"config field '{key_field}': {tls.key_file} is not the key of {tls.cert_file}")
        check_period(cert, tls.cert_file, cert_field, now)
