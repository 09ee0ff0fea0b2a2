"""S-tier latency under a B-tier flood: tiered scheduling against plain FIFO, in one run.

Two workers on the bench model. Phase 1 measures S alone (the unloaded reference). Then,
for each router mode (tiered, fifo), a steady S stream at about 10 % of capacity runs
beside a B flood of three times the pool's capacity, for a bounded time. The flood's
requests do not accept degraded answers: a refused B request gets RESOURCE_EXHAUSTED and
backs off by the router's retry hint. (Accepting them, each refusal would come back at once
as a rule-engine answer and its client would ask again at once: a flood as large as the
client's CPU allows, not three times capacity.) An S answer from the degradation ladder is
counted apart: it is an answer, not the model's. The flood's clients run in a process of their
own, as a promotion's traffic comes from other clients than a payment's: the S client's
measured latency is then the mesh's, not the flood's client work on the same event loop.
Prints a table and writes bench/results/tiers.json.

    python -m bench.tiers [--seconds 60] [--preset bench]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path

import grpc

from bench.common import model_dir_for, percentile, print_table, stop_on_sigterm, write_result
from ballast.v1 import inference_pb2_grpc
from services.cli.client import chat_request, open_channel
from services.cli.mesh import LOCAL_API_KEY, Mesh, MeshSpec

CAPACITY_PER_WORKER = 4
WORKERS = 2
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


async def _s_stream(stub, seconds: float, interval: float, out: dict) -> None:
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        i += 1
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
        await asyncio.sleep(interval)


async def _b_client(stub, seconds: float, k: int, out: dict) -> None:
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        i += 1
        request = chat_request(f"Summarise the archive of customer {k}-{i}.", max_tokens=96, raw_prompt=True, tier="B",
                               allow_degraded=False)
        try:
            ttft, _ = await _ttft(stub, request, timeout=60)
            out["b_ttft"].append(ttft)
            out["b_done"] += 1
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                out["b_refused"] += 1
                hint = dict(exc.trailing_metadata() or ()).get("retry-after-ms", "200")
                await asyncio.sleep(min(2.0, int(hint) / 1000))
            else:
                out["b_errors"] += 1


def _new_out() -> dict:
    return {"s_ttft": [], "s_errors": 0, "s_error_codes": [], "s_degraded": 0,
            "b_ttft": [], "b_done": 0, "b_refused": 0, "b_errors": 0}


async def _flood(address: str, seconds: float, started) -> dict:
    out = _new_out()
    async with open_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        started.set()
        await asyncio.gather(*(_b_client(stub, seconds, k, out)
                               for k in range(3 * CAPACITY_PER_WORKER * WORKERS)))
    return out


def _flood_process(address: str, seconds: float, started, results) -> None:
    results.put(asyncio.run(_flood(address, seconds, started)))


async def _phase(address: str, seconds: float, flood: bool) -> dict:
    process = None
    if flood:
        context = multiprocessing.get_context("spawn")
        started, results = context.Event(), context.Queue()
        process = context.Process(target=_flood_process, args=(address, seconds, started, results), daemon=True)
        process.start()
        await asyncio.to_thread(started.wait, 60)
    out = _new_out()
    try:
        async with open_channel(address) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            await _s_stream(stub, seconds, interval=0.25, out=out)
        if process is not None:
            flood_out = await asyncio.to_thread(results.get, True, seconds + 120)
            for key in ("b_ttft", "b_done", "b_refused", "b_errors"):
                out[key] = flood_out[key]
    finally:
        if process is not None:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    return out


def _preemptions(mesh: Mesh) -> float:
    import urllib.request

    router = next(s for s in mesh.services if s.name == "router")
    text = urllib.request.urlopen(f"http://127.0.0.1:{router.metrics_port}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("ballast_router_preemptions_total"))


def _run_mode(mode: str, model_dir: Path, seconds: float, with_unloaded: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"ballast-tiers-{mode}-") as state:
        spec = MeshSpec(state_dir=Path(state), model_dir=model_dir, workers=WORKERS,
                        worker_capacity=CAPACITY_PER_WORKER,
                        overrides={"router": {"scheduling": {"mode": mode}}, "worker": {"model_name": "tiny"}})
        mesh = Mesh(spec).start()
        try:
            result = {}
            # Warm-up, not measured: the first requests load the tokenizer into the router and
            # open connections, which neither reference nor load should be charged for.
            asyncio.run(_phase(mesh.router_address, 2.0, flood=False))
            if with_unloaded:
                result["unloaded"] = asyncio.run(_phase(mesh.router_address, seconds, flood=False))
            result["loaded"] = asyncio.run(_phase(mesh.router_address, seconds, flood=True))
            result["preemptions"] = _preemptions(mesh)
            return result
        finally:
            mesh.stop()


def run_benchmark(seconds: float = 60.0, preset: str = "bench", out: Path = Path("bench/results/tiers.json")) -> int:
    model_dir = model_dir_for(preset)
    tiered = _run_mode("tiered", model_dir, seconds, with_unloaded=True)
    fifo = _run_mode("fifo", model_dir, seconds, with_unloaded=False)
    unloaded, loaded, baseline = tiered["unloaded"], tiered["loaded"], fifo["loaded"]
    rows = []
    for name, data, pre in (("S unloaded", unloaded, 0), ("tiered + flood", loaded, tiered["preemptions"]),
                            ("fifo + flood", baseline, fifo["preemptions"])):
        rows.append([name, percentile(data["s_ttft"], 50), percentile(data["s_ttft"], 99), len(data["s_ttft"]),
                     data["s_errors"], data["s_degraded"], percentile(data["b_ttft"], 50),
                     percentile(data["b_ttft"], 99), data["b_done"], data["b_refused"], pre])
    print(f"\nS-tier TTFT under a B flood ({seconds:.0f}s per phase, {WORKERS} workers x {CAPACITY_PER_WORKER} slots, {preset} model)")
    print_table(["phase", "S p50 ms", "S p99 ms", "S done", "S errors", "S degraded", "B p50 ms", "B p99 ms",
                 "B done", "B refused", "preemptions"], rows)
    s_unloaded = percentile(unloaded["s_ttft"], 99)
    s_loaded = percentile(loaded["s_ttft"], 99)
    s_fifo = percentile(baseline["s_ttft"], 99)
    result = {
        "s_p99_unloaded_ms": s_unloaded,
        "s_p99_loaded_ms": s_loaded,
        "s_p99_fifo_ms": s_fifo,
        "s_p50_loaded_ms": percentile(loaded["s_ttft"], 50),
        # With about 150 S requests per phase, p99 is the second-slowest one; p95 moves less
        # from run to run.
        "s_p95_unloaded_ms": percentile(unloaded["s_ttft"], 95),
        "s_p95_loaded_ms": percentile(loaded["s_ttft"], 95),
        "s_samples_unloaded": len(unloaded["s_ttft"]), "s_samples_loaded": len(loaded["s_ttft"]),
        "s_errors": loaded["s_errors"],
        "s_errors_fifo": baseline["s_errors"],
        "s_degraded": loaded["s_degraded"], "s_degraded_fifo": baseline["s_degraded"],
        "b_p99_loaded_ms": percentile(loaded["b_ttft"], 99),
        "b_completed": loaded["b_done"], "b_refused": loaded["b_refused"],
        "b_completed_fifo": baseline["b_done"], "b_refused_fifo": baseline["b_refused"],
        "preemptions": tiered["preemptions"],
        "loaded_vs_unloaded": s_loaded / s_unloaded if s_unloaded else None,
        "fifo_vs_tiered": s_fifo / s_loaded if s_loaded else None,
        "seconds": seconds, "preset": preset,
        "goal": {"loaded_vs_unloaded_max": 1.3, "fifo_vs_tiered_min": 5.0, "s_errors": 0},
    }
    print(f"S p99 loaded / unloaded: {result['loaded_vs_unloaded']:.2f}   FIFO / tiered: {result['fifo_vs_tiered']:.1f}x")
    print(f"wrote {write_result(out, result)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--preset", choices=["tiny", "bench"], default="bench")
    parser.add_argument("--out", type=Path, default=Path("bench/results/tiers.json"))
    args = parser.parse_args(argv)
    stop_on_sigterm()
    return run_benchmark(args.seconds, args.preset, args.out)


if __name__ == "__main__":
    sys.exit(main())
