"""HTTPS for the HTTP front: the router's public certificates, whenever its gRPC public port has TLS.

The files are the ones the public gRPC port serves (`tls.cert_file`, `tls.key_file`), checked
the same way before the port opens (`load_identity`); like the gRPC port, a replaced
certificate is picked up at the next handshake without a restart. With
`tls.require_client_cert_public` a client certificate signed by `tls.ca_file` is required here too.
"""

from __future__ import annotations

import logging
import ssl

from services.common.tls.material import TLSConfigError, file_stamp, load_identity
from services.common.tls.settings import TLSConfig

log = logging.getLogger(__name__)


class _Certificates:
    """Loads the certificate chain into `context`, again whenever the files changed."""

    def __init__(self, tls: TLSConfig, role: str, context: ssl.SSLContext) -> None:
        self._tls = tls
        self._role = role
        self._context = context
        load_identity(tls, role)  # a bad file refuses start-up here, as on the gRPC port
        self._stamp = file_stamp(tls)
        context.load_cert_chain(tls.cert_file, tls.key_file)

    def refresh(self, *_args) -> None:
        """The handshake's SNI callback: a stat of the files, a reload only when they changed."""
        stamp = file_stamp(self._tls)
        if stamp == self._stamp:
            return None
        self._stamp = stamp
        try:
            load_identity(self._tls, self._role)
            self._context.load_cert_chain(self._tls.cert_file, self._tls.key_file)
        except (TLSConfigError, ssl.SSLError, OSError) as exc:
            # Mid-rotation or a bad new file: keep serving with the chain that works.
            log.warning("keeping the HTTP front's current TLS certificates: %s", exc)
            return None
        log.info("HTTP front TLS certificates reloaded")
        return None


def https_context(tls: TLSConfig, role: str = "router") -> ssl.SSLContext | None:
    """The server context of the HTTP front; None when the public port is plaintext."""
    if not tls.public_port_secure:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if tls.require_client_cert_public:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(tls.ca_file)
    certificates = _Certificates(tls, role, context)
    context.sni_callback = certificates.refresh
    return context
