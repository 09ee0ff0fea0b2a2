"""bench/plain_server.py, the soak benchmark's stand-in for `vllm serve`, as a real process
spoken to with the official OpenAI SDK: streamed and whole chat completions, usage, greedy
determinism, OpenAI-shaped errors, metrics, a client leaving mid-stream, and SIGTERM.

Guided decoding (response_format) is tested on the torch engine only: the sim engine draws
its tokens without a model and does not honour a schema.
"""

from __future__ import annotations

import asyncio
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import jsonschema
import openai
import pytest
from openai import AsyncOpenAI

REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0
# Decode steps of 2 ms: short answers take milliseconds, a 1500-token one seconds (long enough
# to leave in the middle of it).
FAST_PROFILE = {
    "source": "tests",
    "prefill_base_ms": 1.0,
    "prefill_ms_per_token": 0.0,
    "decode_base_ms": 2.0,
    "decode_ms_per_seq": 0.0,
    "decode_ms_per_kv_token": 0.0,
    "max_num_seqs": 4,
    "jitter": 0.0,
}
MESSAGES = [{"role": "user", "content": "Where is my order 123?"}]
SCHEMA = {
    "type": "object",
    "properties": {"order": {"type": "integer"}, "status": {"type": "string", "maxLength": 20}},
    "required": ["order", "status"],
    "additionalProperties": False,
}


class ServerDidNotStart(Exception):
    pass


@dataclass
class PlainServer:
    process: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self) -> AsyncOpenAI:
        return AsyncOpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0, timeout=30)

    def stop(self) -> int:
        """SIGTERM by pid, then SIGKILL if it will not go; returns the exit status."""
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                return self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
        return self.process.wait()


def _read_ready_port(process: subprocess.Popen, log: Path) -> int:
    deadline = time.monotonic() + START_TIMEOUT_S
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if not selector.select(timeout=0.2):
                if process.poll() is not None:
                    break
                continue
            line = process.stdout.readline()
            if not line:
                break
            if line.startswith("READY port="):
                return int(line.split("=", 1)[1])
    raise ServerDidNotStart(f"no READY line; the server's log:\n{log.read_text()}")


def start_server(log_dir: Path, *args: str) -> PlainServer:
    log = log_dir / "plain-server.log"
    with log.open("w") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "bench.plain_server", "--port", "0", *args],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=log_file,
            text=True,
        )
    server = PlainServer(process, 0, log)
    try:
        server.port = _read_ready_port(process, log)
    except BaseException:
        server.stop()
        raise
    return server


def start_sim_server(tmp_path_factory, model_dir: Path) -> PlainServer:
    folder = tmp_path_factory.mktemp("plain-sim")
    profile = folder / "profile.json"
    profile.write_text(json.dumps(FAST_PROFILE))
    return start_server(
        folder,
        "--engine",
        "sim",
        "--model-dir",
        str(model_dir),
        "--model-name",
        "tiny",
        "--sim-profile",
        str(profile),
        "--max-concurrency",
        "4",
    )


@pytest.fixture(scope="module")
def sim_server(tmp_path_factory, tiny_model_dir):
    server = start_sim_server(tmp_path_factory, tiny_model_dir)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def torch_server(tmp_path_factory, tiny_model_dir):
    # No --model-name: the server names the model after its folder.
    server = start_server(
        tmp_path_factory.mktemp("plain-torch"), "--engine", "torch", "--model-dir", str(tiny_model_dir)
    )
    yield server
    server.stop()


async def _streamed(client: AsyncOpenAI, model: str, **kwargs) -> tuple[list, str]:
    stream = await client.chat.completions.create(
        model=model, messages=MESSAGES, stream=True, stream_options={"include_usage": True}, **kwargs
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return chunks, text


async def _metric(server: PlainServer, name: str) -> float:
    async with aiohttp.ClientSession() as session, session.get(f"{server.url}/metrics") as response:
        text = await response.text()
    values = [line.split()[1] for line in text.splitlines() if line.startswith(name + " ")]
    assert values, f"{name} missing from /metrics"
    return float(values[0])


# -- sim engine --------------------------------------------------------------------------------


async def test_a_stream_reports_the_usage_of_what_it_streamed(sim_server):
    async with sim_server.client() as client:
        chunks, text = await _streamed(client, "tiny", max_tokens=12, seed=5)
        whole = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, seed=5)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]  # the sim engine never draws EOS: it ends at max_tokens
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 12
    assert usage_chunk.usage.total_tokens == usage_chunk.usage.prompt_tokens + 12
    # Seeded: the whole answer is what was streamed, with the same usage.
    assert text and whole.choices[0].message.content == text
    assert whole.object == "chat.completion" and whole.choices[0].finish_reason == "length"
    assert whole.usage == usage_chunk.usage


async def test_greedy_answers_repeat_on_sim(sim_server):
    async with sim_server.client() as client:
        answers = [
            await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0)
            for _ in range(2)
        ]
    texts = [a.choices[0].message.content for a in answers]
    assert texts[0] and texts[0] == texts[1]


async def test_an_unknown_model_is_not_found(sim_server):
    async with sim_server.client() as client:
        with pytest.raises(openai.NotFoundError) as caught:
            await client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=4)
    assert caught.value.body["code"] == "not_found"


async def test_max_tokens_past_the_context_is_a_bad_request(sim_server):
    async with sim_server.client() as client:
        for max_tokens in (2048, 10**6):  # the context is 2048 tokens, prompt included
            with pytest.raises(openai.BadRequestError):
                await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=max_tokens)


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "tiny", "messages": [',
        b'{"model": "tiny", "messages": "hi"}',
        b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}',
    ],
)
async def test_a_malformed_body_is_a_400_in_openai_shape(sim_server, body):
    async with aiohttp.ClientSession() as session:
        async with session.post(
            f"{sim_server.url}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
        ) as response:
            assert response.status == 400
            error = (await response.json())["error"]
    assert error["message"] and error["type"] == "invalid_request_error" and error["code"]


async def test_health_models_and_metrics(sim_server):
    async with aiohttp.ClientSession() as session, session.get(f"{sim_server.url}/health") as response:
        assert response.status == 200
    async with sim_server.client() as client:
        models = await client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    for name in ("plain_requests_running", "plain_requests_waiting", "plain_kv_used_ratio"):
        assert await _metric(sim_server, name) >= 0


async def test_a_client_leaving_mid_stream_frees_its_slot(sim_server):
    async with sim_server.client() as client:
        # 1500 decode steps of 2 ms: about 3 s unless cancelled.
        stream = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1500, stream=True)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                break
        assert await _metric(sim_server, "plain_requests_running") == 1
        await stream.close()
    deadline = time.monotonic() + 1.0
    while await _metric(sim_server, "plain_requests_running") != 0:
        assert time.monotonic() < deadline, "the engine still runs the abandoned stream"
        await asyncio.sleep(0.02)


def test_sigterm_stops_the_server_cleanly(tmp_path_factory, tiny_model_dir):
    server = start_sim_server(tmp_path_factory, tiny_model_dir)
    assert server.stop() == 0, server.log.read_text()


# -- torch engine ------------------------------------------------------------------------------


async def test_torch_greedy_answers_repeat_streamed_or_not(torch_server, tiny_model_dir):
    model = tiny_model_dir.name
    async with torch_server.client() as client:
        assert [m.id for m in (await client.models.list()).data] == [model]
        chunks, streamed = await _streamed(client, model, max_tokens=40, temperature=0)
        answers = [
            await client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=40, temperature=0)
            for _ in range(2)
        ]
    texts = [a.choices[0].message.content for a in answers]
    assert texts[0] and texts == [streamed, streamed]
    assert answers[0].usage == chunks[-1].usage
    finish = answers[0].choices[0].finish_reason
    assert finish in ("stop", "length")
    if finish == "length":
        assert answers[0].usage.completion_tokens == 40


async def test_torch_json_schema_output_validates(torch_server, tiny_model_dir):
    response_format = {"type": "json_schema", "json_schema": {"name": "order", "schema": SCHEMA}}
    async with torch_server.client() as client:
        answer = await client.chat.completions.create(
            model=tiny_model_dir.name, messages=MESSAGES, max_tokens=80, temperature=0, response_format=response_format
        )
        loose = await client.chat.completions.create(
            model=tiny_model_dir.name,
            messages=MESSAGES,
            max_tokens=80,
            temperature=0,
            response_format={"type": "json_object"},
        )
    assert answer.choices[0].finish_reason == "stop"  # the document closed before max_tokens
    jsonschema.validate(json.loads(answer.choices[0].message.content), SCHEMA)
    assert isinstance(json.loads(loose.choices[0].message.content), dict)
