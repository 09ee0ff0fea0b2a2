"""The one way Ballast opens an etcd client: plaintext or TLS, with or without a user.

aetcd authenticates a user itself but dials plaintext only, so `TLSEtcdClient` opens the
same stubs over a TLS channel (server verified against `etcd.tls.ca_file`, and the client
certificate presented when etcd checks them). Every etcd caller goes through `make_client`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aetcd
import grpc
from aetcd import rpc, watcher
from aetcd.client import _handle_errors

from services.common.config import BackingTLSConfig, EtcdConfig


def _read_optional(path: str) -> bytes | None:
    return Path(path).read_bytes() if path else None


def tls_credentials(tls: BackingTLSConfig) -> grpc.ChannelCredentials:
    """Channel credentials from the files (read now: a client is rebuilt on every reconnect,
    so rotated files are picked up then)."""
    return grpc.ssl_channel_credentials(root_certificates=_read_optional(tls.ca_file),
                                        private_key=_read_optional(tls.key_file),
                                        certificate_chain=_read_optional(tls.cert_file))


class TLSEtcdClient(aetcd.Client):
    """aetcd's client over a TLS channel."""

    def __init__(self, credentials: grpc.ChannelCredentials, **kwargs) -> None:
        super().__init__(**kwargs)
        self._credentials = credentials

    @_handle_errors
    async def connect(self) -> None:
        # The same steps as aetcd's connect(), with a secure channel.
        if self._connected.is_set():
            return
        if self._is_connecting:
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            self.channel = grpc.aio.secure_channel(f"{self._host}:{self._port}", self._credentials,
                                                   options=list(self._options.items()))
            if self._username is not None:
                self.auth_stub = rpc.AuthStub(self.channel)
                reply = await self.auth_stub.Authenticate(
                    rpc.AuthenticateRequest(name=self._username, password=self._password), timeout=self._timeout)
                self.metadata = (("token", reply.token),)
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self._watcher = watcher.Watcher(rpc.WatchStub(self.channel), timeout=self._timeout,
                                            metadata=self.metadata)
            self._connected.set()
        finally:
            self._is_connecting = False


def make_client(config: EtcdConfig) -> aetcd.Client:
    """A client for `config`: TLS when `etcd.tls.enabled`, a user when `etcd.username`."""
    kwargs = dict(
        host=config.host, port=config.port,
        username=config.username or None, password=config.password or None,
        # aetcd's timeout is whole seconds; round up so short configs still get a deadline.
        timeout=max(1, round(config.timeout_s + 0.49)),
    )
    if config.tls.enabled:
        return TLSEtcdClient(tls_credentials(config.tls), **kwargs)
    return aetcd.Client(**kwargs)
