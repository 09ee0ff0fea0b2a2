"""The worker front's CPU per token on vLLM, beside vLLM's own OpenAI server's, same requests.

vLLM runs its engine (the scheduler and the forward passes) in a process of its own
(`VLLM::EngineCore`); what serves the requests in front of it is a second process: vLLM's
OpenAI server (`vllm serve`), or Ballast's worker. This benchmark measures that front's CPU
seconds per generated token, on the same model (SmolLM2 by default), the same engine
settings and the same requests:

- **vLLM's server**: `vllm.entrypoints.openai.api_server` (as the soak's baseline starts it),
  streamed `/v1/completions` over HTTP.
- **Ballast's worker**: a local mesh with one vLLM worker (no keeper, so the worker's process
  is the front), reached through the router as production reaches it (`Worker/Relay`); only
  the worker's process is measured, not the router's.

Each front's CPU seconds at start-up (from its start to serving, before any request) are
recorded beside: a front started again after a crash pays them again, which weighs on a
soak with faults far more than the per-token cost does. So is each front's CPU while it
serves nothing, after its rounds (`IDLE_S`): its background work, paid whether or not
tokens flow.

Both fronts are started (each with its own engine process) and warmed up; then `--rounds`
rounds run, in each of which each front in turn serves `--streams` concurrent streams, each
sending `--requests` greedy completions of `--max-tokens` tokens one after another, while
the other front waits idle. The order alternates from round to round, so neither front has
the machine's quieter moments to itself, and a drift over the run (other load, the cores'
clocks) falls on both alike. A round's cost is the front's CPU (its own process's, not its
engine's) from before its first request to after its last answer, counted to the nanosecond
per thread (schedstat) and split by what runs on the threads: the event loop (the front's
Python), gRPC's C core (the worker's), ZeroMQ's I/O to the engine (both), others. The goal (the worker's
CPU per token no more than vLLM's own server's) is judged on the median round of each; each
round's own ratio is recorded beside. After the rounds both fronts' idle CPU is measured
over the same seconds. Prints a table and writes bench/results/worker_front.json; exits 1
when the goal is missed.

    python -m bench.worker_front [--preset smollm2] [--streams 8] [--requests 8] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator

from bench.common import http_ok, model_dir_for, print_table, stop_on_sigterm, write_result
from bench.goals import LOWER, Goal, judge, print_goals
from bench.mesh_scale import cpu_seconds
from bench.soak.baseline import vllm_server_argv
from ballast.v1 import common_pb2, inference_pb2_grpc
from services.cli.client import chat_request, open_channel
from services.cli.mesh import LOCAL_API_KEY, Mesh, MeshSpec
from services.common.processes import ManagedProcess, free_ports, wait_until_ready

GOALS = (Goal("worker front CPU per token over vLLM's own server's", "front_cpu_ratio", 1.0, LOWER, "x"),)

PROMPTS = [
    "Where is my order? I paid for a blue phone case yesterday.",
    "Please summarise the refund policy for damaged items.",
    "Can I change the delivery address of order 4471?",
    "Is the red charger in stock, and what does it cost?",
]
MODEL_NAME = "tiny"  # the name a local mesh serves its model under
# The soak baseline's settings for vLLM's server (bench/soak/baseline.py), Ballast's worker
# runs the engine with the same: float32, eager, prefix caching, 8 sequences at once.
MAX_NUM_SEQS = 8
READY_TIMEOUT_S = 400.0
# After the rounds, each front's CPU with nothing to serve: its background work, which a
# front pays whether or not tokens flow (IDLE_SETTLE_S first, for the last stream's tail).
IDLE_SETTLE_S = 2.0
IDLE_S = 20.0


async def _streams(send, streams: int, requests: int) -> int:
    """`streams` concurrent clients, each sending `requests` one after another; the tokens."""

    async def client(index: int) -> int:
        tokens = 0
        for n in range(requests):
            tokens += await send(PROMPTS[(index + n) % len(PROMPTS)])
        return tokens

    return sum(await asyncio.gather(*(client(i) for i in range(streams))))


def _thread_cpu_ns(pid: int) -> dict[int, tuple[str, int]]:
    """Each live thread of `pid`: (its name, its CPU nanoseconds so far) from schedstat, exact
    where /proc/PID/stat counts 10 ms ticks (a few per cent of a round, too coarse for a goal
    judged at 1x or for an idle front's few milliseconds a second)."""
    threads: dict[int, tuple[str, int]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            cpu_ns = int((task / "schedstat").read_text().split()[0])
            threads[int(task.name)] = ((task / "comm").read_text().strip(), cpu_ns)
        except (OSError, ValueError, IndexError):
            pass  # a thread that ended meanwhile
    return threads


def _task_cpu_s(pid: int) -> float:
    """CPU seconds of every live thread of `pid`, to the nanosecond."""
    return sum(cpu_ns for _name, cpu_ns in _thread_cpu_ns(pid).values()) / 1e9


# Threads by what runs on them: gRPC's C core (its event engine's pool, timer and
# lifeguard threads; the worker front only: vLLM's server speaks HTTP from its event loop)
# and ZeroMQ's I/O threads (both fronts reach their engine process over ZeroMQ).
GRPC_CORE_THREADS = ("event_engine", "grpc_global_tim", "lifeguard")
ZMQ_THREADS = ("ZMQbg/",)


def _thread_group(pid: int, tid: int, name: str) -> str:
    if tid == pid:
        return "event loop (main thread)"
    if name.startswith(GRPC_CORE_THREADS):
        return "gRPC core threads"
    if name.startswith(ZMQ_THREADS):
        return "ZeroMQ threads"
    return "other threads"


def _round_cpu(pid: int, before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]]) -> dict[str, float]:
    """CPU seconds of a round by thread group, from two `_thread_cpu_ns` snapshots (a thread
    started meanwhile counts from 0)."""
    groups: dict[str, float] = {}
    for tid, (name, cpu_ns) in after.items():
        group = _thread_group(pid, tid, name)
        groups[group] = groups.get(group, 0.0) + (cpu_ns - before.get(tid, (name, 0))[1]) / 1e9
    return groups


Send = Callable[[str], Awaitable[int]]


@dataclass
class Front:
    """One front under measurement: its process and how to send it a request (tokens back)."""

    name: str
    pid: int
    start_cpu_s: float
    send: Send | None = None
    rounds: list[dict] = field(default_factory=list)
    idle_cpu_ms_per_s: float = 0.0


async def _round(front: Front, streams: int, requests: int) -> dict:
    """One measured round of one front: its CPU seconds (by thread group too) and the tokens
    its streams got."""
    assert front.send is not None
    threads_before, ticks_before = _thread_cpu_ns(front.pid), cpu_seconds(front.pid)
    started = time.perf_counter()
    tokens = await _streams(front.send, streams, requests)
    wall_s = time.perf_counter() - started
    threads_after, ticks_s = _thread_cpu_ns(front.pid), cpu_seconds(front.pid) - ticks_before
    by_group = _round_cpu(front.pid, threads_before, threads_after)
    # A thread that ended during the round took its CPU with it from schedstat's counts, not
    # from /proc/PID/stat's: then the round is counted in ticks.
    exact = threads_before.keys() <= threads_after.keys()
    cpu_s = sum(by_group.values()) if exact else ticks_s
    return {
        "tokens": tokens,
        "front_cpu_s": cpu_s,
        "cpu_counted_by": "schedstat, ns" if exact else "/proc/PID/stat, 10 ms ticks (a thread ended)",
        "cpu_s_in_ticks": ticks_s,
        "front_cpu_ms_per_token_by_thread": {group: 1000 * s / max(tokens, 1) for group, s in sorted(by_group.items())},
        "wall_s": wall_s,
        "front_cpu_ms_per_token": 1000 * cpu_s / max(tokens, 1),
        "tokens_per_s": tokens / wall_s,
    }


async def _measure(fronts: list[Front], args: argparse.Namespace) -> None:
    """Warms each front up, runs the rounds (the fronts in turn, the order alternating), then
    measures every front's idle CPU over the same seconds."""
    for front in fronts:
        assert front.send is not None
        await _streams(front.send, args.streams, 1)
    print(f"  warm; measuring {args.rounds} rounds", flush=True)
    for round_number in range(1, args.rounds + 1):
        order = fronts if round_number % 2 else fronts[::-1]
        for front in order:
            measured = await _round(front, args.streams, args.requests)
            front.rounds.append(measured)
            print(
                f"  round {round_number}, {front.name}: {measured['tokens']} tokens in {measured['wall_s']:.1f} s, "
                f"{measured['front_cpu_ms_per_token']:.3f} front CPU-ms per token",
                flush=True,
            )
    await asyncio.sleep(IDLE_SETTLE_S)
    before, started = [_task_cpu_s(front.pid) for front in fronts], time.perf_counter()
    await asyncio.sleep(IDLE_S)
    elapsed = time.perf_counter() - started
    for front, cpu_before in zip(fronts, before):
        front.idle_cpu_ms_per_s = 1000 * (_task_cpu_s(front.pid) - cpu_before) / elapsed
        print(f"  idle, {front.name}: {front.idle_cpu_ms_per_s:.2f} front CPU-ms per second", flush=True)


# -- vLLM's own server --------------------------------------------------------------------------


def _vllm_sender(http: Any, base_url: str, max_tokens: int) -> Send:
    async def send(prompt: str) -> int:
        body = {
            "model": MODEL_NAME,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        tokens = 0
        async with http.post(f"{base_url}/v1/completions", json=body) as reply:
            reply.raise_for_status()
            async for line in reply.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    tokens = usage["completion_tokens"]
        return tokens

    return send


@contextmanager
def vllm_server(model_dir: Path, state: Path) -> Iterator[tuple[Front, str]]:
    """vLLM's own server, serving: (its front, its base URL)."""
    port = free_ports(1)[0]
    env = {"PYTHONUNBUFFERED": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    server = ManagedProcess(
        "vllm-server", vllm_server_argv(model_dir, MODEL_NAME, port, MAX_NUM_SEQS), log_path=state / "vllm.log", env=env
    )
    server.start()
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_until_ready(server, lambda: http_ok(f"{base_url}/health"), READY_TIMEOUT_S, interval=0.5, what="healthy")
        assert server.pid is not None
        yield Front("vLLM's server", server.pid, cpu_seconds(server.pid)), base_url
    finally:
        server.stop(timeout=20)


# -- Ballast's worker -----------------------------------------------------------------------------


def _ballast_sender(router: inference_pb2_grpc.InferenceStub, max_tokens: int) -> Send:
    metadata = (("x-api-key", LOCAL_API_KEY),)

    async def send(prompt: str) -> int:
        request = chat_request(prompt, model=MODEL_NAME, max_tokens=max_tokens, raw_prompt=True)
        tokens = 0
        async for event in router.Generate(request, metadata=metadata, timeout=300):
            if event.HasField("tokens"):
                tokens += len(event.tokens.token_ids)
            elif event.HasField("finished") and event.finished.degradation != common_pb2.DEGRADATION_NONE:
                raise RuntimeError("a degraded answer: the worker did not serve it")
        return tokens

    return send


@contextmanager
def ballast_worker(model_dir: Path, state: Path) -> Iterator[tuple[Front, str]]:
    """A local mesh with one vLLM worker, serving: (the worker's front, the router's address)."""
    spec = MeshSpec(
        state_dir=state,
        model_dir=model_dir,
        engine="vllm",
        workers=1,
        worker_capacity=MAX_NUM_SEQS,
        # No keeper: the worker's own process is the front.
        overrides={"worker": {"respawn": False}},
    )
    mesh = Mesh(spec)
    mesh.start()
    try:
        pid = mesh.workers()[0].pid
        assert pid is not None
        yield Front("Ballast's worker", pid, cpu_seconds(pid)), mesh.router_address
    finally:
        mesh.stop()


async def _run(vllm: Front, base_url: str, ballast: Front, router_address: str, args: argparse.Namespace) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as http, open_channel(router_address) as channel:
        vllm.send = _vllm_sender(http, base_url, args.max_tokens)
        ballast.send = _ballast_sender(inference_pb2_grpc.InferenceStub(channel), args.max_tokens)
        await _measure([vllm, ballast], args)


def _median_round(rounds: list[dict]) -> dict:
    return sorted(rounds, key=lambda r: r["front_cpu_ms_per_token"])[len(rounds) // 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="smollm2", help="the model: smollm2, or a tiny-model preset")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--requests", type=int, default=8, help="requests per stream per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("bench/results/worker_front.json"))
    args = parser.parse_args(argv)
    stop_on_sigterm()
    model_dir = model_dir_for(args.preset)
    with tempfile.TemporaryDirectory(prefix="ballast-worker-front-") as state:
        print("[vllm] vLLM's own OpenAI server", flush=True)
        with vllm_server(model_dir, Path(state)) as (vllm_front, base_url):
            print("[ballast] a local mesh with one vLLM worker", flush=True)
            with ballast_worker(model_dir, Path(state) / "mesh") as (ballast_front, router_address):
                asyncio.run(_run(vllm_front, base_url, ballast_front, router_address, args))
    vllm, ballast = _median_round(vllm_front.rounds), _median_round(ballast_front.rounds)
    ratio = ballast["front_cpu_ms_per_token"] / vllm["front_cpu_ms_per_token"]
    result = {
        "engine": "vllm (vllm-cpu)",
        "preset": args.preset,
        "streams": args.streams,
        "requests_per_stream": args.requests,
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "idle_s": IDLE_S,
        "vllm_server": {
            "median_round": vllm,
            "rounds": vllm_front.rounds,
            "start_cpu_s": vllm_front.start_cpu_s,
            "idle_cpu_ms_per_s": vllm_front.idle_cpu_ms_per_s,
        },
        "ballast_worker": {
            "median_round": ballast,
            "rounds": ballast_front.rounds,
            "start_cpu_s": ballast_front.start_cpu_s,
            "idle_cpu_ms_per_s": ballast_front.idle_cpu_ms_per_s,
        },
        "front_cpu_ratio": ratio,
        # Round by round (the two fronts' rounds run next to each other): how steady the ratio is.
        "round_ratios": [
            b["front_cpu_ms_per_token"] / v["front_cpu_ms_per_token"]
            for v, b in zip(vllm_front.rounds, ballast_front.rounds)
        ],
        **judge(GOALS, {"front_cpu_ratio": ratio}),
    }
    print(f"\nthe front's CPU per token, {args.streams} streams, {args.max_tokens} tokens a request (median round)")
    print_table(
        ["front", "CPU ms/token", "tokens", "tokens/s", "front CPU s", "start-up CPU s", "idle CPU ms/s"],
        [
            [name, r["front_cpu_ms_per_token"], r["tokens"], r["tokens_per_s"], r["front_cpu_s"], start, idle]
            for name, r, start, idle in (
                (front.name, _median_round(front.rounds), front.start_cpu_s, front.idle_cpu_ms_per_s)
                for front in (vllm_front, ballast_front)
            )
        ],
    )
    print("\nwhere each front's CPU per token went, by thread (median round; CPU ms per token)")
    groups = sorted({group for r in (vllm, ballast) for group in r["front_cpu_ms_per_token_by_thread"]})
    print_table(
        ["threads", "vLLM's server", "Ballast's worker"],
        [
            [group, *(r["front_cpu_ms_per_token_by_thread"].get(group, 0.0) for r in (vllm, ballast))]
            for group in groups
        ],
    )
    print_goals(result)
    print(f"wrote {write_result(args.out, result)}")
    return 0 if result["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
