"""What degrading costs: committing hand-offs to the outbox, draining them to Kafka, answering by rules.

1. Outbox commit: N hand-offs submitted with C at once, per SQLite synchronous mode. With C=1
   every hand-off is its own transaction (the baseline); with more at once they share group
   commits, so one fsync covers a batch.
2. Drain: the same N rows produced to a local Kafka-protocol broker (idempotent, acks=all) and
   deleted on delivery, rows per second.
3. Rule engine: time to match and render one answer (English and Chinese), and a whole rules
   stream through the Degrader (Started, pieces, Finished with its ticket committed).
Goals, judged in code: every row drained; group commits at least 5x the one-by-one baseline
(FULL, 64 at once); a whole rules answer with its hand-off committed within 50 ms at p99.
Prints a table, writes bench/results/degrade_handoff.json, exits 1 when a goal is missed.

    python -m bench.degrade_handoff [--handoffs 2000] [--record-bytes 1500]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import tempfile
import time
import uuid
from pathlib import Path

from bench.common import percentile, print_table, write_result
from bench.goals import HIGHER, LOWER, Goal, judge, print_goals
from services.common.errors import ResourceExhausted
from services.common.generation import Sampling
from services.cli.localservers import KafkaBroker
from services.router.degrade.config import DegradeConfig
from services.router.degrade.degrader import Degrader
from services.router.degrade.handoff import HandOff, HandOffSettings
from services.router.degrade.rules import RuleEngine
from services.router.requests import InferenceRequest, Message

GOALS = (
    Goal("hand-offs drained to Kafka", "drained_share", 1.0, HIGHER),
    Goal("group commit (64 at once) over one by one, synchronous FULL", "group_commit_gain", 5.0, HIGHER, "x"),
    Goal("rules answer + hand-off p99", "rules_stream_p99_ms", 50.0, LOWER, " ms"),
)

QUESTIONS = [
    "Where is my order #40213? I paid for a blue phone case yesterday.",
    "I want a refund for the broken charger.",
    "How much are the wireless earbuds now?",
    "我的订单到哪了？订单号 77812",
    "手机壳有货吗？",
    "支付失败了，会扣款吗？",
]


async def bench_commit(folder: Path, handoffs: int, concurrency: int, synchronous: str, record: bytes) -> dict:
    # An unreachable broker: only the commit path is measured, the drainer just waits.
    handoff = HandOff(
        HandOffSettings(
            outbox_path=folder / f"commit-{synchronous}-{concurrency}.sqlite",
            bootstrap="127.0.0.1:1",
            synchronous=synchronous,
            max_rows=handoffs + 1,
            backoff_initial_s=30,
            backoff_max_s=30,
            delivery_timeout_s=1,
        )
    )
    await handoff.start()
    latencies: list[float] = []
    queue = iter(range(handoffs))

    async def client() -> None:
        for i in queue:
            start = time.perf_counter()
            await handoff.submit(f"s{i % 50}".encode(), record)
            latencies.append((time.perf_counter() - start) * 1000)

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    handoff._closed = True  # skip the drain wait on stop: the broker is unreachable by design
    await handoff.stop(drain_timeout_s=0)
    return {
        "synchronous": synchronous,
        "concurrency": concurrency,
        "per_s": handoffs / elapsed,
        "p50_ms": percentile(latencies, 50),
        "p99_ms": percentile(latencies, 99),
    }


async def bench_drain(folder: Path, handoffs: int, record: bytes) -> dict:
    broker = KafkaBroker(folder / "kafka").start()
    try:
        handoff = HandOff(
            HandOffSettings(
                outbox_path=folder / "drain.sqlite",
                bootstrap=broker.bootstrap,
                topic="bench.degraded",
                topic_partitions=3,
                max_rows=handoffs + 1,
                delivery_timeout_s=10,
                drain_batch=500,
            )
        )
        await handoff.start()
        await handoff.submit(b"warm", record)
        await handoff.wait_drained(30)
        # Fill while the drainer races along, then time until the outbox is empty.
        start = time.perf_counter()
        for first in range(0, handoffs, 500):  # submits waiting for a commit are bounded (max_pending)
            await asyncio.gather(
                *(handoff.submit(f"s{i % 50}".encode(), record) for i in range(first, min(handoffs, first + 500)))
            )
        drained = await handoff.wait_drained(120)
        elapsed = time.perf_counter() - start
        await handoff.stop()
        return {"rows": handoffs, "drained": drained, "per_s": handoffs / elapsed, "seconds": elapsed}
    finally:
        broker.stop()


def bench_rules(rounds: int) -> dict:
    engine = RuleEngine.default_rules()
    timings: list[float] = []
    for _ in range(rounds):
        for question in QUESTIONS:
            start = time.perf_counter()
            engine.answer(question)
            timings.append((time.perf_counter() - start) * 1e6)
    return {"answers": len(timings), "p50_us": percentile(timings, 50), "p99_us": percentile(timings, 99)}


async def bench_rules_stream(folder: Path, requests: int) -> dict:
    config = DegradeConfig(outbox_path=str(folder / "rules.sqlite"), delivery_timeout_s=1)
    degrader = Degrader(config, "127.0.0.1:1")
    await degrader.start()

    async def failing_pool(_request):
        raise ResourceExhausted("bench: admission refused")
        yield  # pragma: no cover - makes this an async generator

    timings: list[float] = []
    for i in range(requests):
        request = InferenceRequest(
            request_id=uuid.uuid4().hex,
            session_id=f"s{i % 20}",
            tenant="bench",
            model="tiny",
            sampling=Sampling(max_tokens=64),
            tier="A",
            messages=(Message("user", QUESTIONS[i % len(QUESTIONS)]),),
        )
        start = time.perf_counter()
        async for _event in degrader.run(
            failing_pool,
            request,
            tier="A",
            tier_reason="default",
            deadline=time.monotonic() + 10,
            started=time.perf_counter(),
        ):
            pass
        timings.append((time.perf_counter() - start) * 1000)
    degrader.handoff._closed = True
    await degrader.handoff.stop(drain_timeout_s=0)
    return {"requests": requests, "p50_ms": percentile(timings, 50), "p99_ms": percentile(timings, 99)}


async def main_async(args) -> dict:
    record = b"x" * args.record_bytes
    with tempfile.TemporaryDirectory(prefix="bench-degrade-") as tmp:
        folder = Path(tmp)
        commits = []
        for synchronous in ("FULL", "NORMAL"):
            for concurrency in (1, 16, 64):
                commits.append(await bench_commit(folder, args.handoffs, concurrency, synchronous, record))
        drain = await bench_drain(folder, args.handoffs, record)
        rules = bench_rules(200)
        stream = await bench_rules_stream(folder, 300)
    return {
        "handoffs": args.handoffs,
        "record_bytes": args.record_bytes,
        "commit": commits,
        "drain": drain,
        "rules": rules,
        "rules_stream": stream,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--handoffs", type=int, default=2000)
    parser.add_argument("--record-bytes", type=int, default=1500, help="size of one DegradedRequest")
    parser.add_argument("--out", default="bench/results/degrade_handoff.json")
    args = parser.parse_args(argv)
    # The commit runs use an unreachable broker on purpose: keep its warnings out of the table.
    logging.basicConfig(level=logging.ERROR)
    result = asyncio.run(main_async(args))
    baseline = next(c for c in result["commit"] if c["synchronous"] == "FULL" and c["concurrency"] == 1)["per_s"]
    print_table(
        ["outbox commit", "at once", "hand-offs/s", "x baseline", "p50 ms", "p99 ms"],
        [
            [c["synchronous"], c["concurrency"], c["per_s"], c["per_s"] / baseline, c["p50_ms"], c["p99_ms"]]
            for c in result["commit"]
        ],
    )
    print()
    drain, rules, stream = result["drain"], result["rules"], result["rules_stream"]
    print_table(
        ["measure", "value"],
        [
            ["drain to Kafka (rows/s)", drain["per_s"]],
            ["drained all", str(drain["drained"])],
            ["rule answer p50 (us)", rules["p50_us"]],
            ["rule answer p99 (us)", rules["p99_us"]],
            ["rules stream + hand-off p50 (ms)", stream["p50_ms"]],
            ["rules stream + hand-off p99 (ms)", stream["p99_ms"]],
        ],
    )
    full = {c["concurrency"]: c["per_s"] for c in result["commit"] if c["synchronous"] == "FULL"}
    result.update(
        {
            "engine": "none (router degradation path)",
            "drained_share": 1.0 if drain["drained"] else 0.0,
            "group_commit_gain": full[64] / full[1],
            "rules_stream_p99_ms": stream["p99_ms"],
        }
    )
    result.update(judge(GOALS, result))
    print_goals(result)
    path = write_result(Path(args.out), result)
    print(f"\nwrote {path}")
    return 0 if result["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
