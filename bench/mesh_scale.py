"""What Ballast itself costs as its work grows: simulated workers, 1 to 64 of them, 10 to
1000 concurrent streams, 1 to 4 routers.

The workers run the simulated engine (`worker.engine: sim`, bench.common.SIM_PROFILE: an 8B
model on an H100-class GPU; waiting is sleeping), several to a process (services.worker.sim.host), each a real gRPC server with its
own etcd record. Model compute is out of the picture, so what is measured is the mesh: the
router's admission, routing and relay, gRPC, etcd membership.

For each number of workers (added as the run goes: 1, 4, 16, 64) and each number of
concurrent streams (closed loop: each client starts its next stream when one ends), the
same load runs first straight to the workers (the baseline: Worker/Generate round robin,
prompt ids prepared beforehand), then through a bare relay (bench.bare_relay: one Python gRPC
hop doing nothing else, the floor under any relay written like the router), and then through
1, 2 and 4 routers (clients spread evenly).
For each point: added TTFT p50/p99 (routed minus direct, same workers and streams), router
CPU seconds per 1000 relayed tokens (from /proc, every router summed), relayed tokens/s (per
router process too), and the same for the bare relay. For each number of workers, the time a
change of one worker's record (its health failing) takes to reach every one of four routers.

The load generator is one process, and it shares this machine's cores with the routers and
the sim hosts: at the largest points the machine (not a router) saturates, and the result
says so (`cpu_busy`, from /proc/stat, next to each point). Each load starts once the cores
are quiet again after the one before (`settle_s`: how long that took, at most 10 s).

Every path asks for the router's default stream interval (router.stream_interval_ms: the
first token at once, later ones together at most 50 ms after they were made), so all send the
same messages; each row reports the tokens per message the clients got beside the CPU. Last,
one router of two processes on one port (router.processes) and a one-process router get the
same load over 8 connections, alternating: each process's CPU per token (its CPU over the
tokens its own metrics say it relayed) over the single router's.

Goals, judged in code: added TTFT <= 1 ms p50 and <= 3 ms p99 up to 100 streams (one
router); router CPU per relayed token <= 0.05 ms at 100 streams and <= 0.1 ms at 10 (one
router, its most costly worker count); router CPU per 1000 tokens within 20 % from 4 to 64
workers (100 streams, one router); two routers relay >= 1.8 x what one does (64 workers, the
most streams); each of two router processes on one port within 10 % of one router's CPU per
token, both relaying. The one-router points up to 100 streams, which those goals judge, are
loaded `--repeats` times (3) and report the median of each judged number: on two shared cores
one load of a few seconds varies by a third from run to run.
Writes bench/results/mesh_scale.json (a row per point) and mesh_scale_cost.png; exits 1 when a
goal is missed.

    python -m bench.mesh_scale [--seconds 4] [--workers 1,4,16,64] [--streams 10,100,1000] [--routers 1,2,4]
        [--repeats 3] [--tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.bare_relay import start_bare_relay
from bench.common import (
    metric_sum,
    model_dir_for,
    percentile,
    print_table,
    sim_worker_settings,
    stop_on_sigterm,
    write_result,
)
from bench.goals import HIGHER, LOWER, Goal, judge, print_goals
from services.router.settings import RouterConfig

# Tokens per stream (--tokens): what the router's per-request work is spread over.
TOKENS = 32
# What a router holds a stream's tokens back for by default (router.stream_interval_ms).
STREAM_INTERVAL_MS = RouterConfig.model_fields["stream_interval_ms"].default
# Past one worker heartbeat (1 s): the in-flight counts the routers read are this load's.
HEARTBEAT_SETTLE_S = 2.0
# Before each measured load the cores must be this idle (busy share over half a second), or
# QUIET_MAX_S must have passed: streams cut off when the last load's clients left are still
# being torn down in the workers and routers, and a point measured over that work measures
# the point before it.
QUIET_BUSY = 0.35
QUIET_MAX_S = 10.0
WORKERS_PER_HOST = 16
GOALS = (
    Goal("added TTFT p50 up to 100 streams (1 router)", "added_ttft_p50_ms_upto_100", 1.0, LOWER, " ms"),
    Goal("added TTFT p99 up to 100 streams (1 router)", "added_ttft_p99_ms_upto_100", 3.0, LOWER, " ms"),
    Goal("router CPU per 1k tokens, 64 over 4 workers (spread)", "cpu_per_token_spread", 0.2, LOWER),
    Goal("2 routers' relayed tokens/s over 1 router's", "two_router_scaling", 1.8, HIGHER, "x"),
    Goal(
        "router CPU per relayed token at 100 streams (1 router, most costly worker count)",
        "cpu_ms_per_token_100",
        0.05,
        LOWER,
        " ms",
    ),
    Goal(
        "router CPU per relayed token at 10 streams (1 router, most costly worker count)",
        "cpu_ms_per_token_10",
        0.1,
        LOWER,
        " ms",
    ),
    Goal(
        "each of 2 router processes on one port: CPU per token over one router's",
        "process_cpu_per_token_ratio",
        1.1,
        LOWER,
        "x",
    ),
    Goal("router processes relaying through one address", "processes_serving", 2, HIGHER),
)
# Router processes on one port (router.processes) and the connections the clients spread over them.
PROCESSES = 2
PROCESS_CONNECTIONS = 8


# -- load (runs in a process of its own) -------------------------------------------------------


async def _stream_load(
    kind: str,
    targets: list[str],
    streams: int,
    seconds: float,
    prompt_ids: list[int],
    api_key: str,
    tokens_per_stream: int = TOKENS,
) -> dict:
    """`streams` closed-loop clients for `seconds`; TTFTs of streams started in the window."""
    import grpc

    from ballast.v1 import common_pb2, inference_pb2, inference_pb2_grpc, worker_pb2, worker_pb2_grpc

    # A connection per channel (no subchannel shared between channels to one address): a
    # target named twice is two connections, which router processes on one port share.
    channels = [
        grpc.aio.insecure_channel(
            t, options=[("grpc.max_receive_message_length", 64 << 20), ("grpc.use_local_subchannel_pool", 1)]
        )
        for t in targets
    ]
    if kind == "direct":
        stubs = [worker_pb2_grpc.WorkerStub(c) for c in channels]
    else:
        stubs = [inference_pb2_grpc.InferenceStub(c) for c in channels]
    sampling = common_pb2.SamplingParams(max_tokens=tokens_per_stream, temperature=0.0)
    metadata = (("x-api-key", api_key),)
    ttfts: list[float] = []
    tokens = 0
    messages = 0
    errors = 0
    error_codes: dict[str, int] = {}
    counter = itertools.count()
    end = time.monotonic() + seconds

    def call(i: int):
        stub = stubs[i % len(stubs)]
        if kind == "direct":
            # The router's default stream interval, so that every path sends the same messages.
            request = worker_pb2.WorkerGenerateRequest(
                request_id=f"scale-{i}",
                tenant="local",
                prompt_ids=prompt_ids,
                sampling=sampling,
                flush_interval_ms=STREAM_INTERVAL_MS,
            )
            return stub.Generate(request, timeout=60)
        request = inference_pb2.GenerateRequest(
            request_id=f"scale-{i}", model="tiny", sampling=sampling, prompt=PROMPT, allow_degraded=False
        )
        return stub.Generate(request, metadata=metadata, timeout=60)

    async def client() -> None:
        nonlocal tokens, messages, errors
        while time.monotonic() < end:
            i = next(counter)
            start = time.perf_counter()
            first = None
            try:
                async for event in call(i):
                    if event.HasField("tokens"):
                        if first is None:
                            first = time.perf_counter()
                        if time.monotonic() < end:
                            tokens += len(event.tokens.token_ids)
                            messages += 1
            except grpc.aio.AioRpcError as error:
                errors += 1
                error_codes[error.code().name] = error_codes.get(error.code().name, 0) + 1
                continue
            if first is not None:
                ttfts.append((first - start) * 1000)

    started = time.monotonic()
    await asyncio.gather(*(client() for _ in range(streams)))
    for channel in channels:
        await channel.close()
    return {
        "ttft_ms": ttfts,
        "tokens": tokens,
        "messages": messages,
        "errors": errors,
        "error_codes": error_codes,
        "seconds": min(seconds, time.monotonic() - started),
    }


def _load_process(args: tuple, results) -> None:
    results.put(asyncio.run(_stream_load(*args)))


def run_load(
    kind: str,
    targets: list[str],
    streams: int,
    seconds: float,
    prompt_ids: list[int],
    api_key: str,
    tokens_per_stream: int = TOKENS,
) -> dict:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    process = context.Process(
        target=_load_process,
        args=((kind, targets, streams, seconds, prompt_ids, api_key, tokens_per_stream), results),
        daemon=True,
    )
    process.start()
    try:
        return results.get(timeout=seconds + 180)
    finally:
        process.join(timeout=10)
        if process.is_alive():
            process.kill()


# -- measuring the machine ---------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all cores so far (/proc/stat)."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


def settle(max_s: float = QUIET_MAX_S, busy_below: float = QUIET_BUSY) -> float:
    """Waits until the cores are idle (see QUIET_BUSY), at most `max_s`; the seconds waited."""
    started = time.monotonic()
    while time.monotonic() - started < max_s:
        before = machine_busy()
        time.sleep(0.5)
        after = machine_busy()
        if (after[0] - before[0]) / max(1, after[1] - before[1]) < busy_below:
            break
    return time.monotonic() - started


# -- the run -----------------------------------------------------------------------------------

PROMPT = "Where is my order? I paid for it yesterday."


def prompt_ids_for(model_dir: Path) -> list[int]:
    """The prompt's token ids for the direct baseline (the routed requests send its text)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(PROMPT, add_special_tokens=False).ids


async def routable_reason(metrics_port: int, worker_id: str) -> str | None:
    """Why the router behind `metrics_port` routes nothing to `worker_id` ("none": it routes)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", metrics_port)
    writer.write(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
    await writer.drain()
    body = (await reader.read()).decode()
    writer.close()
    for line in body.splitlines():
        if line.startswith("ballast_router_worker_routable{") and f'worker="{worker_id}"' in line:
            for label in line[line.index("{") + 1 : line.index("}")].split(","):
                name, _, value = label.partition("=")
                if name == "reason":
                    return value.strip('"')
    return None


async def _membership_change_s(mesh, worker_id: str, routers, reps: int = 3) -> float:
    """Median time from writing one worker's fault key (health failing) until every router
    shows it unhealthy; each change is undone before the next."""
    from services.common.etcd_client import make_client
    from services.config import load_config
    from services.worker.sim import faults_key

    etcd = load_config(mesh.config_path, environ={}).etcd
    client = make_client(etcd)
    key = faults_key(etcd.prefix, worker_id).encode()
    times = []
    try:
        for _ in range(reps):
            for want, value in (("unhealthy", b'{"fail_health": true}'), ("none", None)):
                started = time.perf_counter()
                if value is None:
                    await client.delete(key)
                else:
                    await client.put(key, value)
                pending = set(r.metrics_port for r in routers)
                deadline = time.monotonic() + 30
                while pending and time.monotonic() < deadline:
                    for port in list(pending):
                        if await routable_reason(port, worker_id) == want:
                            pending.discard(port)
                    await asyncio.sleep(0.005)
                if want == "unhealthy":
                    times.append(time.perf_counter() - started if not pending else math.nan)
    finally:
        await client.close()
    return statistics.median(times)


def sim_mesh_spec(state_dir: Path, model_dir: Path, capacity: int):
    """A local mesh of one router and no workers yet (the benchmark starts sim workers), each
    worker taking `capacity` streams at once."""
    from services.cli.mesh import MeshSpec

    return MeshSpec(
        state_dir=state_dir,
        model_dir=model_dir,
        workers=0,
        engine="sim",
        worker_capacity=capacity,
        # Each worker takes every stream of a point: worker queueing would be
        # the same in both paths, but the point is the mesh's own cost.
        overrides={"worker": {"max_queue": capacity, **sim_worker_settings()}},
    )


def run_benchmark(
    seconds: float,
    worker_steps: list[int],
    stream_steps: list[int],
    router_steps: list[int],
    out: Path,
    repeats: int = 3,
    tokens: int = TOKENS,
) -> int:
    from services.cli.mesh import LOCAL_API_KEY, Mesh

    model_dir = model_dir_for("tiny")
    rows: list[dict] = []
    membership: dict[int, float] = {}
    with tempfile.TemporaryDirectory(prefix="ballast-mesh-scale-") as state:
        mesh = Mesh(sim_mesh_spec(Path(state), model_dir, max(stream_steps))).start()
        try:
            for _ in range(max(router_steps) - 1):
                mesh.start_router()
            routers = mesh.routers()
            workers = []
            relay = None
            prompt_ids = prompt_ids_for(model_dir)
            for target in worker_steps:
                while len(workers) < target:
                    _, started = mesh.start_sim_host(min(WORKERS_PER_HOST, target - len(workers)))
                    workers += started
                time.sleep(2.0)  # every router's watch has the new workers
                membership[target] = asyncio.run(_membership_change_s(mesh, workers[0].id, routers))
                if relay is not None:
                    relay.stop()
                relay, relay_address = start_bare_relay(
                    [w.address for w in workers], Path(state) / "logs" / f"bare-relay-{target}.log"
                )
                for streams in stream_steps:
                    settle()
                    direct = run_load(
                        "direct", [w.address for w in workers], streams, seconds, prompt_ids, LOCAL_API_KEY, tokens
                    )
                    assert relay.pid is not None
                    relay_cpu_before = cpu_seconds(relay.pid)
                    settle()
                    bare = run_load("direct", [relay_address], streams, seconds, prompt_ids, LOCAL_API_KEY, tokens)
                    bare["cpu_s"] = cpu_seconds(relay.pid) - relay_cpu_before
                    for count in router_steps:
                        chosen = routers[:count]
                        runs = []
                        for _ in range(repeats if count == 1 and streams <= 100 else 1):
                            # The workers publish their streams in flight once a second: a router
                            # must not see the last load's streams as slots another router holds.
                            settled = settle()
                            time.sleep(HEARTBEAT_SETTLE_S)
                            cpu_before = [cpu_seconds(r.pid) for r in chosen]
                            worker_messages_before = _worker_messages(chosen)
                            busy_before = machine_busy()
                            routed = run_load(
                                "router",
                                [r.address for r in chosen],
                                streams,
                                seconds,
                                prompt_ids,
                                LOCAL_API_KEY,
                                tokens,
                            )
                            busy_after = machine_busy()
                            cpu = sum(cpu_seconds(r.pid) - b for r, b in zip(chosen, cpu_before))
                            run = _row(target, streams, count, direct, routed, cpu, busy_before, busy_after, bare)
                            run["settle_s"] = settled
                            worker_messages = _worker_messages(chosen) - worker_messages_before
                            # Tokens per message the routers got from the workers (Relay streams).
                            run["worker_tokens_per_message"] = (
                                routed["tokens"] / worker_messages if worker_messages > 0 else math.nan
                            )
                            runs.append(run)
                        row = median_row(runs)
                        rows.append(row)
                        print(
                            f"workers {target:3d} streams {streams:5d} routers {count}: "
                            f"added TTFT p50 {row['added_ttft_p50_ms']:.2f} ms p99 {row['added_ttft_p99_ms']:.2f} ms "
                            f"(bare relay {row['relay_added_ttft_p50_ms']:.2f} / {row['relay_added_ttft_p99_ms']:.2f}), "
                            f"{row['tokens_per_s']:.0f} tok/s, router CPU {row['router_cpu_s_per_1k_tokens']:.3f} s/1k tok "
                            f"at {row['tokens_per_message']:.1f} tok/msg to clients, "
                            f"{row['worker_tokens_per_message']:.1f} from workers, "
                            f"machine busy {row['cpu_busy']:.0%} (settled in {settled:.1f} s)",
                            flush=True,
                        )
            processes = _processes_point(
                mesh, routers[0], workers, min(100, max(stream_steps)), seconds, prompt_ids, tokens, repeats
            )
        finally:
            if relay is not None:
                relay.stop()
            mesh.stop()
    return _report(rows, membership, seconds, out, tokens, processes)


def _processes_point(
    mesh, single, workers: list, streams: int, seconds: float, prompt_ids: list[int], tokens: int, repeats: int
) -> dict:
    """One router of PROCESSES processes on one port beside a one-process router, the same
    load on each (clients spread over PROCESS_CONNECTIONS connections), alternating `repeats`
    times: each process's CPU per relayed token (its own CPU over the tokens its metrics say it
    relayed) over the single router's."""
    from services.cli.mesh import LOCAL_API_KEY

    group = mesh.start_router(processes=PROCESSES)
    try:
        time.sleep(HEARTBEAT_SETTLE_S)  # its membership watch has every worker
        children = _process_lines(group.process.log_path)
        single_runs, group_runs = [], []
        for _ in range(repeats):
            settle()
            before = cpu_seconds(single.pid)
            load = run_load(
                "router", [single.address] * PROCESS_CONNECTIONS, streams, seconds, prompt_ids, LOCAL_API_KEY, tokens
            )
            single_runs.append((cpu_seconds(single.pid) - before) / max(1, load["tokens"]) * 1000)
            settle()
            cpu = {pid: cpu_seconds(pid) for pid, _ in children}
            relayed = {pid: metric_sum(port, ["ballast_router_streamed_tokens_total"]) or 0.0 for pid, port in children}
            load = run_load(
                "router", [group.address] * PROCESS_CONNECTIONS, streams, seconds, prompt_ids, LOCAL_API_KEY, tokens
            )
            group_runs.append(
                [
                    {
                        "pid": pid,
                        "cpu_s": cpu_seconds(pid) - cpu[pid],
                        "tokens": (metric_sum(port, ["ballast_router_streamed_tokens_total"]) or 0.0) - relayed[pid],
                    }
                    for pid, port in children
                ]
            )
    finally:
        group.process.stop()
    single_ms = statistics.median(single_runs)
    per_process = [
        statistics.median(
            run[i]["cpu_s"] / run[i]["tokens"] * 1000 if run[i]["tokens"] else math.nan for run in group_runs
        )
        for i in range(len(children))
    ]
    shares = [
        statistics.median(run[i]["tokens"] / max(1.0, sum(p["tokens"] for p in run)) for run in group_runs)
        for i in range(len(children))
    ]
    print(
        f"{PROCESSES} router processes on one port, {streams} streams over {PROCESS_CONNECTIONS} connections: "
        f"CPU per token {', '.join(f'{v:.4f}' for v in per_process)} ms (one router: {single_ms:.4f} ms), "
        f"token shares {', '.join(f'{v:.0%}' for v in shares)}",
        flush=True,
    )
    return {
        "streams": streams,
        "connections": PROCESS_CONNECTIONS,
        "single_cpu_ms_per_token": single_ms,
        "single_runs": single_runs,
        "process_cpu_ms_per_token": per_process,
        "process_token_shares": shares,
        "group_runs": group_runs,
    }


def _worker_messages(routers) -> float:
    """Messages the routers have received on their Relay streams from workers, in all."""
    return sum(
        metric_sum(r.metrics_port, ['ballast_router_relay_messages_total{direction="from_workers"}']) or 0.0
        for r in routers
    )


def _process_lines(log_path: Path) -> list[tuple[int, int]]:
    """(pid, metrics port) of each process of a router group, from its PROCESS lines."""
    latest: dict[str, tuple[int, int]] = {}
    for line in log_path.read_text(errors="replace").splitlines():
        parts = line.split()
        if len(parts) == 5 and parts[:2] == ["PROCESS", "router"]:
            latest[parts[2]] = (int(parts[3].split("=")[1]), int(parts[4].split("=")[1]))
    return [latest[slot] for slot in sorted(latest)]


# The numbers the goals judge: a point measured more than once reports the median of each.
REPEATED = ("added_ttft_p50_ms", "added_ttft_p99_ms", "router_cpu_s_per_1k_tokens")


def median_row(runs: list[dict]) -> dict:
    """One row for a point measured `len(runs)` times: the run whose CPU per token is the
    median (its other fields as measured), with each judged number the median over the runs,
    and every run's judged numbers kept under `runs`."""
    if len(runs) == 1:
        return runs[0]
    ordered = sorted(runs, key=lambda r: r["router_cpu_s_per_1k_tokens"])
    row = dict(ordered[len(ordered) // 2])
    for key in REPEATED:
        row[key] = statistics.median(r[key] for r in runs)
    row["runs"] = [{key: r[key] for key in (*REPEATED, "tokens_per_s", "cpu_busy")} for r in runs]
    return row


def _row(
    workers: int,
    streams: int,
    routers: int,
    direct: dict,
    routed: dict,
    cpu: float,
    busy_before: tuple[float, float],
    busy_after: tuple[float, float],
    bare: dict,
) -> dict:
    d50, d99 = percentile(direct["ttft_ms"], 50), percentile(direct["ttft_ms"], 99)
    r50, r99 = percentile(routed["ttft_ms"], 50), percentile(routed["ttft_ms"], 99)
    b50, b99 = percentile(bare["ttft_ms"], 50), percentile(bare["ttft_ms"], 99)
    tokens_per_s = routed["tokens"] / routed["seconds"] if routed["seconds"] else math.nan
    busy = (busy_after[0] - busy_before[0]) / max(1, busy_after[1] - busy_before[1])
    return {
        "workers": workers,
        "streams": streams,
        "routers": routers,
        "direct_ttft_p50_ms": d50,
        "direct_ttft_p99_ms": d99,
        "routed_ttft_p50_ms": r50,
        "routed_ttft_p99_ms": r99,
        "added_ttft_p50_ms": r50 - d50,
        "added_ttft_p99_ms": r99 - d99,
        "router_cpu_s": cpu,
        "router_cpu_s_per_1k_tokens": cpu / routed["tokens"] * 1000 if routed["tokens"] else math.nan,
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_router": tokens_per_s / routers,
        # Tokens per message the clients received: what the per-token CPU is amortised over.
        "tokens_per_message": routed["tokens"] / routed["messages"] if routed["messages"] else math.nan,
        "relay_tokens_per_message": bare["tokens"] / bare["messages"] if bare["messages"] else math.nan,
        "direct_tokens_per_s": direct["tokens"] / direct["seconds"] if direct["seconds"] else math.nan,
        # The bare relay (bench.bare_relay: one Python gRPC hop, none of Ballast's work) on the
        # same workers and load: the floor under the router's added latency and CPU.
        "relay_ttft_p50_ms": b50,
        "relay_ttft_p99_ms": b99,
        "relay_added_ttft_p50_ms": b50 - d50,
        "relay_added_ttft_p99_ms": b99 - d99,
        "relay_tokens_per_s": bare["tokens"] / bare["seconds"] if bare["seconds"] else math.nan,
        "relay_cpu_s_per_1k_tokens": bare["cpu_s"] / bare["tokens"] * 1000 if bare["tokens"] else math.nan,
        "errors": routed["errors"],
        "direct_errors": direct["errors"],
        "relay_errors": bare["errors"],
        "error_codes": routed["error_codes"],
        "samples": len(routed["ttft_ms"]),
        "direct_samples": len(direct["ttft_ms"]),
        "cpu_busy": busy,
    }


def _pick(rows: list[dict], **match) -> list[dict]:
    return [r for r in rows if all(r[k] == v for k, v in match.items())]


def _report(
    rows: list[dict], membership: dict[int, float], seconds: float, out: Path, tokens: int, processes: dict
) -> int:
    print_table(
        [
            "workers",
            "streams",
            "routers",
            "added p50 ms",
            "added p99 ms",
            "bare p50 ms",
            "bare p99 ms",
            "CPU s/1k tok",
            "tok/msg",
            "from workers",
            "bare CPU",
            "tok/s",
            "bare tok/s",
            "tok/s/router",
            "busy",
            "errors",
        ],
        [
            [
                r["workers"],
                r["streams"],
                r["routers"],
                r["added_ttft_p50_ms"],
                r["added_ttft_p99_ms"],
                r["relay_added_ttft_p50_ms"],
                r["relay_added_ttft_p99_ms"],
                r["router_cpu_s_per_1k_tokens"],
                r["tokens_per_message"],
                r.get("worker_tokens_per_message", math.nan),
                r["relay_cpu_s_per_1k_tokens"],
                r["tokens_per_s"],
                r["relay_tokens_per_s"],
                r["tokens_per_s_per_router"],
                f"{r['cpu_busy']:.0%}",
                r["errors"],
            ]
            for r in rows
        ],
    )
    print("bare: the same load through a bare Python gRPC relay (bench.bare_relay), the floor under any relay")
    print(
        "membership change reaching every router: "
        + ", ".join(f"{w} workers {s * 1000:.0f} ms" for w, s in membership.items())
    )
    small = [r for r in rows if r["streams"] <= 100 and r["routers"] == 1]
    mid = max((s for s in {r["streams"] for r in rows} if s <= 100), default=None)
    per_token = {
        r["workers"]: r["router_cpu_s_per_1k_tokens"] for r in rows if r["streams"] == mid and r["routers"] == 1
    }
    spread_points = [v for w, v in per_token.items() if w >= 4]
    top_w, top_s = max(r["workers"] for r in rows), max(r["streams"] for r in rows)
    one = _pick(rows, workers=top_w, streams=top_s, routers=1)
    two = _pick(rows, workers=top_w, streams=top_s, routers=2)
    measured = {
        "added_ttft_p50_ms_upto_100": max((r["added_ttft_p50_ms"] for r in small), default=math.nan),
        "added_ttft_p99_ms_upto_100": max((r["added_ttft_p99_ms"] for r in small), default=math.nan),
        "cpu_per_token_spread": (max(spread_points) / min(spread_points) - 1) if len(spread_points) > 1 else math.nan,
        "two_router_scaling": (two[0]["tokens_per_s"] / one[0]["tokens_per_s"]) if one and two else math.nan,
        "cpu_ms_per_token_100": _worst_cpu_per_token(rows, 100),
        "cpu_ms_per_token_10": _worst_cpu_per_token(rows, 10),
        "process_cpu_per_token_ratio": (
            max(processes["process_cpu_ms_per_token"]) / processes["single_cpu_ms_per_token"]
            if processes["process_cpu_ms_per_token"]
            else math.nan
        ),
        "processes_serving": sum(1 for share in processes["process_token_shares"] if share > 0),
    }
    # Context for the goals, not goals: what one bare Python gRPC hop costs on this machine.
    floor = {
        "relay_added_ttft_p50_ms_upto_100": max((r["relay_added_ttft_p50_ms"] for r in small), default=math.nan),
        "relay_added_ttft_p99_ms_upto_100": max((r["relay_added_ttft_p99_ms"] for r in small), default=math.nan),
        "relay_peak_tokens_per_s": max(
            (r["relay_tokens_per_s"] for r in _pick(rows, workers=top_w, routers=1)), default=math.nan
        ),
    }
    one_router = sorted(_pick(rows, workers=top_w, routers=1), key=lambda r: r["streams"])
    saturation = max(one_router, key=lambda r: r["tokens_per_s"]) if one_router else None
    result = {
        "rows": rows,
        "membership_change_s": {str(k): v for k, v in membership.items()},
        "seconds": seconds,
        "processes": processes,
        "stream_interval_ms": STREAM_INTERVAL_MS,
        "engine": "sim",
        "tokens_per_stream": tokens,
        **measured,
        **floor,
        "one_router_peak": saturation,
        **judge(GOALS, measured),
    }
    # Not mesh_scale.png: bench.report draws that one (the goals).
    _plot(rows, out.with_name(out.stem + "_cost.png"))
    print(
        f"bare relay, up to 100 streams: added TTFT p50 {floor['relay_added_ttft_p50_ms_upto_100']:.2f} ms, "
        f"p99 {floor['relay_added_ttft_p99_ms_upto_100']:.2f} ms; its peak {floor['relay_peak_tokens_per_s']:.0f} tok/s"
    )
    print_goals(result)
    print(f"wrote {write_result(out, result)}")
    return 0 if result["met"] else 1


def _worst_cpu_per_token(rows: list[dict], streams: int) -> float:
    """One router's CPU ms per relayed token at `streams` streams, at its most costly worker count."""
    values = [r["router_cpu_s_per_1k_tokens"] for r in rows if r["streams"] == streams and r["routers"] == 1]
    return max(values) if values else math.nan


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cost, rate) = plt.subplots(1, 2, figsize=(11, 4))
    for workers in sorted({r["workers"] for r in rows}):
        line = sorted(_pick(rows, workers=workers, routers=1), key=lambda r: r["streams"])
        cost.plot(
            [r["streams"] for r in line],
            [r["router_cpu_s_per_1k_tokens"] for r in line],
            marker="o",
            label=f"{workers} workers",
        )
    for routers in sorted({r["routers"] for r in rows}):
        top = max(r["workers"] for r in rows)
        line = sorted(_pick(rows, workers=top, routers=routers), key=lambda r: r["streams"])
        rate.plot(
            [r["streams"] for r in line], [r["tokens_per_s"] for r in line], marker="o", label=f"{routers} routers"
        )
    for axis, title, label in (
        (cost, "router CPU per 1000 relayed tokens (1 router)", "CPU s / 1k tokens"),
        (rate, "relayed tokens/s (most workers)", "tokens/s"),
    ):
        axis.set_xscale("log")
        axis.set_xlabel("concurrent streams")
        axis.set_ylabel(label)
        axis.set_title(title, fontsize=10)
        axis.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="load per point")
    parser.add_argument("--workers", type=_ints, default=[1, 4, 16, 64])
    parser.add_argument("--streams", type=_ints, default=[10, 100, 1000])
    parser.add_argument("--routers", type=_ints, default=[1, 2, 4])
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="loads per one-router point up to 100 streams (the goals' points); each judged number is the median",
    )
    parser.add_argument("--tokens", type=int, default=TOKENS, help="tokens per stream")
    parser.add_argument("--out", type=Path, default=Path("bench/results/mesh_scale.json"))
    args = parser.parse_args(argv)
    stop_on_sigterm()
    return run_benchmark(
        args.seconds,
        sorted(args.workers),
        sorted(args.streams),
        sorted(args.routers),
        args.out,
        max(1, args.repeats),
        args.tokens,
    )


if __name__ == "__main__":
    sys.exit(main())
