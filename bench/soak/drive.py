"""The soak's driver: one phase's traffic, faults, breach and samplers, on whatever parts the
phase has.

A phase hands over how a turn is sent, what faults strike (`FaultTarget`), how it adds
capacity and whether its own autoscaler decided; the driver measures S-tier latency unloaded,
then replays the plan open loop while the faults strike at their moments, watches the
clients' p99 for the breach, and samples fragmentation and CPU until the soak ends. Both
phases are driven by this one module, so they differ only in their parts.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from bench.common import percentile
from bench.soak.cpu import CpuMeter
from bench.soak.faults import FaultTarget, ScheduledFault, fault_schedule
from bench.soak.table import FaultRecord, RequestSample
from bench.soak.traffic import Conversation, SessionPlan, Surge, TurnPlan

BREACH_WINDOW_S = 8.0
BREACH_MIN_SAMPLES = 10
BREACH_AT = 0.9  # of the target, as the autoscaler's own rule
DRAIN_LIMIT_S = 90.0
FRAGMENTATION_PERIOD_S = 2.0
CPU_PERIOD_S = 2.0

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
    # Ballast only: each process still running at the end, its own count of the waits that
    # leave streams without tokens (bench.soak.ballast.stall_counts).
    stalls: dict[str, dict[str, float]] = field(default_factory=dict)

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


async def _open_loop(
    sessions: list[SessionPlan], send: SendTurn, clock, samples: list[RequestSample], ends_at: float
) -> None:
    """Starts each session at its planned offset, whatever the others are doing."""
    tasks = []
    for plan in sessions:
        delay = plan.start_s - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(_run_session(plan, send, clock, samples, ends_at)))
    await asyncio.gather(*tasks)


async def _closed_loop(
    sessions: list[SessionPlan], send: SendTurn, clock, samples: list[RequestSample], ends_at: float, clients: int = 2
) -> None:
    """Sessions one after another on each of `clients` clients: the unloaded measurement."""
    queue = list(sessions)

    async def client() -> None:
        while queue and clock() < ends_at:
            await _run_session(queue.pop(0), send, clock, samples, ends_at)

    await asyncio.gather(*(client() for _ in range(clients)))


async def _chaos(
    target: FaultTarget, schedule: list[ScheduledFault], clock, origin: float, records: list[FaultRecord]
) -> None:
    """Strikes each fault at its moment, whatever the earlier ones are still doing (a worker
    may take minutes to serve again): faults overlap as they would in production."""

    async def strike(fault: ScheduledFault) -> None:
        delay = fault.at_s - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        print(f"  [{clock():6.1f}s] {fault.kind}" + (f" for {fault.hold_s:g}s" if fault.hold_s else ""), flush=True)
        struck = await asyncio.to_thread(target.apply, fault)
        injected = struck.struck_at - origin
        recovered = None if struck.recovered_at is None else struck.recovered_at - origin
        records.append(FaultRecord(fault.kind, struck.target, injected, recovered, fault.hold_s))
        print(
            f"  [{clock():6.1f}s] {fault.kind} on {struck.target}, struck at {injected:.1f}s: "
            + ("served again" if recovered is not None else "NOT observed to serve again"),
            flush=True,
        )

    await asyncio.gather(*(strike(fault) for fault in schedule))
    records.sort(key=lambda record: record.injected_at)


# A phase's scale-out: waits for the added capacity to serve; returns when (monotonic).
ScaleOut = Callable[[], Awaitable[float | None]]
# When (monotonic) the phase's own autoscaler decided to scale out, if it has one that
# decides by itself (Ballast's, on the p99 its router measures); None until it does.
Decided = Callable[[], float | None]


async def _watch_breach(
    samples: list[RequestSample],
    clock,
    origin: float,
    target_ms: float,
    scale_out: ScaleOut,
    decided: Decided,
    outcome: PhaseOutcome,
    ends_at: float,
) -> None:
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


async def _sample_fragmentation(
    measure: Callable[[], list[float]], outcome: PhaseOutcome, clock, ends_at: float
) -> None:
    while clock() < ends_at:
        outcome.fragmentation += await asyncio.to_thread(measure)
        await asyncio.sleep(FRAGMENTATION_PERIOD_S)


async def _sample_cpu(meter: CpuMeter, clock, ends_at: float) -> None:
    while clock() < ends_at:
        await asyncio.to_thread(meter.sample)
        await asyncio.sleep(CPU_PERIOD_S)


async def drive_phase(
    name: str,
    plan: Plan,
    send: SendTurn,
    target: FaultTarget,
    scale_out: ScaleOut,
    decided: Decided,
    fragmentation: Callable[[], list[float]],
) -> PhaseOutcome:
    """The unloaded S measurement, then the soak with its faults, on one phase's parts."""
    outcome = PhaseOutcome()
    print(f"[{name}] unloaded S-tier latency for {plan.unloaded_s:.0f}s", flush=True)
    start = time.monotonic()
    await _closed_loop(plan.unloaded, send, lambda: time.monotonic() - start, outcome.unloaded, plan.unloaded_s)
    schedule = fault_schedule(plan.seed, plan.duration_s, target.kinds())
    print(
        f"[{name}] soak: {len(plan.sessions)} sessions over {plan.duration_s:.0f}s, {len(schedule)} faults", flush=True
    )
    origin = time.monotonic()

    def clock() -> float:
        return time.monotonic() - origin

    ends_at = plan.duration_s
    meter = CpuMeter()
    meter.start()
    helpers = [
        asyncio.create_task(
            _watch_breach(outcome.samples, clock, origin, plan.target_ms, scale_out, decided, outcome, ends_at)
        ),
        asyncio.create_task(_sample_fragmentation(fragmentation, outcome, clock, ends_at)),
        asyncio.create_task(_sample_cpu(meter, clock, ends_at)),
    ]
    chaos = asyncio.create_task(_chaos(target, schedule, clock, origin, outcome.faults))
    await _open_loop(plan.sessions, send, clock, outcome.samples, ends_at)
    await asyncio.to_thread(meter.sample)
    outcome.cpu_s, outcome.busy_share = meter.by_part(), meter.machine_busy_share()
    print(
        f"[{name}] CPU seconds by part over the soak: {outcome.cpu_s}; cores busy {outcome.busy_share:.0%}", flush=True
    )
    try:
        await asyncio.wait_for(chaos, timeout=DRAIN_LIMIT_S)
    except asyncio.TimeoutError:
        print(f"[{name}] a fault was still recovering {DRAIN_LIMIT_S:.0f}s after the soak", flush=True)
    for task in helpers:
        task.cancel()
    await asyncio.gather(*helpers, return_exceptions=True)
    return outcome
