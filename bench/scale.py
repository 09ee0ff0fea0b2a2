"""Autoscaling under a load step: from a p99 breach to new capacity serving, cold vs warm.

One run starts a local mesh whose router runs the autoscaler with the local executor (as
`ballast up` does with `autoscaler.enabled`), then two phases with the same load step on a
pool of one serving worker (one sequence at a time, so requests queue). The step is sized
from the service time measured in the same phase (`bench/load_step.py`: enough closed-loop
clients to queue each request about three targets long) and doubles while it does not breach,
so it breaches on an idle machine and on a busy one alike:
  cold  no standby: the leader cold-starts a worker process (the baseline);
  warm  one warm standby kept: the leader promotes it.
For each phase: the clients' own TTFT p99 unloaded, the breach (the clients' rolling p99
reaching 90 % of the target), the scale-out decision (read from etcd), the moment the new
worker is routable (membership watch), and the p99 before and after. Prints a table and
writes bench/results/scale.json (cold_s, warm_s: breach to serving, the median of `--reps`
runs on fresh meshes, judged on it; p99_before_ms, p99_after_ms: the median cold run, around
the new capacity).

    python -m bench.scale [--reps 3] [--target-ms 300] [--clients N (a fixed first step instead)]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import model_dir_for, percentile, print_table, stop_on_sigterm, write_result
from bench.goals import LOWER, Goal, judge, print_goals
from bench.load_step import (
    ClosedLoopLoad,
    Samples,
    clients_for_queue_wait,
    grow_until,
    median_service_ms,
    timed_stream,
)
from ballast.v1 import inference_pb2_grpc
from services.cli.client import chat_request, open_channel
from services.cli.mesh import LOCAL_API_KEY, Mesh, MeshSpec
from services.common.membership import MembershipWatcher, make_client
from services.common.telemetry import DependencyStatus
from services.config import load_config
from services.router.autoscale.controller import decision_key

PROMPT = "Customer asks where order 7041 is and when it ships, and whether it can be gift wrapped."
MAX_TOKENS = 24
METADATA = (("x-api-key", LOCAL_API_KEY),)
WINDOW_S = 8.0
MIN_SAMPLES = 10
# Bringing the pool up to min_replicas counts as a scale-out: the load step waits this out.
COOLDOWN_S = 10.0
SETTLE_S = 3.0
AFTER_S = 12.0
GOALS = (
    Goal("p99 breach to a cold-started worker serving", "cold_s", 5.0, LOWER, " s"),
    Goal("p99 breach to a promoted warm standby serving", "warm_s", 1.0, LOWER, " s"),
)


def policy(target_ms: float, standby: int) -> dict:
    return {
        "min_replicas": 1,
        "max_replicas": 2,
        "standby_replicas": standby,
        "target_p99_ttft_ms": target_ms,
        "calm_p99_ttft_ms": target_ms / 2,
        "latency_window_s": WINDOW_S,
        "min_samples": MIN_SAMPLES,
        "scale_out_cooldown_s": COOLDOWN_S,
        "calm_for_s": 600,
    }


# The step queues each request about this many targets long; doubled while it does not breach.
STEP_WAIT_TARGETS = 3
PATIENCE_S = 20.0


def _p99(samples: Samples, start: float, end: float) -> float:
    return percentile([ms for at, ms in samples.ttft if start <= at < end], 99)


def _rolling_p99(samples: Samples, now: float, since: float) -> float | None:
    recent = [ms for at, ms in samples.ttft if at > max(now - WINDOW_S, since)]
    return percentile(recent, 99) if len(recent) >= MIN_SAMPLES else None


async def _until(predicate, timeout: float, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await predicate() if asyncio.iscoroutinefunction(predicate) else predicate()
        if value:
            return value
        await asyncio.sleep(interval)
    raise TimeoutError(f"gave up after {timeout:.0f}s waiting for {getattr(predicate, '__name__', 'a condition')}")


async def _max_in_flight(membership: MembershipWatcher, worker_id: str, seconds: float) -> int:
    """The most requests the worker's heartbeats showed in flight over `seconds`: it serves."""
    most, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        record = membership.get(worker_id)
        most = max(most, record.in_flight if record is not None else 0)
        await asyncio.sleep(0.2)
    return most


def _routable(membership: MembershipWatcher) -> set[str]:
    return {w.id for w in membership.workers().values() if w.routable}


def _standby(membership: MembershipWatcher) -> set[str]:
    return {w.id for w in membership.workers().values() if w.standby}


async def _phase(mesh: Mesh, name: str, standby: int, clients: int | None, target_ms: float) -> dict:
    config = load_config(mesh.config_path, environ={})
    membership = MembershipWatcher(config.etcd, DependencyStatus())
    await membership.start()
    etcd = make_client(config.etcd)
    await etcd.connect()
    phase_start = time.time()
    try:
        print(f"[{name}] waiting for 1 serving + {standby} warm worker(s) ...", flush=True)
        await _until(lambda: len(_routable(membership)) == 1 and len(_standby(membership)) == standby, 180, 0.2)
        initial = _routable(membership)
        warm = _standby(membership)

        async def scale_out() -> dict | None:
            got = await etcd.get(decision_key(config.etcd.prefix, "primary").encode())
            decision = None if got is None else json.loads(got.value)
            if (
                decision
                and decision["at"] > phase_start
                and decision["action"] == "scale_out"
                and decision["serving"] >= 2
            ):
                return decision
            return None

        samples = Samples()
        async with open_channel(mesh.router_address) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            # One client: the workers warm up, the bring-up cooldown passes, the unloaded p99.
            quiet = ClosedLoopLoad(stub, METADATA, PROMPT, MAX_TOKENS, samples)
            quiet.grow(1)
            await asyncio.sleep(COOLDOWN_S + 2)
            await quiet.finish()
            unloaded_p99 = _p99(samples, time.time() - WINDOW_S, time.time())
            service_ms = await median_service_ms(
                lambda: timed_stream(
                    stub, chat_request(PROMPT, max_tokens=MAX_TOKENS, raw_prompt=True), METADATA, Samples()
                )
            )
            step = clients or clients_for_queue_wait(service_ms, STEP_WAIT_TARGETS * target_ms, slots=1)

            print(f"[{name}] service time {service_ms:.0f} ms unloaded; load step: {step} clients", flush=True)
            load_at = time.time()
            load = ClosedLoopLoad(stub, METADATA, PROMPT, MAX_TOKENS, samples)
            load.grow(step)
            breach: list[float] = []

            def breached() -> bool:
                p99 = _rolling_p99(samples, time.time(), load_at)
                if p99 is not None and p99 >= 0.9 * target_ms and not breach:
                    breach.append(time.time())
                return bool(breach)

            try:
                if not await grow_until(load, breached, PATIENCE_S):
                    raise TimeoutError(f"[{name}] no breach of {0.9 * target_ms:.0f} ms even at {load.clients} clients")
                breach_at = breach[0]
                decision = await _until(scale_out, 60, 0.05)
                new = await _until(lambda: _routable(membership) - initial, 180)
                serving_at = time.time()
                (new_id,) = new
                busy = await _max_in_flight(membership, new_id, SETTLE_S + AFTER_S)
            finally:
                await load.finish()
        return {
            "phase": name,
            "promoted": new_id in warm,
            "new_worker": new_id,
            "breach_to_serving_s": serving_at - breach_at,
            "breach_to_decision_s": decision["at"] - breach_at,
            "decision_to_serving_s": serving_at - decision["at"],
            "load_to_breach_s": breach_at - load_at,
            "p99_unloaded_ms": unloaded_p99,
            "p99_before_ms": _p99(samples, load_at, serving_at),
            "p99_after_ms": _p99(samples, serving_at + SETTLE_S, serving_at + SETTLE_S + AFTER_S),
            "service_ms_unloaded": service_ms,
            "clients_first_step": step,
            "clients_at_breach": load.clients,
            "decision_reason": decision["reason"],
            "degraded": samples.degraded,
            "errors": samples.errors,
            "requests": len(samples.ttft),
            "new_worker_max_in_flight": busy,
        }
    finally:
        await etcd.close()
        await membership.stop()


def _overrides(target_ms: float, standby: int) -> dict:
    return {
        "autoscaler": {
            "enabled": True,
            "executor": "local",
            "tick_s": 0.5,
            "report_interval_s": 0.5,
            "pools": {"primary": policy(target_ms, standby)},
            "local": {"stop_grace_s": 5},
        },
        "worker": {"drain_grace_s": 2},
    }


def _restart_router(mesh: Mesh) -> None:
    router = next(s for s in mesh.services if s.name == "router")
    router.process.stop(timeout=40)  # its executor stops the workers it started
    mesh.restart_service(router)


def _one_run(clients: int | None, target_ms: float) -> dict:
    """Both phases on one mesh: {"cold": ..., "warm": ...}."""
    model_dir = model_dir_for("tiny")
    results = {}
    with tempfile.TemporaryDirectory(prefix="ballast-scale-") as state:
        # The router's own executor starts every worker: the mesh starts none.
        spec = MeshSpec(
            state_dir=Path(state),
            model_dir=model_dir,
            workers=0,
            worker_capacity=1,
            lease_ttl_s=3,
            overrides=_overrides(target_ms, standby=0),
        )
        mesh = Mesh(spec)
        try:
            mesh.start()
            for name, standby in (("cold", 0), ("warm", 1)):
                if name != "cold":
                    # The same mesh, a router restarted with a warm standby in its policy.
                    mesh.spec.overrides = _overrides(target_ms, standby)
                    mesh.write_config()
                    _restart_router(mesh)
                results[name] = asyncio.run(_phase(mesh, name, standby, clients, target_ms))
        finally:
            mesh.stop()
    return results


def run_benchmark(clients: int | None, target_ms: float, out: Path, reps: int = 3) -> int:
    runs = []
    for rep in range(reps):
        print(f"\n-- repetition {rep + 1} of {reps}", flush=True)
        runs.append(_one_run(clients, target_ms))
    rows = [
        [
            rep + 1,
            r["phase"],
            "promotion" if r["promoted"] else "cold start",
            r["breach_to_serving_s"],
            r["breach_to_decision_s"],
            r["decision_to_serving_s"],
            r["p99_unloaded_ms"],
            r["p99_before_ms"],
            r["p99_after_ms"],
            r["requests"],
            r["degraded"],
            r["errors"],
        ]
        for rep, results in enumerate(runs)
        for r in results.values()
    ]
    steps = "; ".join(
        ", ".join(f"{r['phase']} {r['clients_first_step']} -> {r['clients_at_breach']}" for r in results.values())
        for results in runs
    )
    print(f"\nnew capacity under a load step (clients: {steps}; target p99 TTFT {target_ms:.0f} ms)")
    print_table(
        [
            "run",
            "phase",
            "how",
            "breach->serving s",
            "breach->decision s",
            "decision->serving s",
            "p99 unloaded ms",
            "p99 before ms",
            "p99 after ms",
            "requests",
            "degraded",
            "errors",
        ],
        rows,
    )
    cold_s = [results["cold"]["breach_to_serving_s"] for results in runs]
    warm_s = [results["warm"]["breach_to_serving_s"] for results in runs]
    middle = sorted(runs, key=lambda results: results["cold"]["breach_to_serving_s"])[len(runs) // 2]["cold"]
    result = {
        "cold_s": statistics.median(cold_s),
        "warm_s": statistics.median(warm_s),
        "cold_per_run_s": cold_s,
        "warm_per_run_s": warm_s,
        # The cold run of median time, around its new capacity.
        "p99_before_ms": middle["p99_before_ms"],
        "p99_after_ms": middle["p99_after_ms"],
        "runs": runs,
        "reps": reps,
        "target_p99_ttft_ms": target_ms,
        "engine": "torch",
    }
    result.update(judge(GOALS, {"cold_s": cold_s, "warm_s": warm_s}))
    print_goals(result)
    print(f"wrote {write_result(out, result)}")
    return 0 if result["met"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--clients",
        type=int,
        default=None,
        help="a fixed first load step (default: sized from the measured service time)",
    )
    parser.add_argument("--target-ms", type=float, default=300.0)
    parser.add_argument(
        "--reps", type=int, default=3, help="repetitions, each on a fresh mesh; the times are judged on the median"
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/scale.json"))
    args = parser.parse_args(argv)
    stop_on_sigterm()
    return run_benchmark(args.clients, args.target_ms, args.out, args.reps)


if __name__ == "__main__":
    sys.exit(main())
