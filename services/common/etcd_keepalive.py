"""Lease refreshes over one long-lived etcd LeaseKeepAlive stream.

etcd's LeaseKeepAlive is a bidirectional stream meant to stay open: a refresh is one request
and its reply on it. aetcd's `refresh_lease` opens a stream for every refresh instead (a new
call, a task to feed it, a cancellation to end it), which cost an idle worker 2 to 3 ms of
CPU at each heartbeat: most of what it did while serving nothing. `KeepAliveStream` opens the
stream once per client and sends each refresh on it; one exchange at a time, so a reply always
answers the request before it.

A stream that fails or ends, or an exchange cut short (its reply would answer the next
request), is dropped: the next refresh opens another. The session drops it with its client.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aetcd
import grpc
from aetcd import rpc


class KeepAliveLost(ConnectionError):
    """The keep-alive stream failed or etcd ended it: the refresh may not have happened."""


class KeepAliveStream:
    """One LeaseKeepAlive stream on one client, opened at the first refresh."""

    def __init__(self) -> None:
        self._client: aetcd.Client | None = None
        self._call: Any = None
        self._lock = asyncio.Lock()
        self.opened = 0
        """How many streams were opened (the first, then one after each loss)."""

    @property
    def busy(self) -> bool:
        """A refresh is on the stream (sent, or waiting for its answer)."""
        return self._lock.locked()

    async def refresh(self, client: aetcd.Client, lease_id: int) -> int:
        """Refreshes `lease_id` through `client`; its remaining seconds (<= 0: etcd no longer
        holds it). Raises `KeepAliveLost` when the stream breaks."""
        async with self._lock:
            call = self._stream_on(client)
            try:
                await call.write(rpc.LeaseKeepAliveRequest(ID=lease_id))
                reply = await call.read()
            except grpc.aio.AioRpcError as exc:
                self.drop()
                raise KeepAliveLost(f"etcd lease keep-alive stream failed: {exc.code().name}") from exc
            except BaseException:
                # Cut between request and reply (a deadline, a shutdown): the reply still due
                # would be read as the next refresh's.
                self.drop()
                raise
            if reply is grpc.aio.EOF:
                self.drop()
                raise KeepAliveLost("etcd ended the lease keep-alive stream")
            return int(reply.TTL)

    def _stream_on(self, client: aetcd.Client) -> Any:
        if self._call is not None and (self._client is not client or self._call.done()):
            self.drop()
        if self._call is None:
            self._call = client.leasestub.LeaseKeepAlive(metadata=client.metadata)
            self._client = client
            self.opened += 1
        return self._call

    def drop(self, client: aetcd.Client | None = None) -> None:
        """Ends the stream (only if it is on `client`, when given); the next refresh opens one."""
        if client is not None and client is not self._client:
            return
        call, self._call, self._client = self._call, None, None
        if call is not None:
            call.cancel()
