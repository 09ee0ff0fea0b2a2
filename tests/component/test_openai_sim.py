"""bench/openai_sim.py, the backend bench.gateways puts under smg, and bench/gateways.py's HTTP
load over it: started as a process by its launcher, it answers what smg asks before routing,
streams exactly the tokens asked for (a backend that sent fewer would make a gateway look
cheaper per token than it is), refuses a malformed body without stopping, and the load counts
what it streamed."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest

from bench.gateways import _http_load, start_openai_sims, token_events

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(120)]


def post(url: str, body: bytes) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


async def test_the_simulated_servers_stream_what_is_asked_and_the_load_counts_it(tmp_path):
    process, addresses = await asyncio.to_thread(start_openai_sims, 2, tmp_path / "openai-sim.log")
    try:
        first = f"http://{addresses[0]}"
        for path in ("/health", "/v1/models", "/get_model_info", "/get_server_info", "/version"):
            status, _ = await asyncio.to_thread(get, first + path)
            assert status == 200, path
        assert (await asyncio.to_thread(get, first + "/nowhere"))[0] == 404

        chat = {"model": "ballast-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 7}
        status, body = await asyncio.to_thread(
            post, first + "/v1/chat/completions", json.dumps({**chat, "stream": True}).encode()
        )
        assert status == 200
        assert token_events(body) == 7 and body.rstrip().endswith(b"data: [DONE]")
        status, body = await asyncio.to_thread(post, first + "/v1/chat/completions", json.dumps(chat).encode())
        answer = json.loads(body)
        assert status == 200 and answer["usage"]["completion_tokens"] == 7
        assert answer["choices"][0]["message"]["content"] == " tok" * 7

        # A malformed body is refused, and the server goes on serving.
        assert (await asyncio.to_thread(post, first + "/v1/completions", b"{not json"))[0] == 400
        status, body = await asyncio.to_thread(
            post, first + "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 3, "stream": True}).encode()
        )
        assert status == 200 and token_events(body) == 3

        # The load: every answer whole (5 tokens each, else an error), over both servers; the
        # tokens counted are those that came in its window, at least one answer's.
        load = await _http_load(addresses, streams=4, seconds=1.0, tokens=5)
        assert load["errors"] == 0
        assert load["tokens"] >= 5 and load["messages"] == load["tokens"]
        assert len(load["ttft_ms"]) >= 4
    finally:
        status = await asyncio.to_thread(process.stop, 15.0)
    assert status == 0, process.log_tail()
