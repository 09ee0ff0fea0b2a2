"""Every benchmark on the checked-out code, one after another, then the report.

    python -m bench.all [--quick] [--only overhead,tiers] [--skip engines]
    make bench            (the full run; make bench QUICK=1 for a few minutes per benchmark)

Each benchmark runs as its own process (`python -m bench.<name>`), so one that crashes or
misses its goals does not stop the others; its exit status is recorded (0: goals met, 1: a
goal missed, other: it failed). `--quick` shrinks each benchmark's load to check that the
whole set runs and to get indicative numbers; the full run is what the README quotes. Nothing
else should run on the machine meanwhile: the benchmarks measure a shared 2-core machine.
Afterwards `bench.report` rewrites bench/results/REPORT.md from the result files.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass

from bench.common import stop_on_sigterm


@dataclass(frozen=True)
class Benchmark:
    name: str
    quick: tuple[str, ...] = ()
    full: tuple[str, ...] = ()
    # The module under bench/ when it is not `name` (one benchmark run another way).
    module: str = ""


BENCHMARKS = (
    Benchmark("overhead", quick=("--requests", "60", "--reps", "3")),
    Benchmark("tiers", quick=("--seconds", "8", "--reps", "3")),
    Benchmark(
        "tiers_sim",
        module="tiers",
        full=("--engine", "sim"),
        quick=("--engine", "sim", "--seconds", "10", "--reps", "1"),
    ),
    Benchmark("failover", quick=("--kills", "12", "--interval", "2.0")),
    Benchmark(
        "failover_sim",
        module="failover",
        full=("--engine", "sim"),
        quick=("--engine", "sim", "--kills", "12", "--reps", "1"),
    ),
    Benchmark("mesh_scale", quick=("--seconds", "2", "--workers", "1,16", "--streams", "10,100", "--routers", "1,2")),
    # Needs smg (the `compare` extra; `make bench` installs it).
    Benchmark("gateways", quick=("--seconds", "2", "--repeats", "1", "--tokens", "1,32")),
    Benchmark("scale", quick=("--reps", "1")),
    Benchmark("kv_restore", quick=("--contexts", "256,1024", "--reps", "3")),
    Benchmark("structured", quick=("--quick",)),
    Benchmark("answer_quality"),
    Benchmark("context"),
    Benchmark("degrade_handoff", quick=("--handoffs", "500")),
    Benchmark("backfill", quick=("--requests", "200", "--sessions", "20", "--reps", "1")),
    Benchmark("engines", quick=("--rounds", "1", "--trials", "20")),
    Benchmark("fuzz", quick=("--cases", "500")),
    Benchmark("hostile"),
    Benchmark("worker_front", quick=("--rounds", "1", "--requests", "2")),
    # Last: the longest (two 10-minute phases on vLLM) and the README's opening table.
    Benchmark("soak", quick=("--minutes", "2", "--unloaded-s", "15")),
)


# One benchmark never holds the set up for longer than this: past it, it is told to stop
# (SIGTERM: it stops its mesh), and killed if it does not.
QUICK_LIMIT_S = 30 * 60
FULL_LIMIT_S = 90 * 60
STOP_GRACE_S = 60
TIMED_OUT = 124


def run_bounded(argv: list[str], limit_s: float) -> int:
    """Runs one benchmark process; its exit status, or TIMED_OUT when it ran past `limit_s`."""
    process = subprocess.Popen(argv)
    try:
        return process.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        print(f"{argv[2]} ran past {limit_s / 60:.0f} minutes: stopping it", flush=True)
        _stop(process)
        return TIMED_OUT
    except BaseException:
        # This run was told to stop (SIGTERM, Ctrl-C): the benchmark stops its mesh too.
        _stop(process)
        raise


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM (a benchmark then stops the mesh it started), SIGKILL after STOP_GRACE_S."""
    process.terminate()
    try:
        process.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small loads: minutes per benchmark")
    parser.add_argument("--only", default="", help="comma-separated benchmark names")
    parser.add_argument("--skip", default="", help="comma-separated benchmark names")
    args = parser.parse_args(argv)
    stop_on_sigterm()
    names = {b.name for b in BENCHMARKS}
    only = {n for n in args.only.split(",") if n}
    skip = {n for n in args.skip.split(",") if n}
    unknown = (only | skip) - names
    if unknown:
        parser.error(f"unknown benchmarks {sorted(unknown)}; known: {sorted(names)}")
    outcomes = []
    for bench in BENCHMARKS:
        if (only and bench.name not in only) or bench.name in skip:
            continue
        extra = bench.quick if args.quick else bench.full
        print(f"\n=== bench.{bench.name} {' '.join(extra)}", flush=True)
        started = time.monotonic()
        code = run_bounded(
            [sys.executable, "-m", f"bench.{bench.module or bench.name}", *extra],
            QUICK_LIMIT_S if args.quick else FULL_LIMIT_S,
        )
        outcomes.append((bench.name, code, time.monotonic() - started))
    print("\nbenchmark         exit  minutes")
    for name, code, seconds in outcomes:
        verdict = {0: "goals met", 1: "a goal missed", TIMED_OUT: "TIMED OUT"}.get(code, "FAILED")
        print(f"{name:<17} {code:>4}  {seconds / 60:6.1f}  {verdict}")
    from bench.report import write_report

    print(f"wrote {write_report()}")
    return 0 if all(code in (0, 1) for _, code, _ in outcomes) else 2


if __name__ == "__main__":
    sys.exit(main())
