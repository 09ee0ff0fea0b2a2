"""`ballast.v1.Worker`: admission, protobuf <-> engine conversion, and token streaming.

Protobuf stops here: the engine sees only `EngineRequest` and yields `TokenDelta`s.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from pathlib import Path
from typing import AsyncIterator

import grpc

from ballast.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.common import tracing
from services.common.accepted import ACCEPTED_METADATA
from services.common.errors import Draining, InvalidArgument, ResourceExhausted, Unavailable
from services.common.sampling_pb import FINISH_TO_PB, sampling_from_pb
from services.common.streams import MAX_FLUSH_INTERVAL_MS, Coalescer
from services.worker.engine import Engine, EngineRequest, Stepping, TokenDelta
from services.worker.metrics import WorkerMetrics
from services.worker.relay import RelayCounts, RelayStream

log = logging.getLogger(__name__)
TRACER = tracing.tracer("worker")

# A worker trusts the router for policy but still refuses nonsense sizes.
MAX_TOKENS_HARD_LIMIT = 1 << 20
# Engine scheduling priority of each tier, lower first (unset and unknown tiers run as A).
TIER_PRIORITY = {common_pb2.TIER_S: 0, common_pb2.TIER_A: 1, common_pb2.TIER_B: 2}


def merge_deltas(first: TokenDelta, second: TokenDelta) -> TokenDelta | None:
    if first.finish_reason is not None:
        return None
    prefill = first.prefill_tokens if first.prefill_tokens is not None else second.prefill_tokens
    return TokenDelta(first.token_ids + second.token_ids, first.text + second.text, second.finish_reason, prefill)


class WorkerState:
    """Admission and drain bookkeeping of one worker."""

    def __init__(self, capacity: int, max_queue: int) -> None:
        self.capacity = capacity
        self.max_queue = max_queue
        self.in_flight = 0
        # Requests admitted since start (a cheap counter for tests and status).
        self.served = 0
        self.draining = False
        # Open streams, so a drain that runs out of grace can hand them to the router.
        self.streams: set[Coalescer] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    def admit(self) -> None:
        if self.draining:
            raise Draining("worker is draining")
        if self.in_flight >= self.capacity + self.max_queue:
            raise ResourceExhausted(
                f"worker full: {self.in_flight} in flight, capacity {self.capacity}", retry_after_s=0.5
            )
        self.in_flight += 1
        self.served += 1
        self._idle.clear()

    def release(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    def hand_off_all(self) -> int:
        """Ends every open stream with UNAVAILABLE; the router resumes each one elsewhere."""
        streams = list(self.streams)
        for stream in streams:
            stream.fail(Draining("worker drained before the answer was complete; resume elsewhere"))
        return len(streams)

    async def wait_idle(self, timeout: float) -> bool:
        try:
            async with asyncio.timeout(timeout):
                await self._idle.wait()
            return True
        except asyncio.TimeoutError:
            return False


def engine_request_from_pb(request: worker_pb2.WorkerGenerateRequest) -> EngineRequest:
    if not request.prompt_ids:
        raise InvalidArgument("prompt_ids must not be empty")
    sampling = sampling_from_pb(request.sampling, default_max_tokens=0, max_tokens_limit=MAX_TOKENS_HARD_LIMIT)
    return EngineRequest(
        request_id=request.request_id,
        prompt_ids=tuple(request.prompt_ids),
        generated_ids=tuple(request.generated_ids),
        sampling=sampling,
        tenant=request.tenant,
        session_id=request.session_id,
        response_format=request.response_format,
        priority=TIER_PRIORITY.get(request.tier, TIER_PRIORITY[common_pb2.TIER_A]),
    )


class FaultInjector:
    """Chaos testing: makes Generate fail while a file says so, or while `refusing` is set
    (a simulated worker failing its health checks). Off unless configured."""

    def __init__(self, path: str) -> None:
        self._path = Path(path) if path else None
        self.refusing = False

    def check(self) -> None:
        if self.refusing:
            raise Unavailable("injected fault: failing health checks")
        if self._path is None:
            return
        try:
            mode = self._path.read_text().strip()
        except OSError:
            return
        if mode == "unavailable":
            raise Unavailable("injected fault")


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(
        self,
        engine: Engine,
        state: WorkerState,
        metrics: WorkerMetrics,
        worker_id: str,
        pool: str,
        faults: FaultInjector | None = None,
        b_tier_flush_s: float = 0.0,
        engine_progress_s: float = 0.0,
    ) -> None:
        """`b_tier_flush_s`: after each message of a B-tier stream, the worker waits this long
        (or until the stream ends) and sends what accumulated as one message. A B answer (an
        archive summary) needs no per-token delivery; fewer messages leave the router's CPU to
        the tiers that do. A request's own flush_interval_ms, when longer, wins.
        `engine_progress_s`: how often a Relay stream may report the engine's steps (see
        services.worker.relay_progress; 0: never)."""
        self.engine = engine
        self.b_tier_flush_s = b_tier_flush_s
        self.engine_progress_s = engine_progress_s
        self.state = state
        self.metrics = metrics
        self.worker_id = worker_id
        self.pool = pool
        self.faults = faults or FaultInjector("")
        self.relay_counts = RelayCounts()
        self._relays: set[RelayStream] = set()
        metrics.observe_relay(self.relay_counts)
        if isinstance(engine, Stepping):
            metrics.observe_engine_steps(engine)

    async def GetModelInfo(self, request, context) -> worker_pb2.ModelInfo:
        model = self.engine.model
        return worker_pb2.ModelInfo(
            model=model.name,
            model_version=model.version,
            max_context=model.max_context,
            tokenizer_json=model.tokenizer_json,
            chat_template=model.chat_template,
            bos_token=model.bos_token,
            eos_token=model.eos_token,
            eos_token_ids=list(model.eos_token_ids),
            worker_id=self.worker_id,
            pool=self.pool,
        )

    def flush_interval_s(self, request: worker_pb2.WorkerGenerateRequest) -> float:
        """How long the stream's tokens after the first may be held back to leave together."""
        return max(
            self.b_tier_flush_s if request.tier == common_pb2.TIER_B else 0.0,
            min(request.flush_interval_ms, MAX_FLUSH_INTERVAL_MS) / 1000,
        )

    async def Generate(
        self, request: worker_pb2.WorkerGenerateRequest, context: grpc.aio.ServicerContext, *, hold: bool = True
    ) -> AsyncIterator[worker_pb2.WorkerGenerateEvent]:
        """`hold=False`: yield tokens as they come, for a caller that holds them back itself
        (a Relay stream, which holds all its requests' tokens to send them together)."""
        engine_request = engine_request_from_pb(request)
        self.faults.check()
        # Sent before the engine sees the request: a router that gets it and then loses this
        # worker knows the worker died taking the request on (poison containment).
        await context.send_initial_metadata(ACCEPTED_METADATA)
        self.state.admit()
        started = time.perf_counter()
        outcome = "error"
        first_token_at: float | None = None
        index = len(engine_request.generated_ids)
        flush_s = self.flush_interval_s(request) if hold else 0.0
        stream = Coalescer(self.engine.generate(engine_request), merge_deltas)
        self.state.streams.add(stream)
        # Counted as the engine reports it (restored KV is not computed), else the whole context.
        context_tokens, prefill_counted = len(engine_request.prompt_ids) + index, False
        # Siblings under the call's span, never current: the engine's own spans (KV restore and
        # save) stay children of the call, whichever phase they fall in.
        prefill = TRACER.start_span(
            "worker.prefill", attributes={"ballast.context_tokens": context_tokens, "ballast.resume_from": index}
        )
        decode = None
        tallied = False
        try:
            async for delta in stream:
                if delta.prefill_tokens is not None and not prefill_counted:
                    self.metrics.prefill_tokens.add(delta.prefill_tokens)
                    prefill_counted = True
                    if prefill.is_recording():
                        prefill.set_attribute("ballast.prefill_tokens", delta.prefill_tokens)
                if delta.token_ids:
                    if first_token_at is None:
                        first_token_at = time.perf_counter()
                        self.metrics.ttft.record((first_token_at - started) * 1000)
                        tracing.end_span(prefill)
                        decode = TRACER.start_span("worker.decode")
                    yield worker_pb2.WorkerGenerateEvent(
                        tokens=common_pb2.Tokens(text=delta.text, token_ids=delta.token_ids, first_index=index)
                    )
                    index += len(delta.token_ids)
                    if flush_s and delta.finish_reason is None:
                        await stream.settle(flush_s)  # the next deltas merge meanwhile
                if delta.finish_reason is not None:
                    outcome = delta.finish_reason.value
                    # Counted before the caller sees the end: a client holding Finished finds
                    # the request in the worker's metrics, whatever it does with the stream then.
                    tallied = True
                    self._tally(
                        outcome,
                        started,
                        index - len(engine_request.generated_ids),
                        None if prefill_counted else context_tokens,
                    )
                    yield worker_pb2.WorkerGenerateEvent(
                        finished=worker_pb2.WorkerFinished(
                            reason=FINISH_TO_PB[delta.finish_reason],
                            usage=common_pb2.Usage(
                                prompt_tokens=len(engine_request.prompt_ids), completion_tokens=index
                            ),
                        )
                    )
                    break
        except (asyncio.CancelledError, GeneratorExit):
            # A caller that goes away while this generator waits at a `yield` closes it
            # (GeneratorExit) rather than cancelling it: cancelled all the same (unless it
            # already had the whole answer).
            if not tallied:
                outcome = "cancelled"
            raise
        except InvalidArgument:
            outcome = "invalid"
            raise
        except Unavailable:
            outcome = "handed_off"
            raise
        finally:
            failure = sys.exc_info()[1]
            tracing.end_span(prefill, failure, outcome=outcome)
            if decode is not None:
                tracing.end_span(decode, failure, outcome=outcome, tokens=index - len(engine_request.generated_ids))
            self.state.streams.discard(stream)
            await stream.aclose()
            self.state.release()
            if not tallied:
                self._tally(
                    outcome,
                    started,
                    index - len(engine_request.generated_ids),
                    None if prefill_counted else context_tokens,
                )

    async def Relay(
        self, request_iterator: AsyncIterator[worker_pb2.RelayActions], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.RelayEvents]:
        """Many requests over one stream (services.worker.relay), each run by `Generate`."""
        relay = RelayStream(self)
        self._relays.add(relay)
        try:
            async for message in relay.serve(request_iterator):
                yield message
        finally:
            self._relays.discard(relay)

    def close_relays(self) -> None:
        """Ends every Relay stream (called once the worker has drained, before its server stops)."""
        for relay in list(self._relays):
            relay.close()

    def _tally(self, outcome: str, started: float, generated: int, uncounted_prefill: int | None) -> None:
        """Counts one request in the worker's metrics; `uncounted_prefill`: context tokens to
        count as prefill when the engine reported none."""
        if uncounted_prefill is not None:
            self.metrics.prefill_tokens.add(uncounted_prefill)
        self.metrics.tokens.add(generated)
        self.metrics.requests.add(1, {"outcome": outcome})
        self.metrics.e2e.record((time.perf_counter() - started) * 1000, {"outcome": outcome})
