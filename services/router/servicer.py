"""`ballast.v1.Inference`: authenticate, validate, pick a worker, relay its token stream.

The client's deadline bounds everything downstream: each worker call gets the time that is
left. When the client goes away, the worker call is cancelled, which aborts generation on
the worker and frees its slot.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator

import grpc

from ballast.v1 import common_pb2, inference_pb2, inference_pb2_grpc, worker_pb2
from services.common.config import BallastConfig
from services.common.errors import (
    BallastError,
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from services.common.membership import MembershipWatcher
from services.common.sampling_pb import sampling_to_pb
from services.router.auth import Authenticator
from services.router.balancer import pick_worker
from services.router.metrics import RouterMetrics
from services.router.model_registry import ModelRegistry
from services.router.requests import InferenceRequest, request_from_pb
from services.router.worker_clients import WorkerClients

log = logging.getLogger(__name__)

TIER_TO_PB = {"S": common_pb2.TIER_S, "A": common_pb2.TIER_A, "B": common_pb2.TIER_B}
# Errors that mean "this worker cannot take it now"; another worker may.
RETRY_ON_ANOTHER_WORKER = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}


def _outcome(error: BaseException) -> str:
    if isinstance(error, asyncio.CancelledError):
        return "cancelled"
    if isinstance(error, BallastError):
        return error.code.name.lower()
    return "internal"


def error_from_worker(exc: grpc.aio.AioRpcError, worker_id: str) -> BallastError:
    code = exc.code()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidArgument(exc.details() or "invalid request")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded("deadline exceeded while generating")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ResourceExhausted(f"worker {worker_id} is full", retry_after_s=0.5)
    return Unavailable(f"worker {worker_id} failed: {code.name}: {exc.details()}")


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(
        self,
        config: BallastConfig,
        membership: MembershipWatcher,
        clients: WorkerClients,
        metrics: RouterMetrics,
    ) -> None:
        self.config = config
        self.router_config = config.router
        self.membership = membership
        self.clients = clients
        self.metrics = metrics
        self.auth = Authenticator(config.auth)
        self.models = ModelRegistry(clients, config.router.worker_connect_timeout_s)
        # Streams this router has open per worker: exact, unlike the published counts.
        self.local_in_flight: dict[str, int] = {}

    def _check_model_known(self, model: str) -> None:
        if model in self.router_config.models:
            return
        if any(w.model == model for w in self.membership.workers().values()):
            return
        raise NotFound(f"unknown model {model!r}; this router serves {sorted(self.router_config.models)}")

    def _deadline(self, context: grpc.aio.ServicerContext) -> float:
        remaining = context.time_remaining()
        budget = self.router_config.default_deadline_s
        if remaining is not None:
            budget = min(budget, remaining)
        return time.monotonic() + budget

    @staticmethod
    def _tier(request: InferenceRequest) -> tuple[str, str]:
        # Auto-tagging rules come with the tier issue; until then AUTO runs as A.
        if request.tier == "AUTO":
            return "A", "default"
        return request.tier, "explicit"

    async def Generate(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateEvent]:
        started = time.perf_counter()
        tier = "unknown"
        outcome = "ok"
        self.metrics.in_flight.add(1)
        try:
            tenant = self.auth.tenant_for(context.invocation_metadata())
            inference = request_from_pb(request, tenant, self.router_config)
            self._check_model_known(inference.model)
            tier, reason = self._tier(inference)
            async for event in self._generate(inference, tier, reason, self._deadline(context), started):
                yield event
        except BaseException as error:
            outcome = _outcome(error)
            raise
        finally:
            self.metrics.in_flight.add(-1)
            self.metrics.requests.add(1, {"tier": tier, "outcome": outcome})
            if outcome == "ok":
                self.metrics.e2e.record((time.perf_counter() - started) * 1000, {"tier": tier})

    async def _generate(
        self, request: InferenceRequest, tier: str, reason: str, deadline: float, started: float
    ) -> AsyncIterator[inference_pb2.GenerateEvent]:
        excluded: set[str] = set()
        announced = False
        for attempt in range(self.router_config.max_attempts):
            worker = pick_worker(
                self.membership.workers().values(), request.model, self.local_in_flight, frozenset(excluded)
            )
            if worker is None:
                raise Unavailable(f"no live worker for model {request.model!r}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DeadlineExceeded("deadline exceeded before a worker was found")
            tokenizer = await self.models.tokenizer_for(worker, remaining)
            prompt_ids = tokenizer.encode(request)
            tokenizer.check_fits(len(prompt_ids), request.sampling.max_tokens)
            if not announced:
                announced = True
                yield inference_pb2.GenerateEvent(
                    started=inference_pb2.Started(
                        request_id=request.request_id,
                        tier=TIER_TO_PB[tier],
                        tier_reason=reason,
                        model=request.model,
                        model_version=worker.model_version,
                    )
                )
            worker_request = worker_pb2.WorkerGenerateRequest(
                request_id=request.request_id,
                tenant=request.tenant,
                session_id=request.session_id,
                prompt_ids=prompt_ids,
                sampling=sampling_to_pb(request.sampling),
                response_format=request.response_format,
            )
            relayed = 0
            self.local_in_flight[worker.id] = self.local_in_flight.get(worker.id, 0) + 1
            try:
                with self.clients.in_use(worker.address) as stub:
                    call = stub.Generate(worker_request, timeout=deadline - time.monotonic())
                    try:
                        async for event in call:
                            if event.HasField("tokens"):
                                if relayed == 0:
                                    self.metrics.ttft.record((time.perf_counter() - started) * 1000, {"tier": tier})
                                # Counted once per stream (below), not per message: this loop is the hot path.
                                relayed += len(event.tokens.token_ids)
                                yield inference_pb2.GenerateEvent(tokens=event.tokens)
                            elif event.HasField("finished"):
                                yield inference_pb2.GenerateEvent(
                                    finished=inference_pb2.Finished(
                                        reason=event.finished.reason, usage=event.finished.usage
                                    )
                                )
                                return
                        raise Unavailable(f"worker {worker.id} ended the stream without finishing")
                    finally:
                        # Client gone, deadline hit or error: stop the generation on the worker.
                        call.cancel()
            except grpc.aio.AioRpcError as exc:
                if time.monotonic() >= deadline:
                    raise DeadlineExceeded("deadline exceeded while generating") from None
                if relayed == 0 and exc.code() in RETRY_ON_ANOTHER_WORKER and attempt + 1 < self.router_config.max_attempts:
                    excluded.add(worker.id)
                    self.metrics.worker_attempts.add(1, {"reason": exc.code().name.lower()})
                    log.info("worker %s refused %s (%s); trying another", worker.id, request.request_id, exc.code().name)
                    continue
                raise error_from_worker(exc, worker.id) from None
            finally:
                if relayed:
                    self.metrics.tokens.add(relayed, {"tier": tier})
                count = self.local_in_flight.get(worker.id, 1) - 1
                if count <= 0:
                    self.local_in_flight.pop(worker.id, None)
                else:
                    self.local_in_flight[worker.id] = count
        raise Unavailable(f"no worker of model {request.model!r} accepted the request")
