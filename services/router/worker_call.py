"""One call to a worker for one request, the only way the router asks a worker for tokens.

Served requests (the generation runner) and mirrored copies (rollout/mirror.py) both open a
`WorkerCall`: it holds the worker's channel in use for as long as the call lives, passes the
deadline and the trace context, and reads the worker's events back as plain values
(`Tokens`, `WorkerFinished`), optionally under a stall timeout. What each caller does with
the events (relay, fail over, compare) stays its own.

A worker whose record says it serves Relay gets the request on the router's one Relay stream
to it (services.router.relay_link: no call set up per request, several requests' tokens per
message); any other worker gets a `Generate` call. Both kinds of call end, fail, cancel and say
"accepted" the same way, so callers never tell them apart.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from types import TracebackType
from typing import AsyncIterator

import grpc
from opentelemetry import trace
from opentelemetry.trace import Span

from ballast.v1 import worker_pb2, worker_pb2_grpc
from services.common.grpc_tracing import trace_metadata
from services.common.tracing import PROPAGATOR
from services.router.events import Tokens, WorkerFinished
from services.router.events_pb import worker_event_from_pb
from services.router.relay_link import RelayCall
from services.router.resilience.stall import with_stall_timeout
from services.router.worker_clients import WorkerChannels


class WorkerCall:
    """`with WorkerCall(clients, address, request, deadline) as call: async for event in call.events(): ...`"""

    def __init__(
        self,
        clients: WorkerChannels,
        address: str,
        request: worker_pb2.WorkerGenerateRequest,
        deadline: float,
        span: Span | None = None,
        relay: bool = False,
        confirm_accepted: bool = False,
    ) -> None:
        """`deadline`: time.monotonic() by which the call must end. `span`: current while the
        call is made, so the worker's span becomes its child. `relay`: the worker serves Relay.
        `confirm_accepted`: on Relay, the worker's engine sees the request only once this router
        read its accepted event (relay_link.py); a Generate call has no way to confirm."""
        self._clients = clients
        self._address = address
        self._request = request
        self._deadline = deadline
        self._span = span
        self._relay = relay
        self._confirm_accepted = confirm_accepted
        self._use: AbstractContextManager[worker_pb2_grpc.WorkerStub] | None = None
        self.call: grpc.aio.UnaryStreamCall | RelayCall | None = None

    def __enter__(self) -> "WorkerCall":
        self._use = self._clients.in_use(self._address)
        stub = self._use.__enter__()
        if self._relay:
            self.call = self._clients.link(self._address).start(
                self._request, self._deadline, self._trace(), self._confirm_accepted
            )
            return self
        timeout = max(0.001, self._deadline - time.monotonic())
        if self._span is None:
            self.call = stub.Generate(self._request, timeout=timeout, metadata=trace_metadata())
        else:
            with trace.use_span(self._span):
                self.call = stub.Generate(self._request, timeout=timeout, metadata=trace_metadata())
        return self

    def _trace(self) -> dict[str, str]:
        carrier: dict[str, str] = {}
        context = None if self._span is None else trace.set_span_in_context(self._span)
        PROPAGATOR.inject(carrier, context=context)
        return carrier

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if isinstance(self.call, RelayCall):
            self.call.cancel()  # a no-op once the request has ended
        if self._use is not None:
            self._use.__exit__(kind, error, traceback)
            self._use = None

    async def events(
        self, stall_s: float | None = None, first_timeout_s: float | None = None
    ) -> AsyncIterator[Tokens | WorkerFinished]:
        """The worker's events; with `stall_s`, StreamStalled when one takes longer (the first
        `first_timeout_s`). Leaving the `with` block stops a Relay request on the worker,
        however the iteration ended."""
        call = self.call
        assert call is not None, "iterate inside `with WorkerCall(...)`"
        source = call if stall_s is None else with_stall_timeout(call, stall_s, first_timeout_s=first_timeout_s)
        if isinstance(call, RelayCall):
            # The link already hands out plain events.
            async for relayed_event in source:
                yield relayed_event
            return
        async for message in source:
            event = worker_event_from_pb(message)
            if event is not None:
                yield event
