"""gRPC credentials built from the `tls` section, following the files on disk.

Servers use `grpc.dynamic_ssl_server_credentials`: gRPC asks `ServerCertificates.fetch` at
each new connection, and it re-reads the files only when their stamp (mtime, size, inode)
changed, so replacing them rotates the certificate without a restart. Channels opened
through `open_channel` present the files as they are when the channel opens.
"""

from __future__ import annotations

import logging
import threading
from typing import Sequence

import grpc

from services.common.grpc_server import CHANNEL_OPTIONS
from services.common.tls.material import FileStamp, Identity, TLSConfigError, file_stamp, load_identity
from services.common.tls.settings import TLSConfig

log = logging.getLogger(__name__)


def _server_config(identity: Identity) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration(
        [(identity.key_pem, identity.cert_pem)], root_certificates=identity.ca_pem
    )


class ServerCertificates:
    """The certificate-configuration fetcher of one server's credentials."""

    def __init__(self, tls: TLSConfig, role: str | None) -> None:
        self._tls = tls
        self._role = role
        self._lock = threading.Lock()
        self._stamp = file_stamp(tls)
        self.identity = load_identity(tls, role)  # a bad file refuses start-up here
        self.reloads = 0

    def initial(self) -> grpc.ServerCertificateConfiguration:
        return _server_config(self.identity)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """None keeps the current certificates (gRPC's contract for "unchanged")."""
        # gRPC may call this from several threads at once.
        with self._lock:
            stamp = file_stamp(self._tls)
            if stamp == self._stamp:
                return None
            self._stamp = stamp
            try:
                identity = load_identity(self._tls, self._role)
            except TLSConfigError as exc:
                # Mid-rotation (one file replaced, not yet the other) or a bad new file: keep
                # serving with the certificates that work; the next change is tried again.
                log.warning("keeping the current TLS certificates: %s", exc)
                return None
            self.identity = identity
            self.reloads += 1
            log.info("TLS certificates reloaded (valid until %s)", identity.not_after.isoformat())
            return _server_config(identity)


def server_credentials(
    tls: TLSConfig, role: str | None, require_client_cert: bool = True
) -> grpc.ServerCredentials | None:
    """Credentials of an internal port (client certificates required); None when TLS is off."""
    if not tls.enabled:
        return None
    certificates = ServerCertificates(tls, role)
    return grpc.dynamic_ssl_server_credentials(
        certificates.initial(), certificates.fetch, require_client_authentication=require_client_cert
    )


def public_server_credentials(tls: TLSConfig, role: str | None) -> grpc.ServerCredentials | None:
    """Credentials of the router's public port; None when that port is plaintext."""
    if not tls.public_port_secure:
        return None
    return server_credentials(tls, role, require_client_cert=tls.require_client_cert_public)


class _ChannelCredentialCache:
    """One ChannelCredentials per set of files, rebuilt when the files change."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[tuple[str, str, str], tuple[FileStamp, grpc.ChannelCredentials]] = {}

    def get(self, tls: TLSConfig) -> grpc.ChannelCredentials:
        key = (tls.ca_file, tls.cert_file, tls.key_file)
        stamp = file_stamp(tls)
        with self._lock:
            cached = self._entries.get(key)
            if cached is not None and cached[0] == stamp:
                return cached[1]
            try:
                identity = load_identity(tls)
            except TLSConfigError as exc:
                if cached is None:
                    raise
                log.warning("keeping the current TLS client certificates: %s", exc)
                return cached[1]
            credentials = grpc.ssl_channel_credentials(
                root_certificates=identity.ca_pem, private_key=identity.key_pem, certificate_chain=identity.cert_pem
            )
            self._entries[key] = (stamp, credentials)
            return credentials


_channel_credentials = _ChannelCredentialCache()


def channel_credentials(tls: TLSConfig) -> grpc.ChannelCredentials:
    """Credentials presenting this process's certificate and trusting the CA."""
    return _channel_credentials.get(tls)


def open_channel(
    address: str,
    tls: TLSConfig | None,
    options: Sequence[tuple[str, object]] | None = None,
    interceptors: Sequence[grpc.aio.ClientInterceptor] | None = None,
) -> grpc.aio.Channel:
    """A channel to `address` (CHANNEL_OPTIONS unless `options`): mutual TLS when `tls` is
    enabled, plaintext otherwise."""
    options = list(CHANNEL_OPTIONS if options is None else options)
    if tls is None or not tls.enabled:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    if tls.target_name_override:
        options.append(("grpc.ssl_target_name_override", tls.target_name_override))
    return grpc.aio.secure_channel(address, channel_credentials(tls), options=options, interceptors=interceptors)
