"""One call to a worker's `Generate`, the only way the router asks a worker for tokens.

Served requests (the generation runner) and mirrored copies (rollout/mirror.py) both open a
`WorkerCall`: it holds the worker's channel in use for as long as the call lives, passes the
deadline and the trace context, and reads the worker's events back as plain values
(`Tokens`, `WorkerFinished`), optionally under a stall timeout. What each caller does with
the events (relay, fail over, compare) stays its own.
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
from services.router.events import Tokens, WorkerFinished
from services.router.events_pb import worker_event_from_pb
from services.router.resilience.stall import with_stall_timeout
from services.router.worker_clients import WorkerClients


class WorkerCall:
    """`with WorkerCall(clients, address, request, deadline) as call: async for event in call.events(): ...`"""

    def __init__(
        self,
        clients: WorkerClients,
        address: str,
        request: worker_pb2.WorkerGenerateRequest,
        deadline: float,
        span: Span | None = None,
    ) -> None:
        """`deadline`: time.monotonic() by which the call must end. `span`: current while the
        call is made, so the worker's span becomes its child."""
        self._clients = clients
        self._address = address
        self._request = request
        self._deadline = deadline
        self._span = span
        self._use: AbstractContextManager[worker_pb2_grpc.WorkerStub] | None = None
        self.call: grpc.aio.UnaryStreamCall | None = None

    def __enter__(self) -> "WorkerCall":
        self._use = self._clients.in_use(self._address)
        stub = self._use.__enter__()
        timeout = max(0.001, self._deadline - time.monotonic())
        if self._span is None:
            self.call = stub.Generate(self._request, timeout=timeout, metadata=trace_metadata())
        else:
            with trace.use_span(self._span):
                self.call = stub.Generate(self._request, timeout=timeout, metadata=trace_metadata())
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self._use is not None:
            self._use.__exit__(kind, error, traceback)
            self._use = None

    async def events(
        self, stall_s: float | None = None, first_timeout_s: float | None = None
    ) -> AsyncIterator[Tokens | WorkerFinished]:
        """The worker's events; with `stall_s`, StreamStalled when one takes longer (the first
        `first_timeout_s`), and the call is cancelled however the iteration ends."""
        assert self.call is not None, "iterate inside `with WorkerCall(...)`"
        source = (
            self.call if stall_s is None else with_stall_timeout(self.call, stall_s, first_timeout_s=first_timeout_s)
        )
        async for message in source:
            event = worker_event_from_pb(message)
            if event is not None:
                yield event
