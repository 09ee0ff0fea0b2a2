"""Replays a degraded request on the full model, through the router's public API.

Going through the router (not straight to a worker) keeps tiers and admission in charge: the
replay runs at tier B with allow_degraded=false, so live traffic goes first, S preempts it,
and a busy pool answers RESOURCE_EXHAUSTED, which the caller treats as "wait", never as a
failure of the request.
"""

from __future__ import annotations

import enum
from typing import Protocol

import grpc

from ballast.v1 import backfill_pb2, inference_pb2_grpc
from services.common.auth import ON_BEHALF_HEADER
from services.common.degraded.codec import ReplayResult, replay_request
from services.common.errors import Fault
from services.common.faults import classify, retry_after_hint
from services.common.grpc_tracing import client_interceptors
from services.common.tls.credentials import open_channel
from services.common.tls.settings import TLSConfig


class ReplayErrorKind(str, enum.Enum):
    BUSY = "busy"  # the pool is full: wait, do not count an attempt
    UNHEALTHY = "unhealthy"  # the pool (or the router) is down: wait, do not count
    CONFIG = "config"  # our key is refused: an operator must act; wait, do not count
    FAILED = "failed"  # this request failed: counts towards dead-lettering
    QUARANTINED = "quarantined"  # this request killed workers: parked at once, never replayed again


class ReplayError(Exception):
    def __init__(self, kind: ReplayErrorKind, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.retry_after_s = retry_after_s


class Replayer(Protocol):
    async def replay(self, record: backfill_pb2.DegradedRequest) -> ReplayResult: ...

    async def close(self) -> None: ...


# Router answers that mean the full model cannot run now, not that this request failed.
_UNHEALTHY = frozenset({Fault.NO_LIVE_WORKER, Fault.UNREACHABLE})


def replay_error(error: grpc.aio.AioRpcError) -> ReplayError:
    """What a failed replay means for the record: wait (busy, unhealthy, config), count it, or
    park it (quarantined). A replay whose worker died under it (WORKER_LOST) counts: it is not
    the pool being down but the pool going down under this request."""
    failure = classify(error)
    message = f"{failure.code.name}: {error.details() or ''}"
    if failure.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ReplayError(ReplayErrorKind.BUSY, message, retry_after_hint(error))
    if failure.code == grpc.StatusCode.UNAVAILABLE and failure.fault in _UNHEALTHY:
        return ReplayError(ReplayErrorKind.UNHEALTHY, message)
    if failure.fault is Fault.QUARANTINED:
        return ReplayError(ReplayErrorKind.QUARANTINED, message)
    if failure.code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return ReplayError(ReplayErrorKind.CONFIG, message)
    return ReplayError(ReplayErrorKind.FAILED, message)


class RouterReplayer:
    """Replays through ballast.v1.Inference/Generate with an internal API key."""

    def __init__(
        self,
        address: str,
        api_key: str,
        timeout_s: float = 120.0,
        connect_timeout_s: float = 5.0,
        flush_interval_ms: int = 0,
        tls: TLSConfig | None = None,
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.flush_interval_ms = flush_interval_ms
        self.connect_timeout_s = connect_timeout_s
        self._metadata = (("x-api-key", api_key),) if api_key else ()
        # Carries the trace of the degraded request, so its replay joins the original trace.
        self._channel = open_channel(address, tls, interceptors=client_interceptors())
        self._stub = inference_pb2_grpc.InferenceStub(self._channel)

    async def replay(self, record: backfill_pb2.DegradedRequest) -> ReplayResult:
        try:
            # A router that is not there is "unhealthy", not a failure of this request.
            await asyncio_wait_ready(self._channel, self.connect_timeout_s)
        except TimeoutError:
            raise ReplayError(ReplayErrorKind.UNHEALTHY, f"router {self.address} unreachable") from None
        request = replay_request(record, self.flush_interval_ms)
        text: list[str] = []
        ids: list[int] = []
        model = model_version = ""
        try:
            # Runs as the tenant whose request degraded: charged to its quota, scheduled in its share.
            metadata = (*self._metadata, (ON_BEHALF_HEADER, record.tenant)) if record.tenant else self._metadata
            call = self._stub.Generate(request, metadata=metadata, timeout=self.timeout_s)
            async for event in call:
                kind = event.WhichOneof("event")
                if kind == "started":
                    model, model_version = event.started.model, event.started.model_version
                elif kind == "tokens":
                    text.append(event.tokens.text)
                    ids.extend(event.tokens.token_ids)
                elif kind == "finished":
                    finished = event.finished
                    if finished.degradation:
                        # allow_degraded=false should make this impossible; never store it as "better".
                        raise ReplayError(ReplayErrorKind.FAILED, "the router degraded a replay")
                    return ReplayResult(
                        text="".join(text),
                        token_ids=ids,
                        finish_reason=finished.reason,
                        prompt_tokens=finished.usage.prompt_tokens,
                        completion_tokens=finished.usage.completion_tokens,
                        model=model or request.model,
                        model_version=model_version,
                    )
        except grpc.aio.AioRpcError as error:
            raise replay_error(error) from None
        raise ReplayError(ReplayErrorKind.FAILED, "the router ended the stream without finishing")

    async def close(self) -> None:
        await self._channel.close()


async def asyncio_wait_ready(channel: grpc.aio.Channel, timeout_s: float) -> None:
    import asyncio

    async with asyncio.timeout(timeout_s):
        await channel.channel_ready()
