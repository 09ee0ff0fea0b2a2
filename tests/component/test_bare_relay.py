"""bench/bare_relay.py, the floor mesh_scale measures the router against: started as a process
by its launcher, it relays a worker's whole stream (a relay that dropped or cut short the
stream would make the floor look cheaper than it is), a worker's error reaches the client
with its status, and SIGTERM stops it."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from ballast.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from bench.bare_relay import start_bare_relay
from services.common.grpc_server import CHANNEL_OPTIONS

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(120)]


async def events(stub, request) -> list[worker_pb2.WorkerGenerateEvent]:
    return [event async for event in stub.Generate(request, timeout=30)]


def tokens_and_text(stream) -> tuple[list[int], str]:
    chunks = [e.tokens for e in stream if e.HasField("tokens")]
    return [i for c in chunks for i in c.token_ids], "".join(c.text for c in chunks)


async def test_the_relay_streams_what_the_worker_streams_and_stops_on_sigterm(worker_app, tmp_path):
    relay, address = await asyncio.to_thread(start_bare_relay, [worker_app.address], tmp_path / "relay.log")
    try:
        request = worker_pb2.WorkerGenerateRequest(
            request_id="relay-1",
            tenant="t",
            prompt_ids=[5, 6, 7, 8],
            sampling=common_pb2.SamplingParams(max_tokens=12, temperature=0.0),
        )
        async with (
            grpc.aio.insecure_channel(worker_app.address, options=CHANNEL_OPTIONS) as direct_channel,
            grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as relay_channel,
        ):
            direct = await events(worker_pb2_grpc.WorkerStub(direct_channel), request)
            relayed = await events(worker_pb2_grpc.WorkerStub(relay_channel), request)
            # Greedy: the same tokens, text and end both ways. (How the tokens are cut into
            # messages is the worker's timing, not the relay's.)
            for stream in (direct, relayed):
                assert stream[-1].HasField("finished")
            assert tokens_and_text(relayed) == tokens_and_text(direct)
            assert len(tokens_and_text(relayed)[0]) == 12
            assert relayed[-1].finished == direct[-1].finished

            # The worker refuses an empty prompt: the client of the relay gets that status.
            bad = worker_pb2.WorkerGenerateRequest(prompt_ids=[], sampling=common_pb2.SamplingParams(max_tokens=4))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await events(worker_pb2_grpc.WorkerStub(relay_channel), bad)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        status = await asyncio.to_thread(relay.stop, 15.0)
    assert status == 0, relay.log_tail()
