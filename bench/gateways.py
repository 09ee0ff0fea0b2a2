"""Ballast's router beside smg (the SGLang model gateway, Rust) in one run: CPU per relayed
token and added time to first token, each gateway on its own natural backend, the same load.

Ballast: one router over simulated workers (`worker.engine: sim`, bench.common.SIM_PROFILE),
gRPC clients, the router's default stream interval. smg 1.13.0 (`pip install smg==1.13.0`,
the `compare` extra), round robin, over as many simulated OpenAI servers (bench.openai_sim:
the same timing profile, one Server-Sent Event per token as vLLM's own server sends), HTTP
clients. Both backends are Python processes on the same two cores; what is compared is each
gateway's own CPU (/proc) over the tokens its clients got.

For each number of concurrent streams (closed loop) and each answer length, the four paths
run in turn, `--repeats` times: straight to the sim workers, through Ballast's router,
straight to the OpenAI servers, through smg. The added TTFT of a gateway is its TTFT p50
less its own backend's, measured in the same round. Each judged number is the median over the
repeats; every repeat is kept.

The answer length matters: a gateway pays once per request (accepting the call, choosing a
backend, opening the stream) and once per message, and short answers spread the first over
few tokens. Three lengths are measured: 1 token (what a request alone costs: its CPU per
token is its CPU per request), 32 (bench.mesh_scale's load) and 256.

Goals, judged in code (the bar set against the Rust gateways: smg's CPU per token with a
little room, its added TTFT plus 0.2 ms): Ballast's router CPU per token at 100 streams at most 1.2x smg's (each
answer length); at 10 streams at most 1.9x (0.1 ms against smg's 0.052 at 16 streams);
added TTFT p50 at one stream at most smg's + 0.2 ms; no failed answer in any round, through
either gateway or straight to its backend (a side that failed answers would be measured on
less work).

Writes bench/results/gateways.json; exits 1 when a goal is missed.

    python -m bench.gateways [--seconds 4] [--streams 1,10,100] [--tokens 1,32,256] [--workers 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import itertools
import json
import math
import multiprocessing
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.common import http_ok, model_dir_for, percentile, print_table, stop_on_sigterm, write_result
from bench.goals import LOWER, Goal, judge, print_goals
from bench.mesh_scale import cpu_seconds, prompt_ids_for, run_load, settle, sim_mesh_spec
from services.common.processes import ManagedProcess, free_ports, wait_until_ready

SMG_VERSION = "1.13.0"
MODEL = "ballast-sim"
GOALS = (
    Goal(
        "Ballast's router CPU per token over smg's, 100 streams, 32-token answers", "cpu_ratio_100_32", 1.2, LOWER, "x"
    ),
    Goal(
        "Ballast's router CPU per token over smg's, 100 streams, 256-token answers",
        "cpu_ratio_100_256",
        1.2,
        LOWER,
        "x",
    ),
    Goal("Ballast's router CPU per token over smg's, 10 streams, 32-token answers", "cpu_ratio_10_32", 1.9, LOWER, "x"),
    Goal("added TTFT p50 at 1 stream over smg's (Ballast - smg)", "added_ttft_p50_over_smg_ms", 0.2, LOWER, " ms"),
    # A comparison is only as good as its loads: a gateway or backend that failed answers
    # would be measured on less work than the other.
    Goal("failed answers, either gateway or backend, every round", "errors", 0, LOWER),
)


# -- the HTTP load (a process of its own, as bench.mesh_scale's gRPC load) -----------------------


# What marks a token event of a streamed chat or text completion (the role-only or usage
# events of other servers carry neither, so they are not counted).
TOKEN_MARKS = (b'"content":"', b'"text":"')


def token_events(response: bytes | bytearray, starts: list[int] | None = None) -> int:
    """Token events in `response`; with `starts` (an offset per mark), only those that begin
    at or past them, and `starts` moved past every event counted (for bytes that arrive in
    pieces: an event split between two pieces is counted once, when it is whole)."""
    count = 0
    for i, mark in enumerate(TOKEN_MARKS):
        count += response.count(mark, starts[i] if starts else 0)
        if starts is not None:
            starts[i] = max(starts[i], len(response) - len(mark) + 1)
    return count


class SseCall(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection that streams chat completions, one at a time.
    Counts token events as the bytes arrive, and apart those that arrived before `deadline`
    (an answer still streaming at the end of a load is counted up to it, as the gRPC load
    counts); an answer ends with the last chunk after `data: [DONE]`."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.transport: asyncio.Transport | None = None
        self.response = bytearray()
        self.starts = [0] * len(TOKEN_MARKS)
        self.answer_tokens = 0
        self.tokens_in_window = 0
        self.done: asyncio.Future[bytes] | None = None
        self.first: asyncio.Future[float] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        for future in (self.done, self.first):
            if future is not None and not future.done():
                future.set_exception(ConnectionError("connection lost"))

    def data_received(self, data: bytes) -> None:
        self.response += data
        new = token_events(self.response, self.starts)
        self.answer_tokens += new
        if new and time.monotonic() < self.deadline:
            self.tokens_in_window += new
        if new and self.first is not None and not self.first.done():
            self.first.set_result(time.perf_counter())
        if self.done is not None and not self.done.done() and self.response.endswith(b"0\r\n\r\n"):
            if b"data: [DONE]" in self.response:
                self.done.set_result(bytes(self.response))

    async def stream(self, request: bytes) -> tuple[bytes, int, float]:
        """Sends one request; returns the whole response, its token events and when the first
        came."""
        assert self.transport is not None
        loop = asyncio.get_running_loop()
        self.response.clear()
        self.starts = [0] * len(TOKEN_MARKS)
        self.answer_tokens = 0
        self.done, self.first = loop.create_future(), loop.create_future()
        self.transport.write(request)
        response = await self.done
        return response, self.answer_tokens, self.first.result()


def chat_request(host: str, tokens: int) -> bytes:
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Say something."}],
            "max_tokens": tokens,
            "temperature": 0.0,
            "stream": True,
        }
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def _http_load(targets: list[str], streams: int, seconds: float, tokens: int) -> dict:
    """`streams` closed-loop clients for `seconds`, each on its own connection to one target
    (round robin); the tokens that arrived in the window (one per event, as the backends
    send them) and the TTFTs of answers started in it."""
    loop = asyncio.get_running_loop()
    ttfts: list[float] = []
    errors = 0
    end = time.monotonic() + seconds
    calls: list[SseCall] = []

    async def client(index: int) -> None:
        nonlocal errors
        host, port = targets[index % len(targets)].rsplit(":", 1)
        request = chat_request(host, tokens)
        transport, call = await loop.create_connection(lambda: SseCall(end), host, int(port))
        calls.append(call)
        try:
            while time.monotonic() < end:
                start = time.perf_counter()
                try:
                    response, got, first = await asyncio.wait_for(call.stream(request), 60)
                except (ConnectionError, asyncio.TimeoutError):
                    errors += 1
                    return
                if not response.startswith(b"HTTP/1.1 200") or got != tokens:
                    errors += 1
                    continue
                ttfts.append((first - start) * 1000)
        finally:
            transport.close()

    started = time.monotonic()
    await asyncio.gather(*(client(i) for i in range(streams)))
    counted = sum(call.tokens_in_window for call in calls)
    return {
        "ttft_ms": ttfts,
        "tokens": counted,
        "messages": counted,
        "errors": errors,
        "seconds": min(seconds, time.monotonic() - started),
    }


def _http_load_in_process(targets: list[str], streams: int, seconds: float, tokens: int) -> dict:
    return asyncio.run(_http_load(targets, streams, seconds, tokens))


def run_http_load(targets: list[str], streams: int, seconds: float, tokens: int) -> dict:
    """The HTTP load in a process of its own (spawned: no state of this one), as
    bench.mesh_scale's gRPC load, so neither shares an interpreter with what it measures."""
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
        return pool.submit(_http_load_in_process, targets, streams, seconds, tokens).result(timeout=seconds + 180)


# -- the smg side: simulated OpenAI servers and the gateway ----------------------------------------


def _streams_through(address: str) -> bool:
    """smg routes only once its health checks found a backend: one short streamed answer."""
    request = urllib.request.Request(
        f"http://{address}/v1/chat/completions",
        data=json.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
        ).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return token_events(response.read()) == 2
    except OSError:
        return False


def start_openai_sims(count: int, log_path: Path) -> tuple[ManagedProcess, list[str]]:
    from bench.common import SIM_PROFILE

    ports = free_ports(count)
    process = ManagedProcess(
        "openai-sim",
        [
            sys.executable,
            "-m",
            "bench.openai_sim",
            "--ports",
            ",".join(map(str, ports)),
            "--profile",
            str(SIM_PROFILE.resolve()),
        ],
        log_path=log_path,
        env={"PYTHONUNBUFFERED": "1"},
    ).start()
    addresses = [f"127.0.0.1:{p}" for p in ports]
    try:
        wait_until_ready(process, lambda: all(http_ok(f"http://{a}/health") for a in addresses), 60, what="serving")
    except BaseException:
        process.stop()
        raise
    return process, addresses


def smg_command() -> str:
    command = shutil.which("smg") or str(Path(sys.executable).with_name("smg"))
    if not Path(command).exists():
        raise SystemExit(f"bench.gateways needs smg: pip install 'smg=={SMG_VERSION}' (or .[compare])")
    return command


def start_smg(backends: list[str], log_path: Path) -> tuple[ManagedProcess, str]:
    port, metrics_port = free_ports(2)
    process = ManagedProcess(
        "smg",
        [
            smg_command(),
            "launch",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--prometheus-port",
            str(metrics_port),
            "--prometheus-host",
            "127.0.0.1",
            "--policy",
            "round_robin",
            "--log-level",
            "warn",
            "--worker-urls",
            *(f"http://{b}" for b in backends),
        ],
        log_path=log_path,
    ).start()
    address = f"127.0.0.1:{port}"
    try:
        wait_until_ready(process, lambda: _streams_through(address), 90, what="routing")
    except BaseException:
        process.stop()
        raise
    return process, address


# -- measuring ---------------------------------------------------------------------------------------


def _measured(load: dict, cpu_s: float, baseline: dict) -> dict:
    p50, base50 = percentile(load["ttft_ms"], 50), percentile(baseline["ttft_ms"], 50)
    return {
        "cpu_ms_per_token": cpu_s / load["tokens"] * 1000 if load["tokens"] else math.nan,
        "tokens_per_s": load["tokens"] / load["seconds"] if load["seconds"] else math.nan,
        "tokens_per_message": load["tokens"] / load["messages"] if load["messages"] else math.nan,
        "ttft_p50_ms": p50,
        "backend_ttft_p50_ms": base50,
        "added_ttft_p50_ms": p50 - base50,
        "errors": load["errors"],
        "backend_errors": baseline["errors"],
    }


def _round(
    streams: int,
    tokens: int,
    seconds: float,
    router,
    workers: list[str],
    smg: ManagedProcess,
    smg_address: str,
    sims: list[str],
    prompt_ids: list[int],
    api_key: str,
) -> dict:
    settle()
    direct = run_load("direct", workers, streams, seconds, prompt_ids, api_key, tokens)
    settle()
    before = cpu_seconds(router.pid)
    routed = run_load("router", [router.address], streams, seconds, prompt_ids, api_key, tokens)
    ballast = _measured(routed, cpu_seconds(router.pid) - before, direct)
    settle()
    backend = run_http_load(sims, streams, seconds, tokens)
    settle()
    assert smg.pid is not None
    before = cpu_seconds(smg.pid)
    through = run_http_load([smg_address], streams, seconds, tokens)
    gateway = _measured(through, cpu_seconds(smg.pid) - before, backend)
    return {"ballast": ballast, "smg": gateway, "cpu_ratio": ballast["cpu_ms_per_token"] / gateway["cpu_ms_per_token"]}


def _median_point(streams: int, tokens: int, rounds: list[dict]) -> dict:
    point: dict = {"streams": streams, "tokens": tokens, "rounds": rounds}
    for side in ("ballast", "smg"):
        point[side] = {key: statistics.median(r[side][key] for r in rounds) for key in rounds[0][side]}
    point["cpu_ratio"] = statistics.median(r["cpu_ratio"] for r in rounds)
    return point


def run_benchmark(
    stream_steps: list[int], token_steps: list[int], workers_n: int, seconds: float, repeats: int, out: Path
) -> int:
    from services.cli.mesh import LOCAL_API_KEY, Mesh

    model_dir = model_dir_for("tiny")
    points: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="ballast-gateways-") as state:
        mesh = Mesh(sim_mesh_spec(Path(state), model_dir, max(stream_steps))).start()
        sims_process = smg = None
        try:
            router = mesh.routers()[0]
            _, workers = mesh.start_sim_host(workers_n)
            sims_process, sims = start_openai_sims(workers_n, Path(state) / "logs" / "openai-sim.log")
            smg, smg_address = start_smg(sims, Path(state) / "logs" / "smg.log")
            time.sleep(2.0)  # the router's watch has every worker
            prompt_ids = prompt_ids_for(model_dir)
            for streams, tokens in itertools.product(stream_steps, token_steps):
                rounds = [
                    _round(
                        streams,
                        tokens,
                        seconds,
                        router,
                        [w.address for w in workers],
                        smg,
                        smg_address,
                        sims,
                        prompt_ids,
                        LOCAL_API_KEY,
                    )
                    for _ in range(repeats)
                ]
                point = _median_point(streams, tokens, rounds)
                points.append(point)
                b, s = point["ballast"], point["smg"]
                print(
                    f"streams {streams:4d} tokens {tokens:4d}: CPU per token Ballast {b['cpu_ms_per_token']:.4f} ms "
                    f"({b['tokens_per_message']:.1f} tok/msg), smg {s['cpu_ms_per_token']:.4f} ms "
                    f"({s['tokens_per_message']:.1f} tok/msg), ratio {point['cpu_ratio']:.2f}x; added TTFT p50 "
                    f"Ballast {b['added_ttft_p50_ms']:.2f} ms, smg {s['added_ttft_p50_ms']:.2f} ms",
                    flush=True,
                )
        finally:
            if smg is not None:
                smg.stop()
            if sims_process is not None:
                sims_process.stop()
            mesh.stop()
    return _report(points, workers_n, seconds, repeats, out)


def _errors(round_: dict) -> int:
    """Failed answers in a round: through each gateway and straight to its backend."""
    return sum(round_[side][key] for side in ("ballast", "smg") for key in ("errors", "backend_errors"))


def _report(points: list[dict], workers_n: int, seconds: float, repeats: int, out: Path) -> int:
    def at(streams: int, tokens: int) -> dict | None:
        return next((p for p in points if p["streams"] == streams and p["tokens"] == tokens), None)

    # Each goal judged on its point's rounds (the median of them, the range beside it).
    values: dict[str, list[float]] = {}
    for key, streams, tokens in (
        ("cpu_ratio_100_32", 100, 32),
        ("cpu_ratio_100_256", 100, 256),
        ("cpu_ratio_10_32", 10, 32),
    ):
        point = at(streams, tokens)
        if point is not None:
            values[key] = [r["cpu_ratio"] for r in point["rounds"]]
    one = next((p for p in points if p["streams"] == 1), None)
    if one is not None:
        values["added_ttft_p50_over_smg_ms"] = [
            r["ballast"]["added_ttft_p50_ms"] - r["smg"]["added_ttft_p50_ms"] for r in one["rounds"]
        ]
    # Counted once over every round (not a median: one failing round is a failure).
    judged = judge(GOALS, {**values, "errors": float(sum(_errors(r) for p in points for r in p["rounds"]))})
    print_table(
        [
            "streams",
            "tokens",
            "Ballast ms/tok",
            "tok/msg",
            "smg ms/tok",
            "tok/msg",
            "ratio",
            "added TTFT B",
            "added TTFT smg",
        ],
        [
            [
                p["streams"],
                p["tokens"],
                f"{p['ballast']['cpu_ms_per_token']:.4f}",
                f"{p['ballast']['tokens_per_message']:.1f}",
                f"{p['smg']['cpu_ms_per_token']:.4f}",
                f"{p['smg']['tokens_per_message']:.1f}",
                f"{p['cpu_ratio']:.2f}x",
                f"{p['ballast']['added_ttft_p50_ms']:.2f}",
                f"{p['smg']['added_ttft_p50_ms']:.2f}",
            ]
            for p in points
        ],
    )
    print_goals(judged)
    write_result(
        out,
        {
            "benchmark": "gateways",
            "engine": "sim",
            "smg_version": SMG_VERSION,
            "workers": workers_n,
            "seconds": seconds,
            "repeats": repeats,
            "points": points,
            **{key: statistics.median(runs) for key, runs in values.items()},
            "errors": sum(_errors(r) for p in points for r in p["rounds"]),
            **judged,
        },
    )
    print(f"wrote {out}")
    return 0 if judged["met"] else 1


def main(argv: list[str] | None = None) -> int:
    stop_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="load per path and round")
    parser.add_argument("--streams", default="1,10,100")
    parser.add_argument("--tokens", default="1,32,256", help="answer lengths, tokens")
    parser.add_argument("--workers", type=int, default=4, help="sim workers, and as many OpenAI servers")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results/gateways.json"))
    args = parser.parse_args(argv)
    smg_command()
    return run_benchmark(
        [int(s) for s in args.streams.split(",")],
        [int(t) for t in args.tokens.split(",")],
        args.workers,
        args.seconds,
        args.repeats,
        args.out,
    )


if __name__ == "__main__":
    sys.exit(main())
