"""The router's `Degrader`: walks the degradation ladder for one request.

`Degrader.run()` wraps the router's normal generation of one request. When the primary pool
cannot serve it (admission refused, no routable worker, retry budget spent, workers failed,
deadline unreachable) before any token went out, it walks the ladder: the light-model pool
(the same runner, another logical model), then the rule engine. A degraded stream ends with
its Finished event's `degradation` set and a `backfill_ticket` that is valid only once the request is
committed to the durable outbox, from where it reaches Kafka and the backfill service.

The decision itself (`Degrader.decide`) is pure: error + request + position → next rung.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import socket
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterable

from opentelemetry.metrics import CallbackOptions, Observation

from services.common.degraded.codec import Level, degraded_request_pb, kafka_key, make_ticket
from services.common.errors import BallastError
from services.common.generation import FinishReason
from services.common.tier import Tier
from services.router.degrade.config import DegradeConfig
from services.router.degrade.handoff import HandOff, HandOffSettings
from services.router.degrade.ladder import RULES, Decision, Ladder, Rung, decide
from services.router.degrade.outbox import OutboxDepth, OutboxError
from services.router.degrade.rules import RuleEngine, stream_text
from services.router.events import Event, Finished, Started, Tokens
from services.router.structured.repair import placeholder_answer

log = logging.getLogger(__name__)

# Produces a request's events on its pool: the router's GenerationRunner.run, bound to tier etc.
# (see servicer.py). The ladder relays and marks plain events; the edge makes them protobuf.
PoolStream = Callable[[Any], AsyncIterator[Event]]
# A logical model's tokenizer (tokenizers.Tokenizer: .encode(text) → .ids, .offsets), or None.
EncoderLookup = Callable[[str], Any]
FallbackHook = Callable[[dict[str, str]], None]


@dataclasses.dataclass
class _Relay:
    """What one attempt on a pool has sent the client so far."""

    started: Started | None = None
    started_sent: bool = False
    tokens_sent: bool = False
    text: list[str] = dataclasses.field(default_factory=list)


class Degrader:
    """The router's degradation ladder, rule engine and durable hand-off."""

    def __init__(
        self,
        config: DegradeConfig,
        kafka_bootstrap: str,
        *,
        kafka_security: dict | None = None,
        rules: RuleEngine | None = None,
        handoff: HandOff | None = None,
        encoder_for: EncoderLookup | None = None,
        on_fallback: FallbackHook | None = None,
    ) -> None:
        self.config = config
        self.ladder = Ladder(config.ladders, config.default_path)
        self.rules = rules or (
            RuleEngine.from_file(config.rules_file) if config.rules_file else RuleEngine.default_rules()
        )
        self.origin = config.origin or f"{socket.gethostname()}-{os.getpid()}"
        if handoff is None and config.handoff:
            handoff = HandOff(
                HandOffSettings(
                    outbox_path=Path(config.outbox_path),
                    bootstrap=kafka_bootstrap,
                    topic=config.topic,
                    topic_partitions=config.topic_partitions,
                    topic_replication=config.topic_replication,
                    max_rows=config.outbox_max_rows,
                    max_bytes=config.outbox_max_bytes,
                    synchronous=config.outbox_synchronous,
                    drain_batch=config.drain_batch,
                    delivery_timeout_s=config.delivery_timeout_s,
                    kafka_security=dict(kafka_security or {}),
                )
            )
        self.handoff = handoff
        self.encoder_for = encoder_for
        self.on_fallback = on_fallback
        self._reasons = frozenset(config.reasons)
        self._last_refusal_log = 0.0
        self.handoffs_refused = 0

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Opens the outbox (draining what a previous run left) and starts the producer."""
        if self.handoff is not None:
            await self.handoff.start()

    async def stop(self) -> None:
        """Gives the outbox `stop_drain_s` to drain, then closes it. Call after server.stop()."""
        if self.handoff is not None:
            await self.handoff.stop(self.config.stop_drain_s)

    # -- the decision (pure) --------------------------------------------------------------

    def path(self, model: str) -> tuple[Rung, ...]:
        return self.ladder.path(model) if self.config.enabled else ()

    def decide(
        self, error: BaseException, request: Any, after: int = -1, remaining_s: float = math.inf
    ) -> Decision | None:
        """The rung to try after `error` on rung `after` (-1: the primary pool), or None."""
        return decide(
            error,
            request.allow_degraded,
            self.path(request.model),
            after,
            remaining_s,
            self.config.light_min_remaining_s,
            self._reasons,
        )

    def may_degrade(self, request: Any) -> bool:
        return bool(request.allow_degraded and self.path(request.model))

    # -- metrics --------------------------------------------------------------------------

    @staticmethod
    def fallback_labels(decision: Decision) -> dict[str, str]:
        """Labels of `fallback_trigger_count`: why it left its rung, and where it went."""
        return {"reason": decision.reason.value, "level": decision.rung.level.value}

    def outbox_depth(self) -> OutboxDepth:
        return self.handoff.depth() if self.handoff is not None else OutboxDepth(0, 0)

    def register_metrics(self, meter) -> None:
        """Outbox depth (rows, bytes), its limit, and refused hand-offs, on the router's meter."""

        def depth(_options: CallbackOptions) -> Iterable[Observation]:
            current = self.outbox_depth()
            yield Observation(current.rows, {"unit": "rows"})
            yield Observation(current.bytes, {"unit": "bytes"})

        def limit(_options: CallbackOptions) -> Iterable[Observation]:
            yield Observation(self.config.outbox_max_rows, {"unit": "rows"})
            yield Observation(self.config.outbox_max_bytes, {"unit": "bytes"})

        def refused(_options: CallbackOptions) -> Iterable[Observation]:
            yield Observation(self.handoffs_refused)

        def broker(_options: CallbackOptions) -> Iterable[Observation]:
            if self.handoff is not None:
                yield Observation(1 if self.handoff.stats.broker_up else 0)

        meter.create_observable_gauge(
            "ballast_degrade_outbox_depth",
            callbacks=[depth],
            description="Degraded requests waiting in the outbox for Kafka, in rows and bytes.",
        )
        meter.create_observable_gauge(
            "ballast_degrade_outbox_limit",
            callbacks=[limit],
            description="Outbox bounds; at the limit hand-offs are refused.",
        )
        meter.create_observable_counter(
            "ballast_degrade_handoffs_refused",
            callbacks=[refused],
            description="Degraded answers sent without a ticket: the outbox refused them.",
        )
        meter.create_observable_gauge(
            "ballast_degrade_kafka_up",
            callbacks=[broker],
            description="1 while the outbox drainer reaches Kafka, else 0.",
        )

    # -- the ladder -----------------------------------------------------------------------

    async def run(
        self,
        pool_stream: PoolStream,
        request: Any,
        *,
        tier: Tier,
        tier_reason: str,
        deadline: float,
        started: float,
    ) -> AsyncIterator[Event]:
        """Streams the request on its primary pool, degrading down the ladder when it must.

        `pool_stream(request)` runs a request on the pool of `request.model` (the router's
        runner). `deadline` is time.monotonic() based, `started` time.perf_counter() based.
        Degradation happens only before the first token reaches the client; afterwards
        errors propagate as before. When degradation is possible, the Started event is held
        back until the first token, so the client never sees a Started from a pool that then
        failed.
        """
        if not self.may_degrade(request):
            async for event in pool_stream(request):
                yield event
            return
        received_at = time.time() - (time.perf_counter() - started)
        path = self.path(request.model)
        position = -1
        first: Decision | None = None
        current = request
        while True:
            relay = _Relay()
            rung = path[position] if position >= 0 else None
            try:
                async with contextlib.aclosing(pool_stream(current)) as events:
                    async for event in events:
                        for out in self._relay(event, relay):
                            if isinstance(out, Finished) and rung is not None:
                                out = await self._mark(
                                    out, request, tier, first, rung, "".join(relay.text), received_at
                                )
                            yield out
                return
            except BallastError as error:
                if relay.tokens_sent:
                    raise
                decision = self.decide(error, request, position, deadline - time.monotonic())
                if decision is None:
                    raise
                log.info(
                    "request %s: %s on %s (%s); degrading to %s",
                    request.request_id,
                    decision.reason.value,
                    rung.label if rung else "primary pool",
                    error,
                    decision.rung.label,
                )
                if self.on_fallback is not None:
                    self.on_fallback(self.fallback_labels(decision))
                first = first or decision
                position = decision.index
                if decision.rung.level is Level.RULES:
                    async for event in self._rules(request, tier, tier_reason, first, received_at):
                        yield event
                    return
                current = dataclasses.replace(request, model=decision.rung.model)

    @staticmethod
    def _relay(event: Event, relay: _Relay) -> Iterable[Event]:
        if isinstance(event, Tokens):  # by far the most frequent: first
            relay.tokens_sent = True
            relay.text.append(event.text)
            if relay.started is None or relay.started_sent:
                return (event,)
        elif isinstance(event, Started):
            relay.started = event
            return ()
        elif not isinstance(event, Finished):
            return (event,)
        if relay.started is None or relay.started_sent:
            return (event,)
        relay.started_sent = True
        return (relay.started, event)

    async def _mark(
        self, event: Finished, request: Any, tier: Tier, first: Decision, rung: Rung, text: str, received_at: float
    ) -> Finished:
        ticket = await self._hand_off(request, tier, first, rung, text, received_at)
        return dataclasses.replace(event, degradation=rung.level, backfill_ticket=ticket)

    async def _rules(
        self, request: Any, tier: Tier, tier_reason: str, first: Decision, received_at: float
    ) -> AsyncIterator[Event]:
        text = self.rules.answer_request(request).text
        # A JSON request gets a document of its schema, not the rule's sentence: the client's
        # parser must not break because the big model is down.
        structured = placeholder_answer(request.schema) if request.schema is not None else None
        if structured is not None:
            text = structured.text
        yield Started(
            request_id=request.request_id,
            tier=tier,
            tier_reason=tier_reason,
            model=RULES,
            model_version=self.rules.version,
        )
        encoder = self.encoder_for(request.model) if self.encoder_for is not None else None
        sent = 0
        for piece_text, ids in _pieces(text, self.config.rules_piece_chars, encoder):
            yield Tokens(text=piece_text, token_ids=ids, first_index=sent)
            sent += len(ids)
        ticket = await self._hand_off(request, tier, first, Rung(Level.RULES), text, received_at)
        yield Finished(
            reason=FinishReason.STOP,
            prompt_tokens=0,
            completion_tokens=sent,
            resumes=0,
            structured=structured,
            degradation=Level.RULES,
            backfill_ticket=ticket,
        )

    async def _hand_off(
        self, request: Any, tier: Tier, first: Decision, rung: Rung, text: str, received_at: float
    ) -> str:
        """Commits the degraded request to the outbox; returns its ticket, or "" if refused."""
        if self.handoff is None:
            return ""
        ticket = make_ticket(request.tenant, request.request_id)
        record = degraded_request_pb(
            request,
            ticket=ticket,
            tier=tier,
            level=rung.level,
            reason=first.reason.value,
            degraded_text=text,
            degraded_by=rung.label,
            received_at=received_at,
            origin=self.origin,
        )
        try:
            await self.handoff.submit(kafka_key(request.session_id, ticket), record.SerializeToString())
        except OutboxError as exc:
            self.handoffs_refused += 1
            now = time.monotonic()
            # Loud, but one line per second at most: under a flood every request would log.
            if now - self._last_refusal_log >= 1.0:
                self._last_refusal_log = now
                log.error(
                    "degraded request %s NOT handed off for backfill (%d refused so far): %s",
                    request.request_id,
                    self.handoffs_refused,
                    exc,
                )
            return ""
        return ticket


def _pieces(text: str, min_chars: int, encoder: Any) -> list[tuple[str, list[int]]]:
    """Splits an answer into (text, token ids) pieces; without a tokenizer the ids are empty."""
    if encoder is None:
        from services.router.degrade.rules import split_pieces

        return [(piece, []) for piece in split_pieces(text, min_chars)]
    encoding = encoder.encode(text)
    ids, offsets = list(encoding.ids), list(encoding.offsets)
    pieces: list[tuple[str, list[int]]] = []
    start_char = 0
    group: list[int] = []
    for token_id, (_start, end) in zip(ids, offsets):
        group.append(token_id)
        if end - start_char >= min_chars:
            pieces.append((text[start_char:end], group))
            start_char, group = end, []
    if group or start_char < len(text):
        pieces.append((text[start_char:], group))
    return pieces


async def rules_text_stream(degrader: Degrader, request: Any) -> AsyncIterator[str]:
    """The rule engine's answer as an async generator of text pieces (for other callers)."""
    answer = degrader.rules.answer_request(request)
    async for piece in stream_text(answer.text, degrader.config.rules_piece_chars):
        yield piece
