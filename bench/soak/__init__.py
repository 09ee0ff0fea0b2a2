"""The chaos soak: Ballast against plain vLLM serving, the same traffic, the same faults.

One invocation (`python -m bench.soak`, `ballast bench soak`), two phases on the same machine,
one after the other:
  baseline  N plain OpenAI-compatible servers (vLLM's own with `--engine vllm`; a stand-in,
            bench.plain_server, with torch or sim) behind a round-robin balancer with a
            readiness probe, reached with the OpenAI SDK and its own retries; a server that
            dies is restarted cold; a plain autoscaler cold-starts one more on a p99 breach;
  ballast   two routers, the same N workers (under their keepers), the cache service on
            Redis, the backfill service on the Kafka broker, the autoscaler with one warm
            standby; every request through the public gRPC API.
Each phase first measures S-tier latency unloaded (S-only sessions, two at a time), then runs
the seeded open-loop traffic of `bench.soak.traffic` (multi-turn agent sessions, S/A/B,
JSON turns, a 3x surge mid-way) while the fault schedule of `bench.soak.faults` strikes:
workers SIGKILLed, stalled (SIGSTOP past the stall timeout) and running hot (80 C and half
speed) in both phases; a router killed, Redis restarted, the Kafka broker down, etcd
restarted in Ballast's (the baseline has none of those parts).

Prints the table, writes bench/results/soak.json (keys `baseline`, `ballast`, `faults`, with
the goals judged in code) and bench/results/soak_latency.png (latency over time, faults marked). The
README's opening table is generated from soak.json (`python -m bench.soak.readme`).

    python -m bench.soak [--engine vllm|torch|sim] [--minutes 10] [--workers 2] [--rate 0.4]
                         [--target-ms 1500] [--unloaded-s 30] [--seed 7]

The modules: `run` (the plan, both phases one after the other, the command line), `drive`
(one phase's traffic, faults, breach and samplers), `baseline` and `ballast` (each phase's
parts and how a fault strikes them), `clients` (each phase's client), `traffic` (the seeded
sessions), `faults` (the fault schedule, process trees, the throttle), `cpu` (where the CPU
time went), `table` (the table's arithmetic), `result` (a phase summarized, the samples
kept), `chart` (latency over time) and `readme` (the README's opening table).
"""

from bench.soak.run import main

__all__ = ["main"]
