"""The HTTP front's small holes, against a real router front on port 0 and a real worker:
unencodable text and headers are 400 (and the router goes on serving), an empty key header
hides no other, slow headers and bodies are timed out, a client that never reads its stream
holds a bounded amount and gets its request cancelled, and an over-long prompt is 400 with
no worker alive."""

from __future__ import annotations

import asyncio
import logging
import socket

import grpc
import httpx
import pytest
import pytest_asyncio

from ballast.v1 import inference_pb2_grpc
from services.cli.client import chat_request, collect
from services.common.grpc_server import CHANNEL_OPTIONS
from services.router.app import create_server as create_router
from services.router.openai.flow import held_bound
from services.worker.app import create_server as create_worker
from tests.component.conftest import API_KEY, make_config

pytestmark = pytest.mark.asyncio(loop_scope="session")

HEADER_TIMEOUT_S = 0.5
BODY_TIMEOUT_S = 0.5
STALLED_S = 1.0
BUFFER_BYTES = 4096
LIMITS = {
    "BALLAST__ROUTER__HTTP_PORT": "0",
    "BALLAST__ROUTER__HTTP_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S),
    "BALLAST__ROUTER__HTTP_BODY_TIMEOUT_S": str(BODY_TIMEOUT_S),
    "BALLAST__ROUTER__HTTP_STALLED_CLIENT_S": str(STALLED_S),
    "BALLAST__ROUTER__HTTP_STREAM_BUFFER_BYTES": str(BUFFER_BYTES),
    # Every token its own event: the never-reading client's stream must outgrow the socket's
    # buffers and the front's, which an answer of few, larger events may not.
    "BALLAST__ROUTER__STREAM_INTERVAL_MS": "0",
}
CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Is the red charger in stock?"}],
    "max_tokens": 4,
    "temperature": 0,
}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def front_worker(etcd_server, tiny_model_dir, etcd_prefix):
    app = await create_worker(make_config(etcd_server, tiny_model_dir, etcd_prefix))
    await app.registration.registered.wait()
    yield app
    await app.shutdown(grace_s=1.0)  # safe twice: the last test stops it


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def front(etcd_server, tiny_model_dir, etcd_prefix, front_worker):
    app = await create_router(make_config(etcd_server, tiny_model_dir, etcd_prefix, **LIMITS))
    assert await app.membership.wait_for(lambda workers: front_worker.worker_id in workers, timeout=10)
    yield app
    await app.shutdown(grace_s=1.0)


@pytest_asyncio.fixture(loop_scope="session")
async def http(front):
    async with httpx.AsyncClient(
        base_url=f"http://{front.http_address}", timeout=30, headers={"Authorization": f"Bearer {API_KEY}"}
    ) as client:
        yield client


def _quiet(caplog) -> list:
    return [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]


async def _until(predicate, timeout: float, what: str, every: float = 0.02) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(every)


async def test_unencodable_text_is_400_and_the_router_goes_on_serving(front, http, caplog):
    bodies = [
        (rb'{"model": "tiny", "messages": [{"role": "user", "content": "\ud800"}]}', "messages[0].content"),
        (rb'{"model": "\udfff", "messages": [{"role": "user", "content": "hi"}]}', "model"),
        (rb'{"model": "tiny", "prompt": "a\udc00"}', "prompt"),
        (b'{"model": "tiny", "prompt": "\xed\xa0\x80"}', None),  # a surrogate as raw bytes: not UTF-8
    ]
    headers = [
        ("x-ballast-session-id", "caf\u00e9".encode()),
        ("x-ballast-session-id", b"\xff\xfe"),
        ("x-api-key", "cl\u00e9".encode()),
        ("x-ballast-tier", b"\xc3"),
    ]
    with caplog.at_level(logging.INFO):
        for body, param in bodies:
            path = "/v1/completions" if b'"prompt"' in body else "/v1/chat/completions"
            response = await http.post(path, content=body, headers={"Content-Type": "application/json"})
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == param
        for name, value in headers:
            response = await http.post("/v1/chat/completions", json=CHAT, headers={name: value})
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == name
            assert "printable ASCII" in response.json()["error"]["message"]
        response = await http.get("/v1/models", headers={"x-ballast-session-id": b"\xe9"})
        assert response.status_code == 400
    assert not _quiet(caplog), _quiet(caplog)[:3]
    response = await http.post("/v1/chat/completions", json=CHAT, headers={"x-ballast-session-id": "s-1"})
    assert response.status_code == 200, response.text
    assert response.json()["ballast"]["degradation"] == "none"


async def test_an_empty_x_api_key_does_not_hide_a_bearer_key(front):
    async with httpx.AsyncClient(base_url=f"http://{front.http_address}", timeout=30) as client:
        response = await client.post(
            "/v1/chat/completions", json=CHAT, headers={"x-api-key": "", "Authorization": f"Bearer {API_KEY}"}
        )
        assert response.status_code == 200, response.text
        assert response.json()["ballast"]["degradation"] == "none"
        response = await client.post("/v1/chat/completions", json=CHAT, headers={"x-api-key": ""})
        assert response.status_code == 401


async def _until_closed(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, trickle: bytes) -> bytes:
    """Sends `trickle` a byte at a time while reading; returns what came back once the server
    closed the connection."""
    received = bytearray()

    async def keep_sending():
        while True:
            for byte in trickle:
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(0.05)

    sender = asyncio.create_task(keep_sending())
    try:
        while chunk := await reader.read(65536):
            received += chunk
    except ConnectionError:
        pass
    finally:
        sender.cancel()
        try:
            await sender
        except (asyncio.CancelledError, ConnectionError):
            pass
        writer.close()
    return bytes(received)


async def test_slow_headers_are_closed_after_the_header_timeout(front, http):
    server = front.http._runner.server
    await http.get("/v1/models")  # the client's own pooled connection is open now
    before = len(server.connections)
    loop = asyncio.get_running_loop()
    started = loop.time()

    async def slowloris():
        reader, writer = await asyncio.open_connection(*front.http_address.rsplit(":", 1))
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        return await _until_closed(reader, writer, b"X-Slow: 1\r\n")

    async with asyncio.timeout(HEADER_TIMEOUT_S * 20):
        answers = await asyncio.gather(*(slowloris() for _ in range(8)))
    # The server closed every one (EOF), and not before its own timer.
    assert loop.time() - started >= HEADER_TIMEOUT_S
    assert all(b"HTTP/1.1 2" not in answer for answer in answers)
    await _until(lambda: len(server.connections) <= before, 5, f"{len(server.connections)} connections left")
    assert (await http.get("/v1/models")).status_code == 200


async def test_a_slow_body_is_408_and_closed(front):
    reader, writer = await asyncio.open_connection(*front.http_address.rsplit(":", 1))
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
        + API_KEY.encode()
        + b"\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{"
    )
    async with asyncio.timeout(BODY_TIMEOUT_S * 20):
        answer = await _until_closed(reader, writer, b'"model": "tiny", ')
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"body_timeout" in answer


async def test_a_client_that_never_reads_holds_little_and_its_request_is_cancelled(front, front_worker, http):
    flow = front.http.flow
    stalled_before = flow.stalled
    host, port = front.http_address.rsplit(":", 1)
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # A small receive window, and nothing ever read from it.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await loop.sock_connect(sock, (host, int(port)))
    # A raw prompt, greedy: the tiny model answers for as long as the context allows.
    body = httpx.Request(
        "POST",
        "http://x/v1/completions",
        json={
            "model": "tiny",
            "prompt": "Is the red charger in stock, and what does it cost?",
            "max_tokens": 1800,
            "temperature": 0,
            "stream": True,
        },
    ).content
    await loop.sock_sendall(
        sock,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
        + API_KEY.encode()
        + b"\r\nContent-Type: application/json\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body,
    )
    try:
        await _until(lambda: front_worker.state.in_flight == 1, 10, "the stream never reached the worker")
        peak = 0

        def sampled() -> bool:
            nonlocal peak
            peak = max(peak, flow.buffered_bytes())
            return flow.stalled > stalled_before

        # The stream backs up into bounded buffers, then the stall limit drops it.
        await _until(sampled, 60, "the never-reading client was not dropped", every=0.01)
        await _until(lambda: front_worker.state.in_flight == 0, 10, "the worker slot was not freed")
        assert 0 < peak <= held_bound(BUFFER_BYTES), peak
        # What the client would have read: a stream cut short, no end of answer.
        received = bytearray()
        async with asyncio.timeout(10):
            while chunk := await loop.sock_recv(sock, 65536):
                received += chunk
        assert received.startswith(b"HTTP/1.1 200") and b"[DONE]" not in received
    finally:
        sock.close()
    assert flow.buffered_bytes() == 0
    response = await http.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 200 and response.json()["ballast"]["degradation"] == "none"


async def test_an_over_long_prompt_is_400_with_no_live_worker(front, front_worker, http):
    # Once the router has served the model, it has learnt its tokenizer.
    assert (await http.post("/v1/chat/completions", json=CHAT)).status_code == 200
    assert front.servicer.models.latest("tiny") is not None
    await front_worker.shutdown(grace_s=1.0)
    await _until(lambda: not front.servicer.pools.has_capacity("tiny"), 30, "the stopped worker is still routable")
    long_text = "charger " * 3000  # over the tiny model's 2048 tokens
    response = await http.post("/v1/completions", json={"model": "tiny", "prompt": long_text, "max_tokens": 8})
    assert response.status_code == 400, response.text
    assert "context" in response.json()["error"]["message"]
    response = await http.post(
        "/v1/chat/completions",
        json={"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": long_text}]},
    )
    assert response.status_code == 400, response.text
    async with grpc.aio.insecure_channel(front.address, options=CHANNEL_OPTIONS) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await collect(inference_pb2_grpc.InferenceStub(channel), chat_request(long_text, max_tokens=8), API_KEY)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # A prompt that fits still goes down the ladder.
    response = await http.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 200, response.text
    assert response.json()["ballast"]["degradation"] != "none"
