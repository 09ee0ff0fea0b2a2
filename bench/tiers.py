"""S-tier latency under a B-tier flood: tiered scheduling against plain FIFO, in one run.

Two workers on the bench model. First the pool's B capacity is measured in the same run:
closed-loop B clients, one per slot, for a few seconds give the B requests per second the
pool completes when full. Phase 1 measures S alone (the unloaded reference). Then, for each
router mode (tiered, fifo), a steady S stream at about 10 % of capacity runs beside an
open-loop B flood: B requests arrive at three times the measured capacity (Poisson arrivals,
each a new request whether or not earlier ones were answered), for a bounded time. The
flood's requests do not accept degraded answers: a refused B request gets RESOURCE_EXHAUSTED
and is counted as refused (an open-loop arrival is not retried). B completions, refusals,
failures and B p99 TTFT are reported beside S. An S answer from the degradation ladder is
counted apart: it is an answer, not the model's. The flood runs in a process of its own, as
a promotion's traffic comes from other clients than a payment's: the S client's measured
latency is then the mesh's, not the flood's client work on the same event loop.

`--engine sim` runs the same phases on simulated workers (bench.common.SIM_PROFILE, an 8B
model on an H100-class GPU: waiting is sleeping, so the two cores are left to the mesh and
the clients) with more slots, and S
requests arriving open loop too (Poisson, `S_RATE_SIM` per second: at least 1000 S samples
per phase of 25 s); its result goes to bench/results/tiers_sim.json, beside the torch run's.

Beside the client's S latency, the router's own: its S-tier histograms (TTFT from its
handler starting, and the wait for a worker slot), read before and after each phase, give
the bucket bound holding their p99; what the client sees beyond them passed outside the
router's handler.

Goals, judged in code: S p99 under the flood at most 1.3 x unloaded; FIFO's S p99 at least
5 x tiered's; no S errors. Prints a table, writes bench/results/tiers.json (tiers_sim.json),
exits 1 when a goal is missed.

    python -m bench.tiers [--seconds 20] [--reps 3] [--preset bench] [--engine torch|sim]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from bench.common import model_dir_for, percentile, print_table, sim_worker_settings, stop_on_sigterm, write_result
from bench.goals import HIGHER, LOWER, Goal, judge, print_goals
from ballast.v1 import inference_pb2_grpc
from services.cli.client import chat_request, open_channel
from services.cli.mesh import LOCAL_API_KEY, Mesh, MeshSpec

CAPACITY_PER_WORKER = 4
WORKERS = 2
FLOOD_FACTOR = 3.0  # B arrivals per second over the measured B capacity
MAX_B_IN_FLIGHT = 200
CAPACITY_SECONDS = 8.0
# The simulated engine: more slots per worker (a GPU's batch), more B in flight, and S
# arriving open loop at this rate (each a new request, answered or not).
CAPACITY_PER_WORKER_SIM = 16
MAX_B_IN_FLIGHT_SIM = 1000
S_RATE_SIM = 50.0
GOALS = (
    Goal("S p99 TTFT under the B flood over unloaded", "loaded_vs_unloaded", 1.3, LOWER, "x"),
    Goal("FIFO's S p99 TTFT over tiered's, same flood", "fifo_vs_tiered", 5.0, HIGHER, "x"),
    Goal("S requests failed under the flood", "s_errors", 0, LOWER),
)
METADATA = (("x-api-key", LOCAL_API_KEY),)


async def _ttft(stub, request, timeout: float) -> tuple[float, bool]:
    """Time to the first token (ms), and whether the answer came from the degradation ladder."""
    start = time.perf_counter()
    first = None
    degraded = False
    async for event in stub.Generate(request, metadata=METADATA, timeout=timeout):
        if first is None and event.HasField("tokens"):
            first = time.perf_counter()
        if event.HasField("finished"):
            degraded = bool(event.finished.degradation)
    return ((first or time.perf_counter()) - start) * 1000, degraded


async def _s_request(stub, i: int, out: dict) -> None:
    request = chat_request(f"Confirm payment {i} for order {4000 + i}.", max_tokens=16, raw_prompt=True, tier="S")
    try:
        ttft, degraded = await _ttft(stub, request, timeout=30)
        if degraded:
            out["s_degraded"] += 1
        else:
            out["s_ttft"].append(ttft)
    except grpc.aio.AioRpcError as exc:
        out["s_errors"] += 1
        out["s_error_codes"].append(exc.code().name)


async def _s_open_loop(stub, seconds: float, rate: float, out: dict) -> None:
    """S requests arriving at `rate` per second (Poisson), whether or not earlier ones were answered."""
    rng = random.Random(20261202)
    pending: set[asyncio.Task] = set()
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        await asyncio.sleep(rng.expovariate(rate))
        i += 1
        task = asyncio.create_task(_s_request(stub, i, out))
        pending.add(task)
        task.add_done_callback(pending.discard)
    if pending:
        await asyncio.wait(pending, timeout=60)


async def _s_stream(stub, seconds: float, interval: float, out: dict) -> None:
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        i += 1
        await _s_request(stub, i, out)
        await asyncio.sleep(interval)


async def _b_request(stub, name: str, out: dict) -> None:
    request = chat_request(
        f"Summarise the archive of customer {name}.", max_tokens=96, raw_prompt=True, tier="B", allow_degraded=False
    )
    try:
        ttft, _ = await _ttft(stub, request, timeout=60)
        out["b_ttft"].append(ttft)
        out["b_done"] += 1
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            out["b_refused"] += 1
        else:
            out["b_errors"] += 1


def _new_out() -> dict:
    return {
        "s_ttft": [],
        "s_errors": 0,
        "s_error_codes": [],
        "s_degraded": 0,
        "b_ttft": [],
        "b_done": 0,
        "b_refused": 0,
        "b_errors": 0,
        "b_offered": 0,
        "b_shed_by_client": 0,
    }


async def _b_capacity(address: str, seconds: float, slots: int) -> float:
    """B requests per second the pool completes with every slot busy (closed loop)."""
    out = _new_out()
    end = time.monotonic() + seconds

    async def client(k: int) -> None:
        i = 0
        while time.monotonic() < end:
            i += 1
            await _b_request(stub, f"capacity-{k}-{i}", out)

    async with open_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        started = time.monotonic()
        await asyncio.gather(*(client(k) for k in range(slots)))
        return out["b_done"] / (time.monotonic() - started)


async def _flood(address: str, seconds: float, rate: float, started, max_in_flight: int = MAX_B_IN_FLIGHT) -> dict:
    """Open-loop B arrivals at `rate` per second for `seconds`; waits for the answers."""
    out = _new_out()
    rng = random.Random(20261201)
    pending: set[asyncio.Task] = set()
    async with open_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        started.set()
        end = time.monotonic() + seconds
        i = 0
        while time.monotonic() < end:
            await asyncio.sleep(rng.expovariate(rate))
            i += 1
            out["b_offered"] += 1
            if len(pending) >= max_in_flight:
                out["b_shed_by_client"] += 1  # bounded, so the load stays on loopback and in memory
                continue
            task = asyncio.create_task(_b_request(stub, f"flood-{i}", out))
            pending.add(task)
            task.add_done_callback(pending.discard)
        if pending:
            await asyncio.wait(pending, timeout=120)
    return out


def _flood_process(address: str, seconds: float, rate: float, started, results, max_in_flight: int) -> None:
    results.put(asyncio.run(_flood(address, seconds, rate, started, max_in_flight)))


@dataclass(frozen=True)
class Setup:
    """What differs between the engines: slots per worker, B in flight, how S arrives."""

    engine: str
    capacity_per_worker: int
    max_b_in_flight: int
    s_rate: float | None  # None: one S client, a request every 0.25 s after the last answer


TORCH = Setup("torch", CAPACITY_PER_WORKER, MAX_B_IN_FLIGHT, None)
SIM = Setup("sim", CAPACITY_PER_WORKER_SIM, MAX_B_IN_FLIGHT_SIM, S_RATE_SIM)


async def _phase(address: str, seconds: float, flood_rate: float = 0.0, setup: Setup = TORCH) -> dict:
    process = None
    if flood_rate:
        context = multiprocessing.get_context("spawn")
        started, results = context.Event(), context.Queue()
        process = context.Process(
            target=_flood_process,
            args=(address, seconds, flood_rate, started, results, setup.max_b_in_flight),
            daemon=True,
        )
        process.start()
        await asyncio.to_thread(started.wait, 60)
    out = _new_out()
    try:
        async with open_channel(address) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            if setup.s_rate is None:
                await _s_stream(stub, seconds, interval=0.25, out=out)
            else:
                await _s_open_loop(stub, seconds, setup.s_rate, out)
        if process is not None:
            flood_out = await asyncio.to_thread(results.get, True, seconds + 120)
            for key in ("b_ttft", "b_done", "b_refused", "b_errors", "b_offered", "b_shed_by_client"):
                out[key] = flood_out[key]
    finally:
        if process is not None:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    return out


def _router_metrics(mesh: Mesh) -> str:
    import urllib.request

    router = next(s for s in mesh.services if s.name == "router")
    return urllib.request.urlopen(f"http://127.0.0.1:{router.metrics_port}/metrics", timeout=5).read().decode()


def _preemptions(text: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("ballast_router_preemptions_total")
    )


ROUTER_TTFT = "ballast_router_ttft_milliseconds"  # its handler starting to the first token it sends
ROUTER_QUEUE_WAIT = "ballast_router_queue_wait_milliseconds"  # admission to a worker slot


def s_tier_buckets(text: str, histogram: str = ROUTER_TTFT) -> dict[float, float]:
    """One of the router's histograms for tier S: cumulative counts by bucket upper bound, ms."""
    buckets: dict[float, float] = {}
    for line in text.splitlines():
        if line.startswith(histogram + "_bucket{") and 'tier="S"' in line:
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            buckets[math.inf if bound == "+Inf" else float(bound)] = float(line.rsplit(" ", 1)[1])
    return buckets


def bucket_percentile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """The upper bound of the bucket holding the q-th percentile of what was counted between
    two scrapes of a cumulative histogram (nan when nothing was)."""
    counts = sorted((bound, after[bound] - before.get(bound, 0.0)) for bound in after)
    total = counts[-1][1] if counts else 0.0
    if total <= 0:
        return math.nan
    return next(bound for bound, count in counts if count >= total * q / 100)


def _run_mode(
    mode: str,
    model_dir: Path,
    seconds: float,
    with_unloaded: bool,
    reps: int,
    flood_rate: float | None = None,
    setup: Setup = TORCH,
) -> dict:
    """One mesh in `mode`, `reps` repetitions of its phases; measures the B capacity first
    when `flood_rate` is not given."""
    with tempfile.TemporaryDirectory(prefix=f"ballast-tiers-{mode}-") as state:
        spec = MeshSpec(
            state_dir=Path(state),
            model_dir=model_dir,
            workers=WORKERS,
            worker_capacity=setup.capacity_per_worker,
            engine=setup.engine,
            overrides={
                "router": {"scheduling": {"mode": mode}},
                "worker": {"model_name": "tiny", **(sim_worker_settings() if setup.engine == "sim" else {})},
            },
        )
        mesh = Mesh(spec).start()
        try:
            result = {}
            # Warm-up, not measured: the first requests load the tokenizer into the router and
            # open connections, which neither reference nor load should be charged for.
            asyncio.run(_phase(mesh.router_address, 2.0, setup=setup))
            if flood_rate is None:
                result["b_capacity_per_s"] = asyncio.run(
                    _b_capacity(mesh.router_address, CAPACITY_SECONDS, setup.capacity_per_worker * WORKERS)
                )
                flood_rate = FLOOD_FACTOR * result["b_capacity_per_s"]
            result["flood_rate_per_s"] = flood_rate
            result["runs"] = []
            for _ in range(reps):
                run = {}
                if with_unloaded:
                    before = _router_metrics(mesh)
                    run["unloaded"] = asyncio.run(_phase(mesh.router_address, seconds, setup=setup))
                    run["unloaded"]["router_s_ttft"] = (s_tier_buckets(before), s_tier_buckets(_router_metrics(mesh)))
                before = _router_metrics(mesh)
                run["loaded"] = asyncio.run(_phase(mesh.router_address, seconds, flood_rate, setup))
                after = _router_metrics(mesh)
                run["loaded"]["router_s_ttft"] = (s_tier_buckets(before), s_tier_buckets(after))
                run["loaded"]["router_s_queue_wait"] = (
                    s_tier_buckets(before, ROUTER_QUEUE_WAIT),
                    s_tier_buckets(after, ROUTER_QUEUE_WAIT),
                )
                run["preemptions"] = _preemptions(after) - _preemptions(before)
                result["runs"].append(run)
            return result
        finally:
            mesh.stop()


def _summary(tiered_run: dict, fifo_run: dict, seconds: float) -> dict:
    """One repetition: S alone, S beside the flood (tiered), S beside the same flood (FIFO)."""
    unloaded, loaded, baseline = tiered_run["unloaded"], tiered_run["loaded"], fifo_run["loaded"]
    s_unloaded = percentile(unloaded["s_ttft"], 99)
    s_loaded = percentile(loaded["s_ttft"], 99)
    s_fifo = percentile(baseline["s_ttft"], 99)
    return {
        "s_p99_unloaded_ms": s_unloaded,
        "s_p99_loaded_ms": s_loaded,
        "s_p99_fifo_ms": s_fifo,
        "s_p50_loaded_ms": percentile(loaded["s_ttft"], 50),
        # With about 150 S requests per minute of phase, p99 is one of the slowest two; p95
        # moves less from run to run.
        "s_p95_unloaded_ms": percentile(unloaded["s_ttft"], 95),
        "s_p95_loaded_ms": percentile(loaded["s_ttft"], 95),
        "s_samples_unloaded": len(unloaded["s_ttft"]),
        "s_samples_loaded": len(loaded["s_ttft"]),
        "s_errors": loaded["s_errors"],
        "s_errors_fifo": baseline["s_errors"],
        "s_degraded": loaded["s_degraded"],
        "s_degraded_fifo": baseline["s_degraded"],
        "b_p99_loaded_ms": percentile(loaded["b_ttft"], 99),
        "b_p99_fifo_ms": percentile(baseline["b_ttft"], 99),
        "b_offered": loaded["b_offered"],
        "b_completed": loaded["b_done"],
        "b_refused": loaded["b_refused"],
        "b_failed": loaded["b_errors"],
        "b_shed_by_client": loaded["b_shed_by_client"],
        "b_offered_fifo": baseline["b_offered"],
        "b_completed_fifo": baseline["b_done"],
        "b_refused_fifo": baseline["b_refused"],
        "b_failed_fifo": baseline["b_errors"],
        "preemptions": tiered_run["preemptions"],
        # The router's own measure of the same S requests, from its handler starting to the
        # first token leaving it (the upper bound of the histogram bucket holding the p99):
        # what the client sees beyond it passed outside the router's handler (the client,
        # the kernel, gRPC's accept, the run queue of the cores).
        "s_router_p99_bound_unloaded_ms": bucket_percentile(*unloaded["router_s_ttft"], 99),
        "s_router_p99_bound_loaded_ms": bucket_percentile(*loaded["router_s_ttft"], 99),
        # Of which waiting for a worker slot (preemption hands S a B stream's slot).
        "s_queue_wait_p99_bound_loaded_ms": bucket_percentile(*loaded["router_s_queue_wait"], 99),
        "loaded_vs_unloaded": s_loaded / s_unloaded if s_unloaded else math.nan,
        "fifo_vs_tiered": s_fifo / s_loaded if s_loaded else math.nan,
    }


def run_benchmark(
    seconds: float = 20.0,
    preset: str = "bench",
    out: Path = Path("bench/results/tiers.json"),
    reps: int = 3,
    engine: str = "torch",
) -> int:
    model_dir = model_dir_for(preset)
    setup = SIM if engine == "sim" else TORCH
    tiered = _run_mode("tiered", model_dir, seconds, with_unloaded=True, reps=reps, setup=setup)
    # FIFO gets the same offered load: the capacity is the hardware's, not the mode's.
    fifo = _run_mode(
        "fifo", model_dir, seconds, with_unloaded=False, reps=reps, flood_rate=tiered["flood_rate_per_s"], setup=setup
    )
    runs = [_summary(t, f, seconds) for t, f in zip(tiered["runs"], fifo["runs"])]
    print(
        f"\nS-tier TTFT under a B flood ({reps} x {seconds:.0f}s per phase, {WORKERS} {engine} workers x "
        f"{setup.capacity_per_worker} slots, {preset} model)"
    )
    print(
        f"B capacity {tiered['b_capacity_per_s']:.1f} requests/s; open-loop flood "
        f"{tiered['flood_rate_per_s']:.1f} requests/s"
    )
    rows = []
    for i, (t, f) in enumerate(zip(tiered["runs"], fifo["runs"])):
        for name, data, pre in (
            ("S unloaded", t["unloaded"], 0),
            ("tiered + flood", t["loaded"], t["preemptions"]),
            ("fifo + flood", f["loaded"], f["preemptions"]),
        ):
            rows.append(
                [
                    i + 1,
                    name,
                    percentile(data["s_ttft"], 50),
                    percentile(data["s_ttft"], 99),
                    len(data["s_ttft"]),
                    data["s_errors"],
                    data["s_degraded"],
                    percentile(data["b_ttft"], 99),
                    data["b_offered"],
                    data["b_done"],
                    data["b_refused"],
                    data["b_errors"],
                    pre,
                ]
            )
    print_table(
        [
            "run",
            "phase",
            "S p50 ms",
            "S p99 ms",
            "S done",
            "S errors",
            "S degraded",
            "B p99 ms",
            "B offered",
            "B done",
            "B refused",
            "B failed",
            "preemptions",
        ],
        rows,
    )
    for i, r in enumerate(runs):
        print(
            f"run {i + 1}: the router's own S p99 (its handler to the first token, histogram bucket bound): "
            f"unloaded <= {r['s_router_p99_bound_unloaded_ms']:g} ms, under the flood <= "
            f"{r['s_router_p99_bound_loaded_ms']:g} ms (waiting for a slot <= {r['s_queue_wait_p99_bound_loaded_ms']:g} ms); "
            f"the client saw {r['s_p99_unloaded_ms']:.1f} and {r['s_p99_loaded_ms']:.1f} ms"
        )
    # The run whose loaded/unloaded ratio is the median stands for the headline numbers.
    result = dict(sorted(runs, key=lambda r: r["loaded_vs_unloaded"])[len(runs) // 2])
    measured = {
        "loaded_vs_unloaded": [r["loaded_vs_unloaded"] for r in runs],
        "fifo_vs_tiered": [r["fifo_vs_tiered"] for r in runs],
        "s_errors": sum(r["s_errors"] for r in runs),
    }
    result.update(
        {
            "runs": runs,
            "reps": reps,
            "seconds": seconds,
            "preset": preset,
            "engine": engine,
            "s_arrivals": "closed loop, 0.25 s apart" if setup.s_rate is None else f"open loop, {setup.s_rate:g}/s",
            "b_capacity_per_s": tiered["b_capacity_per_s"],
            "flood_rate_per_s": tiered["flood_rate_per_s"],
            **judge(GOALS, measured),
        }
    )
    print_goals(result)
    print(f"wrote {write_result(out, result)}")
    return 0 if result["met"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=None, help="length of each phase (torch 20, sim 25)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions; ratios are judged on the median")
    parser.add_argument("--preset", choices=["tiny", "bench"], default="bench")
    parser.add_argument("--engine", choices=("torch", "sim"), default="torch")
    parser.add_argument("--out", type=Path, default=None, help="default bench/results/tiers.json (sim: tiers_sim.json)")
    args = parser.parse_args(argv)
    stop_on_sigterm()
    sim = args.engine == "sim"
    seconds = args.seconds or (25.0 if sim else 20.0)
    out = args.out or Path("bench/results/tiers_sim.json" if sim else "bench/results/tiers.json")
    return run_benchmark(seconds, args.preset, out, args.reps, args.engine)


if __name__ == "__main__":
    sys.exit(main())
