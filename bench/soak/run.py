"""The soak's run: the plan both phases share, each phase driven on its own parts (traffic,
faults, the breach and its scale-out, CPU), the plain baseline and then Ballast, and the
result: the table, bench/results/soak.json, every request and the chart.

    python -m bench.soak [--engine vllm|torch|sim] [--minutes 10] [--workers 2] [--rate 0.4]
                         [--target-ms 1500] [--unloaded-s 30] [--seed 7]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Awaitable, Callable

from bench.common import SIM_PROFILE, model_dir_for, percentile, print_table, stop_on_sigterm, write_result
from bench.goals import judge, print_goals
from bench.soak.cpu import CpuMeter
from bench.soak.faults import (
    SURGE, WORKER_FAULTS, FaultTarget, ScheduledFault, adopt_orphans, end_leftovers, fault_schedule, settled_at,
    surge_window,
)
from bench.soak.table import (
    ABSOLUTE_GOALS, FaultRecord, RequestSample, comparison_goals, fault_rows, fault_table, measured_for_goals,
    phase_row, table_lines,
)
from bench.soak.traffic import NO_SURGE, ONLY_S, Conversation, SessionPlan, Surge, TurnPlan, plan_sessions

DESCRIPTION = "A chaos soak of Ballast against plain vLLM serving: the same traffic, the same faults."
MODEL_NAME = "tiny"  # the logical name both phases serve the model under
BREACH_WINDOW_S = 8.0
BREACH_MIN_SAMPLES = 10
BREACH_AT = 0.9  # of the target, as the autoscaler's own rule
SCALE_OUT_LIMIT_S = 420.0
DRAIN_LIMIT_S = 90.0
FRAGMENTATION_PERIOD_S = 2.0
CPU_PERIOD_S = 2.0
# Sessions per second when --rate is not given: about half of what each engine's workers
# serve on this kind of machine, so the 3x surge goes past capacity.
DEFAULT_RATE = {"vllm": 0.25, "torch": 0.25, "sim": 2.0}
DEFAULT_PRESET = {"vllm": "bench", "torch": "tiny", "sim": "tiny"}

SendTurn = Callable[[str, TurnPlan, list, Callable[[], float]], Awaitable[tuple[RequestSample, str]]]


@dataclass
class Plan:
    """What both phases share."""

    sessions: list[SessionPlan]
    unloaded: list[SessionPlan]
    unloaded_s: float
    duration_s: float
    surge: Surge
    seed: int
    target_ms: float


@dataclass
class PhaseOutcome:
    samples: list[RequestSample] = field(default_factory=list)
    unloaded: list[RequestSample] = field(default_factory=list)
    faults: list[FaultRecord] = field(default_factory=list)
    breach_at: float | None = None
    serving_at: float | None = None
    fragmentation: list[float] = field(default_factory=list)
    # CPU seconds by part over the soak's window, and the share of the machine's cores busy.
    cpu_s: dict[str, float] = field(default_factory=dict)
    busy_share: float = math.nan

    @property
    def scale_out_s(self) -> float | None:
        if self.breach_at is None or self.serving_at is None:
            return None
        return self.serving_at - self.breach_at


def rolling_ttft_p99(samples: list[RequestSample], now: float, window_s: float = BREACH_WINDOW_S) -> float | None:
    """The clients' p99 TTFT over the requests that ended in the last `window_s` (None when
    fewer than BREACH_MIN_SAMPLES did): what both autoscalers act on."""
    recent = [s.ttft * 1000.0 for s in samples if s.ttft is not None and now - window_s <= s.end <= now]
    return percentile(recent, 99) if len(recent) >= BREACH_MIN_SAMPLES else None


async def _run_session(plan: SessionPlan, send: SendTurn, clock, samples: list[RequestSample], ends_at: float) -> None:
    conversation = Conversation()
    for turn in plan.turns:
        if turn.think_s:
            await asyncio.sleep(turn.think_s)
        if clock() >= ends_at:
            return  # the soak is over: no new turn
        sample, answer = await send(plan.id, turn, conversation.messages_for(turn), clock)
        samples.append(sample)
        # A failed turn interrupts the session (counted), but the agent goes on with its next
        # turn: both phases then carry the same offered load, whatever failed in one of them.
        if sample.ok:
            conversation.record(turn, answer)


async def _open_loop(sessions: list[SessionPlan], send: SendTurn, clock, samples: list[RequestSample],
                     ends_at: float) -> None:
    """Starts each session at its planned offset, whatever the others are doing."""
    tasks = []
    for plan in sessions:
        delay = plan.start_s - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(_run_session(plan, send, clock, samples, ends_at)))
    await asyncio.gather(*tasks)


async def _closed_loop(sessions: list[SessionPlan], send: SendTurn, clock, samples: list[RequestSample],
                       ends_at: float, clients: int = 2) -> None:
    """Sessions one after another on each of `clients` clients: the unloaded measurement."""
    queue = list(sessions)

    async def client() -> None:
        while queue and clock() < ends_at:
            await _run_session(queue.pop(0), send, clock, samples, ends_at)

    await asyncio.gather(*(client() for _ in range(clients)))


async def _chaos(target: FaultTarget, schedule: list[ScheduledFault], clock, origin: float,
                 records: list[FaultRecord]) -> None:
    """Strikes each fault at its moment, whatever the earlier ones are still doing (a worker
    may take minutes to serve again): faults overlap as they would in production."""

    async def strike(fault: ScheduledFault) -> None:
        delay = fault.at_s - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        injected = clock()
        print(f"  [{injected:6.1f}s] {fault.kind}" + (f" for {fault.hold_s:g}s" if fault.hold_s else ""), flush=True)
        name, recovered = await asyncio.to_thread(target.apply, fault)
        records.append(FaultRecord(fault.kind, name, injected, None if recovered is None else recovered - origin,
                                   fault.hold_s))
        print(f"  [{clock():6.1f}s] {fault.kind} on {name}: "
              + ("served again" if recovered is not None else "NOT observed to serve again"), flush=True)

    await asyncio.gather(*(strike(fault) for fault in schedule))
    records.sort(key=lambda record: record.injected_at)


# A phase's scale-out: waits for the added capacity to serve; returns when (monotonic).
ScaleOut = Callable[[], Awaitable[float | None]]
# When (monotonic) the phase's own autoscaler decided to scale out, if it has one that
# decides by itself (Ballast's, on the p99 its router measures); None until it does.
Decided = Callable[[], float | None]


async def _watch_breach(samples: list[RequestSample], clock, origin: float, target_ms: float,
                        scale_out: ScaleOut, decided: Decided, outcome: PhaseOutcome, ends_at: float) -> None:
    """Waits for the breach: the clients' rolling p99 TTFT at 90 % of the target, or the
    phase's own autoscaler deciding first; then has the phase add capacity and notes when it
    serves."""
    while clock() < ends_at:
        await asyncio.sleep(0.25)
        p99 = rolling_ttft_p99(samples, clock())
        own = decided()
        if own is not None:
            outcome.breach_at = own - origin
            print(f"  [{clock():6.1f}s] the autoscaler decided to scale out at {outcome.breach_at:.1f}s", flush=True)
        elif p99 is not None and p99 >= BREACH_AT * target_ms:
            outcome.breach_at = clock()
            print(f"  [{outcome.breach_at:6.1f}s] p99 TTFT {p99:.0f} ms: breach, adding capacity", flush=True)
        else:
            continue
        serving = await scale_out()
        outcome.serving_at = None if serving is None else serving - origin
        if serving is not None:
            print(f"  [{outcome.serving_at:6.1f}s] added capacity serving", flush=True)
        return


async def _sample_fragmentation(measure: Callable[[], list[float]], outcome: PhaseOutcome, clock,
                                ends_at: float) -> None:
    while clock() < ends_at:
        outcome.fragmentation += await asyncio.to_thread(measure)
        await asyncio.sleep(FRAGMENTATION_PERIOD_S)


async def _sample_cpu(meter: CpuMeter, clock, ends_at: float) -> None:
    while clock() < ends_at:
        await asyncio.to_thread(meter.sample)
        await asyncio.sleep(CPU_PERIOD_S)


async def drive_phase(name: str, plan: Plan, send: SendTurn, target: FaultTarget, scale_out: ScaleOut,
                      decided: Decided, fragmentation: Callable[[], list[float]]) -> PhaseOutcome:
    """The unloaded S measurement, then the soak with its faults, on one phase's parts."""
    outcome = PhaseOutcome()
    print(f"[{name}] unloaded S-tier latency for {plan.unloaded_s:.0f}s", flush=True)
    start = time.monotonic()
    await _closed_loop(plan.unloaded, send, lambda: time.monotonic() - start, outcome.unloaded, plan.unloaded_s)
    schedule = fault_schedule(plan.seed, plan.duration_s, target.kinds())
    print(f"[{name}] soak: {len(plan.sessions)} sessions over {plan.duration_s:.0f}s, "
          f"{len(schedule)} faults", flush=True)
    origin = time.monotonic()

    def clock() -> float:
        return time.monotonic() - origin

    ends_at = plan.duration_s
    meter = CpuMeter()
    meter.start()
    helpers = [asyncio.create_task(_watch_breach(outcome.samples, clock, origin, plan.target_ms, scale_out,
                                                 decided, outcome, ends_at)),
               asyncio.create_task(_sample_fragmentation(fragmentation, outcome, clock, ends_at)),
               asyncio.create_task(_sample_cpu(meter, clock, ends_at))]
    chaos = asyncio.create_task(_chaos(target, schedule, clock, origin, outcome.faults))
    await _open_loop(plan.sessions, send, clock, outcome.samples, ends_at)
    await asyncio.to_thread(meter.sample)
    outcome.cpu_s, outcome.busy_share = meter.by_part(), meter.machine_busy_share()
    print(f"[{name}] CPU seconds by part over the soak: {outcome.cpu_s}; "
          f"cores busy {outcome.busy_share:.0%}", flush=True)
    try:
        await asyncio.wait_for(chaos, timeout=DRAIN_LIMIT_S)
    except asyncio.TimeoutError:
        print(f"[{name}] a fault was still recovering {DRAIN_LIMIT_S:.0f}s after the soak", flush=True)
    for task in helpers:
        task.cancel()
    await asyncio.gather(*helpers, return_exceptions=True)
    return outcome


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

        return await drive_phase("ballast", plan, send, side, scale_out, lambda: watch.decided_at, side.fragmentation)
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
            print(f"[ballast] starting the mesh: 2 routers, {workers} {engine} workers and a warm standby",
                  flush=True)
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


# -- the table -----------------------------------------------------------------------------------


def surge_record(outcome: PhaseOutcome, surge: Surge) -> FaultRecord:
    """The surge as a fault: from its start until the load had settled after it (TTFT p99
    back within twice what it was before the surge, no errors, over 5 s)."""
    before = [s.ttft * 1000.0 for s in outcome.samples
              if s.ok and s.ttft is not None and surge.start_s - 30 <= s.start < surge.start_s]
    reference = percentile(before, 99) if before else math.inf
    settled = settled_at(outcome.samples, surge.end_s, reference)
    return FaultRecord(SURGE, "traffic", surge.start_s, settled, surge.end_s - surge.start_s)


def summarize(outcome: PhaseOutcome, plan: Plan) -> tuple[dict, dict, list[FaultRecord]]:
    faults = [*outcome.faults, surge_record(outcome, plan.surge)]
    row = phase_row(outcome.samples, outcome.unloaded, outcome.scale_out_s, outcome.fragmentation)
    row["breach_at_s"] = outcome.breach_at
    row["cpu_s_by_part"] = outcome.cpu_s
    row["machine_busy_share"] = outcome.busy_share
    return row, fault_rows(outcome.samples, faults, plan.duration_s), faults


def timeline(samples: list[RequestSample], bucket_s: float = 5.0) -> list[dict]:
    """Per bucket of request starts: the e2e p99 of those that succeeded, requests, errors."""
    buckets: dict[int, list[RequestSample]] = {}
    for sample in samples:
        buckets.setdefault(int(sample.start // bucket_s), []).append(sample)
    return [{"t": index * bucket_s, "p99_ms": percentile([s.e2e_ms for s in group if s.ok], 99),
             "s_p99_ms": percentile([s.e2e_ms for s in group if s.ok and s.tier == "S"], 99),
             "requests": len(group), "errors": sum(not s.ok for s in group)}
            for index, group in sorted(buckets.items())]


def samples_path(result_path: Path) -> Path:
    return result_path.with_name(result_path.stem + "_samples.json")


def write_samples(path: Path, baseline: PhaseOutcome, ballast: PhaseOutcome) -> Path:
    """Every request of both phases, unloaded and soak, one object each: what the table's
    rows are computed from, kept so a row can be explained after the run."""
    phases = {name: {"unloaded": [asdict(s) for s in outcome.unloaded], "soak": [asdict(s) for s in outcome.samples]}
              for name, outcome in (("baseline", baseline), ("ballast", ballast))}
    path.write_text(json.dumps(phases, separators=(",", ":")) + "\n")
    return path


def print_soak_table(baseline: dict, ballast: dict, faults: dict) -> None:
    print("\nthe table (same traffic, same faults)")
    print_table(["row", "plain baseline", "Ballast"], table_lines(baseline, ballast))
    rows = []
    for kind, pair in faults.items():
        for phase in ("baseline", "ballast"):
            row = pair[phase]
            if row is not None:
                rows.append([kind, phase, row["applied"], row["observed"], row["requests_hit"], row["failed"],
                             row["interrupted"], row["recovery_s"]])
    print("\nper fault type")
    print_table(["fault", "phase", "applied", "observed", "requests hit", "failed", "interrupted", "recovery s"], rows)


def run_benchmark(engine: str, minutes: float, workers: int, rate: float, target_ms: float, unloaded_s: float,
                  seed: int, out: Path, preset: str, model_dir: Path | None = None) -> int:
    duration = minutes * 60.0
    surge = surge_window(duration)
    plan = Plan(sessions=plan_sessions(seed, duration, rate, surge),
                unloaded=plan_sessions(seed + 1, unloaded_s, 2.0, NO_SURGE, mix=ONLY_S),
                unloaded_s=unloaded_s, duration_s=duration, surge=surge, seed=seed, target_ms=target_ms)
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
        "engine": engine, "model_preset": preset, "workers": workers, "minutes": minutes,
        "rate_sessions_per_s": rate, "surge": asdict(surge), "seed": seed, "target_ttft_ms": target_ms,
        "unloaded_s": unloaded_s, "sessions_planned": len(plan.sessions),
        "baseline": baseline_row, "ballast": ballast_row, "faults": faults,
        "fault_log": {"baseline": [asdict(r) for r in baseline_records],
                      "ballast": [asdict(r) for r in ballast_records]},
        "timeline": {"baseline": timeline(baseline.samples), "ballast": timeline(ballast.samples)},
        "table": [list(line) for line in table_lines(baseline_row, ballast_row)],
        "baseline_kinds": list(WORKER_FAULTS),
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
    parser.add_argument("--target-ms", type=float, default=1500.0,
                        help="the p99 TTFT both autoscalers hold (breach at 90 %% of it)")
    parser.add_argument("--unloaded-s", type=float, default=30.0, help="the unloaded S-tier measurement per phase")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--preset", choices=("tiny", "bench"), default=None,
                        help="the model (default: bench for vLLM, whose CPU attention needs head_dim 64; else tiny)")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="a model folder to serve instead of the preset's (built under .ballast/models)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/soak.json"))
    args = parser.parse_args(argv)
    stop_on_sigterm()
    return run_benchmark(args.engine, args.minutes, args.workers, args.rate or DEFAULT_RATE[args.engine],
                         args.target_ms, args.unloaded_s, args.seed, args.out, args.preset or DEFAULT_PRESET[args.engine],
                         args.model_dir)
