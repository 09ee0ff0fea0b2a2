"""Guided decoding through a worker's gRPC API (torch engine, tiny model): a resumed stream
whose ids break its own schema is a clear INVALID_ARGUMENT to the caller and leaves the
worker as it was; a guided answer ends with the document, finish STOP."""

from __future__ import annotations

import json

import grpc
import jsonschema
import pytest

from ballast.v1 import common_pb2, worker_pb2
from tests.engine_conformance import GUIDED_BUDGET, GUIDED_PROMPT, ORDER_SCHEMA


def request(worker_app, generated=(), max_tokens: int = GUIDED_BUDGET) -> worker_pb2.WorkerGenerateRequest:
    return worker_pb2.WorkerGenerateRequest(
        request_id="guided",
        prompt_ids=worker_app.engine.tokenize(GUIDED_PROMPT),
        generated_ids=list(generated),
        response_format=ORDER_SCHEMA,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )


async def test_resumed_ids_that_break_the_schema_are_invalid_argument(worker_stub, worker_app):
    served = worker_app.state.served
    broken = worker_app.engine.tokenize('{"order":12,"colour"')
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in worker_stub.Generate(request(worker_app, broken), timeout=30):
            pass
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "response_format" in caught.value.details()
    assert worker_app.state.in_flight == 0 and worker_app.state.served == served + 1
    assert worker_app.engine.stats().running == 0


async def test_a_guided_answer_ends_with_its_document(worker_stub, worker_app):
    text, finished = "", None
    async for event in worker_stub.Generate(request(worker_app), timeout=60):
        if event.HasField("tokens"):
            text += event.tokens.text
        elif event.HasField("finished"):
            finished = event.finished
    assert finished is not None and finished.reason == common_pb2.FINISH_REASON_STOP
    jsonschema.validate(json.loads(text), json.loads(ORDER_SCHEMA))
