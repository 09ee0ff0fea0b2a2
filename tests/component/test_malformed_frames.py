"""Request frames that do not parse, in a unary-request call or anywhere in a client stream:
INVALID_ARGUMENT, no handler reached, no log line per frame, and the service goes on serving."""

from __future__ import annotations

import logging

import grpc
import pytest

from services.cli.client import chat_request, collect
from services.common.errors import Fault
from services.common.faults import REASON_KEY, classify
from services.common.grpc_server import CHANNEL_OPTIONS, malformed_requests
from tests.component.conftest import API_KEY
from tests.component.test_kv_worker import cache  # noqa: F401  (fixture)

pytestmark = pytest.mark.asyncio(loop_scope="session")

GARBAGE = [b"\xff\xff\xff\xff", b"\x0a\xff\xff\xff\xff\x0f", b"\x12\x05abc", bytes(range(256))]


async def test_unparseable_frames_are_invalid_argument_and_log_nothing(router_app, router_stub, caplog):
    before = malformed_requests()
    async with grpc.aio.insecure_channel(router_app.address, options=CHANNEL_OPTIONS) as channel:
        generate = channel.unary_stream(
            "/ballast.v1.Inference/Generate", request_serializer=lambda raw: raw, response_deserializer=lambda raw: raw
        )
        with caplog.at_level(logging.DEBUG):
            for frame in GARBAGE * 25:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in generate(frame, metadata=(("x-api-key", API_KEY),), timeout=10):
                        pass
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
                assert "does not parse as GenerateRequest" in err.value.details()
                # The reason travels like every other refusal's: bad input, by type.
                assert (REASON_KEY, Fault.INVALID_ARGUMENT.value) in tuple(err.value.trailing_metadata())
                assert classify(err.value).fault is Fault.INVALID_ARGUMENT
    assert malformed_requests() - before == len(GARBAGE) * 25
    assert "ballast_grpc_malformed_requests_total" in router_app.telemetry.render()
    # No traceback, no line per frame: a client sending garbage cannot fill a disk.
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info], caplog.records[:3]
    # And the router still answers a well-formed request with a model answer.
    result = await collect(router_stub, chat_request("hello", max_tokens=4, allow_degraded=False), API_KEY)
    assert result.finished is not None and not result.finished.degradation


async def test_a_string_that_is_not_utf8_is_a_malformed_frame_with_its_reason(router_app, router_stub, caplog):
    """Lone surrogates (as CESU-8 bytes) or stray bytes in a string field are not text: the frame
    is refused as bad input, never an INTERNAL from encoding it later."""
    from ballast.v1 import inference_pb2

    def field(number: int, raw: bytes) -> bytes:
        return bytes([number << 3 | 2, len(raw)]) + raw

    model, prompt = (
        inference_pb2.GenerateRequest.DESCRIPTOR.fields_by_name[name].number for name in ("model", "prompt")
    )
    frames = [
        field(model, b"\xed\xa0\x80") + field(prompt, b"hello"),  # "\ud800" as CESU-8
        field(model, b"tiny") + field(prompt, b"\xed\xbf\xbf"),  # "\udfff"
        field(model, b"tiny") + field(prompt, b"\xff\xfe"),
    ]
    assert inference_pb2.GenerateRequest.FromString(field(model, b"tiny") + field(prompt, b"hello")).model == "tiny"
    async with grpc.aio.insecure_channel(router_app.address, options=CHANNEL_OPTIONS) as channel:
        generate = channel.unary_stream(
            "/ballast.v1.Inference/Generate", request_serializer=lambda raw: raw, response_deserializer=lambda raw: raw
        )
        with caplog.at_level(logging.DEBUG):
            for frame in frames:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in generate(frame, metadata=(("x-api-key", API_KEY),), timeout=10):
                        pass
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
                assert "does not parse as GenerateRequest" in err.value.details()
                assert (REASON_KEY, Fault.INVALID_ARGUMENT.value) in tuple(err.value.trailing_metadata())
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info], caplog.records[:3]
    result = await collect(router_stub, chat_request("hello", max_tokens=4, allow_degraded=False), API_KEY)
    assert result.finished is not None and not result.finished.degradation


async def test_a_client_stream_with_a_frame_that_does_not_parse_is_invalid_argument(cache, caplog):
    from ballast.v1 import kvcache_pb2

    opening = kvcache_pb2.KVPutRequest(
        open=kvcache_pb2.KVPutOpen(scope=kvcache_pb2.KVScope(model_version="v1", tenant="malformed"), ttl_s=60)
    ).SerializeToString()
    before = malformed_requests()
    async with grpc.aio.insecure_channel(cache.address, options=CHANNEL_OPTIONS) as channel:
        put = channel.stream_unary(
            "/ballast.v1.KVCache/Put", request_serializer=lambda raw: raw, response_deserializer=lambda raw: raw
        )
        with caplog.at_level(logging.DEBUG):
            for frames in ([opening, GARBAGE[0]], [GARBAGE[1]], [opening, GARBAGE[2], opening]):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await put(iter(frames), timeout=10)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
                assert "does not parse as KVPutRequest" in err.value.details()
                assert (REASON_KEY, Fault.INVALID_ARGUMENT.value) in tuple(err.value.trailing_metadata())
        stats = channel.unary_unary(
            "/ballast.v1.KVCache/Stats",
            request_serializer=lambda raw: raw,
            response_deserializer=kvcache_pb2.KVStatsReply.FromString,
        )
        await stats(b"", timeout=10)  # still serving
    assert malformed_requests() - before == 3
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info], caplog.records[:3]


async def test_a_refused_client_stream_still_sending_large_frames_gets_its_status_whole(cache):
    """The cache refuses the first frame while the client is still writing megabytes: the
    client must get that INVALID_ARGUMENT every time, not a transport INTERNAL."""
    from ballast.v1 import kvcache_pb2

    bad_opening = kvcache_pb2.KVPutRequest(
        open=kvcache_pb2.KVPutOpen(scope=kvcache_pb2.KVScope(model_version="v1", tenant="t"), ttl_s=60),
        headers=[kvcache_pb2.KVBlockHeader(block_hash=b"\x01" * 32, size=4, crc32=0)],
    ).SerializeToString()
    large = kvcache_pb2.KVPutRequest(data=b"\x00" * 1_200_000).SerializeToString()
    codes = []
    async with grpc.aio.insecure_channel(cache.address, options=CHANNEL_OPTIONS) as channel:
        put = channel.stream_unary(
            "/ballast.v1.KVCache/Put", request_serializer=lambda raw: raw, response_deserializer=lambda raw: raw
        )
        for _ in range(300):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await put(iter([bad_opening, large, large, b"\x08\x01"]), timeout=10)
            codes.append((err.value.code(), err.value.details()))
    assert all(code == grpc.StatusCode.INVALID_ARGUMENT for code, _ in codes), [
        c for c in codes if c[0] != grpc.StatusCode.INVALID_ARGUMENT
    ][:3]


async def test_a_refused_client_stream_that_never_ends_is_still_answered(cache):
    """Reading the rest of a refused stream is bounded: a client that never closes its side
    after its first frame was refused gets the refusal, not a call held open until its
    deadline. (The client stops writing after a few frames: one still writing when the status
    comes can see its own failed write, INTERNAL from gRPC's core, instead of the status.)"""
    import asyncio

    from ballast.v1 import kvcache_pb2

    no_open = kvcache_pb2.KVPutRequest(data=b"\x00" * 16).SerializeToString()

    async def endless():
        for _ in range(5):
            yield no_open
        await asyncio.Event().wait()  # never half-closes

    async with grpc.aio.insecure_channel(cache.address, options=CHANNEL_OPTIONS) as channel:
        put = channel.stream_unary(
            "/ballast.v1.KVCache/Put", request_serializer=lambda raw: raw, response_deserializer=lambda raw: raw
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await put(endless(), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
    assert "open" in err.value.details()
