"""Simulated OpenAI-compatible engine servers: the natural backend of an HTTP gateway (smg) in
bench/gateways.py, timed like Ballast's sim workers.

Each server is one simulated engine on a port of its own, several to a process (as
services.worker.sim.host runs sim workers). An engine batches like the sim engine
(services.worker.sim.profile): a request waits its prefill, then joins the running batch,
and every decode step (`decode_base_ms + decode_ms_per_seq x running + decode_ms_per_kv_token
x KV tokens`) gives each running stream one token. A streamed answer is one Server-Sent Event
per token, as vLLM's own server sends by default, each a full `chat.completion.chunk`.

HTTP/1.1 is written by hand on asyncio's Protocol (no framework): the process serving
hundreds of streams on a shared core must cost as little as it can, since whatever it costs
is taken from the gateway being measured. Served: GET /health, /v1/models, /get_model_info,
/get_server_info and /version (what smg asks before it routes to a backend); POST
/v1/chat/completions and /v1/completions, streamed or not. Anything else: 404.

    python -m bench.openai_sim --ports 18001,18002 [--profile deploy/sim/h100-llama-3.1-8b.json]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

from services.worker.sim.profile import SimProfile

MODEL = "ballast-sim"
# The prompt's length in tokens, for prefill and the KV cache: a request's own text is not
# tokenized (the gateway being measured does not tokenize either).
PROMPT_TOKENS = 64
MAX_TOKENS_DEFAULT = 16
INFO = {
    "/health": b"",
    "/version": json.dumps({"version": "0.0.0-ballast-sim"}).encode(),
    "/v1/models": json.dumps(
        {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "ballast"}]}
    ).encode(),
    "/get_model_info": json.dumps({"model_path": MODEL, "tokenizer_path": MODEL, "is_generation": True}).encode(),
    "/get_server_info": json.dumps(
        {"model_path": MODEL, "tokenizer_path": MODEL, "max_total_num_tokens": 1 << 20}
    ).encode(),
}


def _response(status: str, body: bytes, content_type: str = "application/json") -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


def _chunked(payload: bytes) -> bytes:
    """One HTTP/1.1 chunk (Transfer-Encoding: chunked)."""
    return b"%x\r\n%s\r\n" % (len(payload), payload)


STREAM_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n"
DONE = _chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n"


@dataclass(eq=False)
class Answer:
    """One request's answer in an engine's batch."""

    transport: asyncio.Transport
    max_tokens: int
    stream: bool
    chat: bool
    sent: int = 0
    kv_tokens: int = PROMPT_TOKENS
    token_event: bytes = field(default=b"", repr=False)

    def __post_init__(self) -> None:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        choice: dict[str, object] = {"index": 0, "finish_reason": None}
        choice.update({"delta": {"content": " tok"}} if self.chat else {"text": " tok"})
        event = {"id": f"cmpl-{id(self):x}", "object": kind, "created": 0, "model": MODEL, "choices": [choice]}
        self.token_event = _chunked(b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n")

    def whole(self) -> bytes:
        """The answer as one JSON body (a request that did not ask to stream)."""
        text = " tok" * self.sent
        choice: dict = {"index": 0, "finish_reason": "length"}
        choice.update({"message": {"role": "assistant", "content": text}} if self.chat else {"text": text})
        usage = {
            "prompt_tokens": PROMPT_TOKENS,
            "completion_tokens": self.sent,
            "total_tokens": PROMPT_TOKENS + self.sent,
        }
        body: dict[str, object] = {
            "id": f"cmpl-{id(self):x}",
            "object": "chat.completion" if self.chat else "text_completion",
        }
        body.update({"created": 0, "model": MODEL, "choices": [choice], "usage": usage})
        return _response("200 OK", json.dumps(body).encode())


class Engine:
    """One simulated engine: prefill, then a shared decode step for every running answer."""

    def __init__(self, profile: SimProfile) -> None:
        self.profile = profile
        self.running: list[Answer] = []
        self._step: asyncio.TimerHandle | None = None

    def submit(self, answer: Answer) -> None:
        loop = asyncio.get_running_loop()
        loop.call_later(self.profile.prefill_ms(PROMPT_TOKENS) / 1000, self._join, answer)

    def _join(self, answer: Answer) -> None:
        if answer.transport.is_closing():
            return
        self.running.append(answer)
        if self._step is None:
            self._schedule()

    def _schedule(self) -> None:
        kv = sum(a.kv_tokens for a in self.running)
        step_s = self.profile.decode_step_ms(len(self.running), kv) / 1000
        self._step = asyncio.get_running_loop().call_later(step_s, self._decode)

    def _decode(self) -> None:
        still: list[Answer] = []
        for answer in self.running:
            if answer.transport.is_closing():
                continue
            answer.sent += 1
            answer.kv_tokens += 1
            if answer.stream:
                answer.transport.write(answer.token_event)
            if answer.sent < answer.max_tokens:
                still.append(answer)
            elif answer.stream:
                answer.transport.write(DONE)
            else:
                answer.transport.write(answer.whole())
        self.running = still
        self._step = None
        if still:
            self._schedule()


class OpenAIProtocol(asyncio.Protocol):
    """HTTP/1.1 with keep-alive, one request at a time per connection."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            head_end = self.buffer.find(b"\r\n\r\n")
            if head_end < 0:
                return
            lines = self.buffer[:head_end].decode("latin-1").split("\r\n")
            length = 0
            for line in lines[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if len(self.buffer) < head_end + 4 + length:
                return
            body = self.buffer[head_end + 4 : head_end + 4 + length]
            self.buffer = self.buffer[head_end + 4 + length :]
            method, target = (lines[0].split(" ") + ["", ""])[:2]
            self._handle(method, target.split("?", 1)[0], body)

    def _handle(self, method: str, path: str, body: bytes) -> None:
        assert self.transport is not None
        if method == "GET" and path in INFO:
            self.transport.write(_response("200 OK", INFO[path]))
            return
        if method != "POST" or path not in ("/v1/chat/completions", "/v1/completions"):
            self.transport.write(_response("404 Not Found", b'{"error":"not found"}'))
            return
        try:
            request = json.loads(body)
            max_tokens = int(request.get("max_tokens") or request.get("max_completion_tokens") or MAX_TOKENS_DEFAULT)
        except (ValueError, TypeError, AttributeError):
            self.transport.write(_response("400 Bad Request", b'{"error":"bad request"}'))
            return
        stream = bool(request.get("stream"))
        answer = Answer(self.transport, max(1, max_tokens), stream, chat=path == "/v1/chat/completions")
        if stream:
            self.transport.write(STREAM_HEAD)
        self.engine.submit(answer)


async def serve(ports: list[int], profile: SimProfile, host: str = "127.0.0.1") -> None:
    loop = asyncio.get_running_loop()
    servers = []
    for port in ports:
        engine = Engine(profile)
        servers.append(await loop.create_server(functools.partial(OpenAIProtocol, engine), host, port))
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    print(f"serving {len(ports)} simulated engines on {host}:{','.join(map(str, ports))}", flush=True)
    await stop.wait()
    for server in servers:
        server.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ports", required=True, help="comma-separated: one engine per port")
    parser.add_argument("--profile", type=Path, default=None, help="a sim profile (JSON); default: the sim's own")
    args = parser.parse_args(argv)
    asyncio.run(serve([int(p) for p in args.ports.split(",")], SimProfile.load(args.profile)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
