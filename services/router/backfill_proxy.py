"""The router's Subscribe and GetBackfill: better answers, relayed from the backfill service.

The backfill service is the one place that reads the answer store and decides which
subscription pushes a ticket; the router only relays. It first checks what it can on its own
(the API key, the ticket or session), so bad input gets its error even while the backfill is
away, then forwards the caller's auth metadata and remaining deadline. A backfill that cannot
be reached is UNAVAILABLE with a message saying so, and `ballast_dependency_up{dependency=
"backfill"}` shows it; Generate never waits on it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Iterable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.metrics import CallbackOptions, Observation

from ballast.v1 import backfill_pb2, backfill_pb2_grpc
from services.common.degraded.targets import check_ticket, subscription_target
from services.config import BallastConfig
from services.common.errors import (
    BackfillExpired,
    BackfillLost,
    BackfillPending,
    BallastError,
    Cancelled,
    DeadlineExceeded,
    Fault,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from services.common.auth import API_KEY_HEADER, Authenticator
from services.common.faults import classify, retry_after_hint
from services.common.grpc_server import CHANNEL_OPTIONS
from services.common.probes import DependencyProbe
from services.common.telemetry import DependencyStatus, Telemetry
from services.common.tls.credentials import open_channel
from services.common.tls.settings import TLSConfig

log = logging.getLogger(__name__)

DEPENDENCY = "backfill"
# Only credentials travel on: the backfill authenticates the caller with the same keys.
FORWARDED_METADATA = (API_KEY_HEADER, "authorization")
# gRPC's default reconnect backoff grows to two minutes; a restarted backfill should be
# found again within a second, well inside CONNECT_WAIT_S.
PROXY_CHANNEL_OPTIONS = [
    *CHANNEL_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
# How long a call waits for a connection before it is UNAVAILABLE.
CONNECT_WAIT_S = 2.0
# Errors the backfill sends that mean the same to the router's caller.
_PASSED_ON: dict[grpc.StatusCode, type[BallastError]] = {
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
}
# Why an answer is not there (not yet, expired, lost) goes on by fault, not only by code.
_PASSED_ON_FAULT: dict[Fault, type[BallastError]] = {
    Fault.BACKFILL_PENDING: BackfillPending,
    Fault.BACKFILL_EXPIRED: BackfillExpired,
    Fault.BACKFILL_LOST: BackfillLost,
}


def backfill_address(config: BallastConfig) -> str:
    """router.backfill_address, or the backfill section's own host and port."""
    if config.router.backfill_address:
        return config.router.backfill_address
    host = config.backfill.host
    # A wildcard bind address is where the backfill listens, not where to dial it.
    if host in ("0.0.0.0", "::", "[::]", ""):
        host = "127.0.0.1"
    return f"{host}:{config.backfill.port}"


class BackfillProxy:
    """One channel to the backfill service, its reachability probe, and the two relays."""

    def __init__(
        self,
        address: str,
        auth: Authenticator,
        dependencies: DependencyStatus,
        timeout_s: float = 5.0,
        subscribe_max_s: float = 3600.0,
        probe_interval_s: float = 2.0,
        tls: TLSConfig | None = None,
    ) -> None:
        self.address = address
        self.auth = auth
        self.timeout_s = timeout_s
        self.subscribe_max_s = subscribe_max_s
        self.subscriptions = 0
        self._channel = open_channel(address, tls, options=PROXY_CHANNEL_OPTIONS)
        self._stub = backfill_pb2_grpc.BackfillStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._probe = DependencyProbe(
            DEPENDENCY, self._check, dependencies, interval_s=probe_interval_s, timeout_s=timeout_s + 1
        )
        self._recheck: asyncio.Task | None = None

    @classmethod
    def from_config(cls, config: BallastConfig, telemetry: Telemetry) -> "BackfillProxy":
        router = config.router
        proxy = cls(
            backfill_address(config),
            Authenticator(config.auth),
            telemetry.dependencies,
            router.backfill_timeout_s,
            router.backfill_subscribe_max_s,
            tls=config.tls,
        )
        telemetry.meter.create_observable_gauge(
            "ballast_router_backfill_subscriptions",
            callbacks=[proxy._observe],
            description="Subscribe streams the router relays from the backfill service.",
        )
        return proxy

    def _observe(self, _options: CallbackOptions) -> Iterable[Observation]:
        yield Observation(self.subscriptions)

    async def start(self) -> None:
        await self._probe.start()

    async def close(self) -> None:
        if self._recheck is not None:
            self._recheck.cancel()
        await self._probe.stop()
        await self._channel.close()

    async def _check(self) -> None:
        # Any answer means it is reachable: a backfill that misses Kafka still serves answers.
        await self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=self.timeout_s)

    # -- the two relays -------------------------------------------------------------------

    async def get(
        self, request: backfill_pb2.GetAnswerRequest, context: grpc.aio.ServicerContext
    ) -> backfill_pb2.BackfilledAnswer:
        metadata = self._forwarded(context)
        check_ticket(request.ticket)
        await self._reach(context)
        try:
            return await self._stub.GetAnswer(
                request, metadata=metadata, timeout=self._timeout(context, self.timeout_s)
            )
        except grpc.aio.AioRpcError as error:
            raise self._error(error) from None

    async def subscribe(
        self, request: backfill_pb2.SubscribeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[backfill_pb2.BackfilledAnswer]:
        metadata = self._forwarded(context)
        subscription_target(request)
        await self._reach(context)
        call = self._stub.Subscribe(request, metadata=metadata, timeout=self._timeout(context, self.subscribe_max_s))
        self.subscriptions += 1
        try:
            async for answer in call:
                yield answer
        except grpc.aio.AioRpcError as error:
            raise self._error(error) from None
        finally:
            self.subscriptions -= 1
            # The client left (or the stream failed): stop the backfill's side too.
            call.cancel()

    # -- helpers --------------------------------------------------------------------------

    def _forwarded(self, context: grpc.aio.ServicerContext) -> tuple[tuple[str, str], ...]:
        """Authenticates here (a clear error even while the backfill is away), then forwards."""
        metadata = context.invocation_metadata() or ()
        self.auth.tenant_for(metadata)
        return tuple(
            (name.lower(), value)
            for name, value in metadata
            if name.lower() in FORWARDED_METADATA and isinstance(value, str)
        )

    async def _reach(self, context: grpc.aio.ServicerContext) -> None:
        """Waits briefly for a connection, so a backfill that just came back is found at once
        (a call on a channel still backing off would fail without trying)."""
        if self._channel.get_state(try_to_connect=True) == grpc.ChannelConnectivity.READY:
            return
        try:
            async with asyncio.timeout(self._timeout(context, CONNECT_WAIT_S)):
                await self._channel.channel_ready()
        except TimeoutError:
            self._recheck_soon()
            raise Unavailable(
                f"backfill service at {self.address} is unreachable, try again later (nothing is lost)"
            ) from None

    def _recheck_soon(self) -> None:
        """Lets the probe say now, not at its next round, whether the backfill is reachable."""
        if self._recheck is None or self._recheck.done():
            self._recheck = asyncio.create_task(self._probe.probe_once(), name="backfill-recheck")

    @staticmethod
    def _timeout(context: grpc.aio.ServicerContext, cap_s: float) -> float:
        remaining = context.time_remaining()
        return cap_s if remaining is None else max(0.0, min(cap_s, remaining))

    def _error(self, error: grpc.aio.AioRpcError) -> BallastError:
        code, details = error.code(), error.details() or error.code().name
        failure = classify(error)
        passed_on = (failure is not None and _PASSED_ON_FAULT.get(failure.fault)) or _PASSED_ON.get(code)
        if passed_on is not None:
            return passed_on(details)
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return ResourceExhausted(details, retry_after_s=retry_after_hint(error) or 1.0)
        self._recheck_soon()
        if code == grpc.StatusCode.UNAVAILABLE:
            return Unavailable(
                f"backfill service at {self.address} is unavailable, try again later (nothing is lost): {details}"
            )
        log.warning("backfill service at %s answered %s: %s", self.address, code.name, details)
        return Unavailable(f"backfill service at {self.address} failed: {code.name}: {details}")
