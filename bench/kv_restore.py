"""Next-turn time to first token: KV restored from the cache service vs full recompute.

One run starts a real Redis and the cache service (as its own process, as deployed), then
three torch engines on the same model, each with in-memory session reuse off so every turn
starts cold: one always restores, one never does (the recompute baseline), one decides by
measured cost (adaptive). For each context length, a first turn saves the session's KV;
then the next turn (the whole context but its last token as prompt, one new token) runs on
each engine in turn, interleaved, and TTFT is measured from the call to the first token.
A fourth engine restores always from a second cache service on a local Redis Cluster (three
masters with a replica each), so one Redis and a Redis Cluster are compared in the same run.
Greedy first tokens are checked equal across all four. Goals, judged in code: the same
first token on every path at every length; restoring at least 2x faster than recomputing at
the longest context; the adaptive engine never more than 1.3x slower than the faster of the
two; the Redis Cluster restoring as many tokens as one Redis at every length, and no more
than 1.5x slower at the longest context (each time the median of `--reps` runs). Prints a
table, writes bench/results/kv_restore.json, exits 1 when a goal is missed.

    python -m bench.kv_restore [--preset bench] [--contexts 256,512,...,8192] [--reps 3]

TTFT is taken at the engine: the worker's gRPC layer adds about a millisecond to each path.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import RESULTS_DIR, model_dir_for, print_table, write_result
from bench.goals import HIGHER, LOWER, Goal, judge, print_goals
from services.common.config import TelemetryConfig
from services.cli.localservers import RedisServer
from services.cli.redis_cluster import LocalRedisCluster
from services.common.processes import ManagedProcess, free_port, wait_port_open
from services.common.telemetry import Telemetry
from services.config import load_config
from services.worker.engine import EngineRequest, Sampling
from services.worker.kv import start_session_kv
from services.worker.torch.engine import TorchEngine

DEFAULT_CONTEXTS = (256, 512, 1024, 2048, 4096, 8192)
BLOCK_TOKENS = 32
USER_TURN_TOKENS = 32


def start_cache(state: Path, redis_url: str, cluster: bool = False) -> tuple[ManagedProcess, str]:
    port = free_port()
    name = "cache-cluster" if cluster else "cache"
    env = {
        "BALLAST__REDIS__URL": redis_url,
        "BALLAST__REDIS__CLUSTER": str(cluster).lower(),
        "BALLAST__CACHE__PORT": str(port),
        "BALLAST__TELEMETRY__METRICS_PORT": "0",
        "BALLAST_CONFIG": "",
        "PYTHONUNBUFFERED": "1",
    }
    process = ManagedProcess(
        name, [sys.executable, "-m", "services.cache"], log_path=state / f"{name}.log", env=env, cwd=Path.cwd()
    )
    process.start()
    wait_port_open("127.0.0.1", port, 60)
    return process, f"127.0.0.1:{port}"


# Engine name -> (which cache it restores from, its restore policy).
ENGINES = {
    "always": ("redis", "always"),
    "never": ("redis", "never"),
    "adaptive": ("redis", "adaptive"),
    "cluster": ("redis-cluster", "always"),
}


async def make_engine(model_dir: Path, cache_address: str, policy: str, name: str):
    engine = TorchEngine(model_dir, "bench", max_concurrency=1, eos_token_ids=(), memory_sessions=0)
    await engine.start()
    config = load_config(environ={}).worker.model_copy(
        update={
            "cache_address": cache_address if policy != "never" else "",
            "kv_restore_policy": policy,
            "kv_block_tokens": BLOCK_TOKENS,
            "kv_restore_timeout_s": 30.0,
            "kv_save_timeout_s": 60.0,
        }
    )
    telemetry = Telemetry(f"bench-{name}", TelemetryConfig(enabled=False))
    session = await start_session_kv(config, engine, telemetry)
    return engine, session, telemetry


async def ttft(engine: TorchEngine, prompt: list[int], session: str) -> tuple[float, int, int]:
    """(ms to the first token, the token, context tokens actually computed)."""
    request = EngineRequest(
        f"r-{time.monotonic_ns()}", tuple(prompt), (), Sampling(max_tokens=1, temperature=0.0), "bench", session
    )
    started = time.perf_counter()
    stream = engine.generate(request)
    first = await stream.__anext__()
    elapsed = (time.perf_counter() - started) * 1000
    async for _ in stream:
        pass
    return elapsed, first.token_ids[0], first.prefill_tokens


def metric(telemetry: Telemetry, name: str, **labels) -> float:
    total = 0.0
    for line in telemetry.render().splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def run(args) -> dict:
    model_dir = model_dir_for(args.preset)
    contexts = [int(c) for c in args.contexts.split(",")]
    rng = random.Random(1234)
    with tempfile.TemporaryDirectory(prefix="ballast-kv-bench-") as tmp:
        state = Path(tmp)
        redis = RedisServer(state, maxmemory=4 << 30).start()
        cluster = LocalRedisCluster(state, masters=3, replicas_per_master=1, maxmemory=(4 << 30) // 3).start()
        cache, address = start_cache(state, redis.url)
        cluster_cache, cluster_address = start_cache(state, cluster.url, cluster=True)
        addresses = {"redis": address, "redis-cluster": cluster_address}
        engines = {}
        try:
            for name, (store, policy) in ENGINES.items():
                engines[name] = await make_engine(model_dir, addresses[store], policy, name)
            writer, writer_kv, _ = engines["always"]
            cluster_writer, cluster_writer_kv, _ = engines["cluster"]
            vocab = writer._vocab_size
            rows = []
            for context in contexts:
                session = f"bench-{context}"
                tokens = [rng.randrange(4, vocab) for _ in range(context)]
                prompt = tokens[: context - 1]  # the first new token completes the context
                history = prompt[: len(prompt) - USER_TURN_TOKENS]
                # The earlier turn saves its KV, on one Redis and on the cluster.
                await ttft(writer, history, session)
                await ttft(cluster_writer, history, session)
                assert await writer_kv.flush(120), "the first turn's save did not finish"
                assert await cluster_writer_kv.flush(120), "the first turn's save to the cluster did not finish"
                samples: dict[str, list[float]] = {p: [] for p in engines}
                firsts: dict[str, set[int]] = {p: set() for p in engines}
                computed: dict[str, list[int]] = {p: [] for p in engines}
                for rep in range(args.reps + 1):  # rep 0 warms up (and saves the new turn's blocks)
                    order = list(engines) if rep % 2 == 0 else list(engines)[::-1]
                    for policy in order:
                        engine, kv, _tel = engines[policy]
                        ms, token, prefilled = await ttft(engine, prompt, session)
                        if kv is not None:
                            await kv.flush(120)
                        if rep:
                            samples[policy].append(ms)
                            firsts[policy].add(token)
                            computed[policy].append(prefilled)
                restore_ms = statistics.median(samples["always"])
                recompute_ms = statistics.median(samples["never"])
                adaptive_ms = statistics.median(samples["adaptive"])
                cluster_ms = statistics.median(samples["cluster"])
                same = len(set().union(*firsts.values())) == 1
                adaptive_restored = statistics.median(computed["adaptive"]) < len(prompt)
                rows.append(
                    {
                        "context_tokens": context,
                        "prompt_tokens": len(prompt),
                        "restored_tokens": len(prompt) - min(computed["always"]),
                        "restore_ttft_ms": round(restore_ms, 2),
                        "recompute_ttft_ms": round(recompute_ms, 2),
                        "adaptive_ttft_ms": round(adaptive_ms, 2),
                        "adaptive_choice": "restore" if adaptive_restored else "recompute",
                        "cluster_restored_tokens": len(prompt) - min(computed["cluster"]),
                        "cluster_restore_ttft_ms": round(cluster_ms, 2),
                        "cluster_over_redis": round(cluster_ms / restore_ms, 2),
                        "speedup": round(recompute_ms / restore_ms, 2),
                        "same_first_token": same,
                        "samples_ms": {p: [round(v, 2) for v in vals] for p, vals in samples.items()},
                    }
                )
                print(
                    f"context {context}: restore {restore_ms:.1f} ms, recompute {recompute_ms:.1f} ms, "
                    f"adaptive {adaptive_ms:.1f} ms, restore from the Redis Cluster {cluster_ms:.1f} ms",
                    flush=True,
                )
            adaptive_tel = engines["adaptive"][2]
            estimates = {
                p: metric(adaptive_tel, "ballast_worker_kv_estimated_ms", path=p) for p in ("restore", "recompute")
            }
        finally:
            for engine, kv, _tel in engines.values():
                if kv is not None:
                    await kv.stop(1.0)
                await engine.stop()
            cache.stop(10.0)
            cluster_cache.stop(10.0)
            redis.stop()
            cluster.stop()
    return {"rows": rows, "adaptive_estimates_1024_ms": estimates}


GOALS = (
    Goal("contexts where the paths' first tokens differ", "first_token_mismatches", 0, LOWER),
    Goal("recompute TTFT over restore TTFT at the longest context", "restore_speedup_longest", 2.0, HIGHER, "x"),
    Goal("adaptive TTFT over the faster path, worst context", "adaptive_over_best_worst", 1.3, LOWER, "x"),
    Goal(
        "contexts where the Redis Cluster restored fewer tokens than one Redis", "cluster_restore_shortfalls", 0, LOWER
    ),
    Goal(
        "restore TTFT from the Redis Cluster over one Redis, longest context",
        "cluster_over_redis_longest",
        1.5,
        LOWER,
        "x",
    ),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="bench")
    parser.add_argument("--contexts", default=",".join(str(c) for c in DEFAULT_CONTEXTS))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS_DIR / "kv_restore.json"))
    args = parser.parse_args(argv)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(".ballast/torchinductor").resolve()))
    result = asyncio.run(run(args))
    rows = result["rows"]
    print()
    print_table(
        [
            "context",
            "restored",
            "restore ms",
            "recompute ms",
            "adaptive ms",
            "adaptive chose",
            "speedup",
            "cluster restored",
            "cluster ms",
            "same token",
        ],
        [
            [
                r["context_tokens"],
                r["restored_tokens"],
                r["restore_ttft_ms"],
                r["recompute_ttft_ms"],
                r["adaptive_ttft_ms"],
                r["adaptive_choice"],
                r["speedup"],
                r["cluster_restored_tokens"],
                r["cluster_restore_ttft_ms"],
                r["same_first_token"],
            ]
            for r in rows
        ],
    )
    longest = max(rows, key=lambda r: r["context_tokens"])
    measured = {
        "first_token_mismatches": sum(not r["same_first_token"] for r in rows),
        "restore_speedup_longest": longest["speedup"],
        "adaptive_over_best_worst": max(
            r["adaptive_ttft_ms"] / min(r["restore_ttft_ms"], r["recompute_ttft_ms"]) for r in rows
        ),
        "cluster_restore_shortfalls": sum(r["cluster_restored_tokens"] < r["restored_tokens"] for r in rows),
        "cluster_over_redis_longest": longest["cluster_over_redis"],
    }
    judged = judge(GOALS, measured)
    print_goals(judged)
    path = write_result(
        Path(args.out),
        {
            "benchmark": "kv_restore",
            "preset": args.preset,
            "block_tokens": BLOCK_TOKENS,
            "reps": args.reps,
            "engine": "torch",
            **result,
            **measured,
            **judged,
        },
    )
    print(f"\nwrote {path}")
    return 0 if judged["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
