"""The torch engine and vLLM side by side: the same model folder, the same requests, one run.

Each engine runs in a child process of its own (one at a time, so neither measures the
other's load), started from a bare interpreter so the start time includes its imports:
  * start time: process start to the engine ready;
  * streams at 1, 4 and 16 at once (each `--tokens` long, EOS off so every stream has the
    same length): time to first token p50/p99 over all streams of the level, and output
    tokens per second (all tokens over the wall time of the level); `--rounds` rounds per
    level, the median round reported;
  * resident memory of the engine's process tree (vLLM runs its engine core as a child).
Then resume exactness on vLLM: two vLLM engines (two "workers", each on its own core),
`--trials` prompts, each generated in full on the first and resumed on the second at a
random token (prompt + the ids before it), greedy and seeded sampling; a resume is exact
when the continuation equals the uninterrupted stream token for token. All streams of a
phase run at once, as on a busy worker (batch composition differs between the two engines).

Beside them, the same 16 streams straight to vLLM's AsyncLLM (`raw_vllm_tokens_per_s_at_16`):
what vLLM itself does here, so a gap to the torch engine can be told apart from Ballast's own
cost around vLLM.

Writes bench/results/engines.json: per engine and concurrency `ttft_p50_ms`, `ttft_p99_ms`,
`tokens_per_s`; `vllm_resume_exact_greedy`, `vllm_resume_exact_seeded`, `vllm_resume_trials`.
Goals, judged here: 100 % exact resumes, greedy and seeded; vLLM's tokens/s at 16 streams at
least the torch engine's.

    python -m bench.engines [--preset tiny] [--tokens 128] [--rounds 3] [--trials 100]

Both engines share this machine's cores with nothing else the benchmark starts; on a 2-core
machine the numbers are CPU-bound (what each engine does per token), not a GPU's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

CONCURRENCY = (1, 4, 16)
PROMPTS = [f"Customer {i} asks where order {4000 + i} is, and whether it can still be gift wrapped." for i in range(64)]
SEEDED = {"temperature": 0.9, "top_p": 0.95}


# --- the child: one engine, measured ------------------------------------------------------
def _tree_rss_bytes() -> int:
    import psutil

    me = psutil.Process()
    total = 0
    for process in [me, *me.children(recursive=True)]:
        try:
            total += process.memory_info().rss
        except psutil.Error:
            continue
    return total


def _make_engine(kind: str, model_dir: Path, concurrency: int, cores: str = "auto"):
    if kind == "torch":
        from services.worker.torch.engine import TorchEngine

        return TorchEngine(model_dir, "bench", max_concurrency=concurrency, eos_token_ids=())
    from services.worker.vllm import VllmEngine, VllmSettings, read_model_facts

    facts = read_model_facts(model_dir)
    settings = VllmSettings(
        kv_cache_dtype=facts.weights_dtype, enforce_eager=True, max_concurrency=concurrency, cpu_threads_bind=cores
    )
    return VllmEngine(model_dir, "bench", settings, eos_token_ids=())


async def _stream(engine, prompt_ids, generated=(), max_tokens=128, **sampling):
    from services.worker.engine import EngineRequest, Sampling

    request = EngineRequest(
        "bench",
        tuple(prompt_ids),
        tuple(generated),
        Sampling(max_tokens=max_tokens, **{"temperature": 0.0, **sampling}),
    )
    started, first, tokens = time.perf_counter(), None, []
    async for delta in engine.generate(request):
        if first is None and delta.token_ids:
            first = time.perf_counter()
        tokens += delta.token_ids
    return (first - started) * 1000, tokens


async def _measure(kind: str, model_dir: Path, tokens: int, rounds: int, born: float, cores: str) -> dict:
    engine = _make_engine(kind, model_dir, max(CONCURRENCY), cores)
    await engine.start()
    start_s = time.time() - born
    prompts = [engine.tokenize(p) for p in PROMPTS]
    await _stream(engine, prompts[0], max_tokens=8)  # warm-up
    levels = {}
    for n in CONCURRENCY:
        runs = []
        for r in range(rounds):
            batch = [prompts[(r * n + i) % len(prompts)] for i in range(n)]
            wall = time.perf_counter()
            results = await asyncio.gather(*(_stream(engine, p, max_tokens=tokens) for p in batch))
            wall = time.perf_counter() - wall
            ttfts = sorted(ms for ms, _ in results)
            runs.append(
                {
                    "ttft_p50_ms": statistics.median(ttfts),
                    "ttft_p99_ms": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
                    "tokens_per_s": sum(len(t) for _, t in results) / wall,
                }
            )
        runs.sort(key=lambda run: run["tokens_per_s"])
        levels[str(n)] = {**runs[len(runs) // 2], "rounds": runs}
    rss = _tree_rss_bytes()
    raw = await _raw_vllm_tokens_per_s(engine, prompts, tokens, rounds) if kind == "vllm" else None
    await engine.stop()
    return {
        "engine": kind,
        "start_s": start_s,
        "rss_bytes": rss,
        "concurrency": levels,
        "raw_vllm_tokens_per_s_at_16": raw,
    }


async def _raw_vllm_tokens_per_s(engine, prompts, tokens: int, rounds: int) -> float:
    """The same 16 greedy streams straight to vLLM's AsyncLLM, without Ballast's engine around
    it (no text stream, no processors in play): what vLLM itself does on this machine."""
    api, client = engine.api, engine._client
    n = max(CONCURRENCY)

    async def one(i: int, prompt: list[int]) -> int:
        params = api.sampling_params(
            temperature=0.0, max_tokens=tokens, ignore_eos=True, output_kind=api.delta_output_kind, detokenize=False
        )
        count = 0
        async for out in client.generate(api.tokens_prompt(prompt), params, f"raw-{i}-{time.monotonic_ns()}"):
            count += len(out.outputs[0].token_ids)
        return count

    rates = []
    for r in range(rounds):
        batch = [prompts[(r * n + i) % len(prompts)] for i in range(n)]
        wall = time.perf_counter()
        counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(batch)))
        rates.append(sum(counts) / (time.perf_counter() - wall))
    return statistics.median(rates)


async def _resume_trials(model_dir: Path, tokens: int, trials: int, seed: int) -> dict:
    first = _make_engine("vllm", model_dir, 64, cores="0")
    await first.start()
    second = _make_engine("vllm", model_dir, 64, cores=str(1 % (os.cpu_count() or 1)))
    await second.start()
    rng = random.Random(seed)
    prompts = [first.tokenize(PROMPTS[i % len(PROMPTS)] + f" Case {i}.") for i in range(trials)]
    outcome = {}
    for mode, sampling in (("greedy", {}), ("seeded", SEEDED)):
        options = [dict(sampling, seed=rng.randrange(1 << 31)) if sampling else {} for _ in prompts]
        full = await asyncio.gather(*(_stream(first, p, max_tokens=tokens, **o) for p, o in zip(prompts, options)))
        cuts = [rng.randrange(1, tokens) for _ in prompts]
        resumed = await asyncio.gather(
            *(
                _stream(second, p, generated=f[1][:k], max_tokens=tokens - k, **o)
                for p, f, k, o in zip(prompts, full, cuts, options)
            )
        )
        exact = sum(r[1] == f[1][k:] for r, f, k in zip(resumed, full, cuts))
        outcome[mode] = {
            "exact": exact,
            "trials": trials,
            "mismatches": [
                {"trial": i, "cut": k} for i, (r, f, k) in enumerate(zip(resumed, full, cuts)) if r[1] != f[1][k:]
            ][:10],
        }
    await first.stop()
    await second.stop()
    return outcome


def child_main(argv: list[str]) -> int:
    born = float(os.environ.get("BALLAST_BENCH_BORN", time.time()))
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", choices=["torch", "vllm", "resume"], required=True)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--seed", type=int, default=20261201)
    parser.add_argument("--vllm-cores", default="auto")
    args = parser.parse_args(argv)
    if args.child == "resume":
        result = asyncio.run(_resume_trials(args.model_dir, args.tokens, args.trials, args.seed))
    else:
        result = asyncio.run(_measure(args.child, args.model_dir, args.tokens, args.rounds, born, args.vllm_cores))
    print("RESULT " + json.dumps(result), flush=True)
    return 0


# --- the parent: runs the children, judges the goals ----------------------------------------
def _run_child(kind: str, model_dir: Path, args) -> dict:
    command = [
        sys.executable,
        "-m",
        "bench.engines",
        "--child",
        kind,
        "--model-dir",
        str(model_dir),
        "--tokens",
        str(args.tokens),
        "--rounds",
        str(args.rounds),
        "--trials",
        str(args.trials),
        "--vllm-cores",
        args.vllm_cores,
    ]
    print(f"[{kind}] running ...", flush=True)
    env = {**os.environ, "BALLAST_BENCH_BORN": repr(time.time())}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise RuntimeError(f"the {kind} child failed (exit {done.returncode})")
    return json.loads(lines[-1].removeprefix("RESULT "))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--child" in argv:
        return child_main(argv)
    from bench.common import model_dir_for, print_table, write_result
    from bench.goals import HIGHER, Goal, judge, print_goals

    GOALS = (
        Goal("vLLM resumes exact, greedy", "resume_exact_greedy_share", 1.0, HIGHER),
        Goal("vLLM resumes exact, seeded", "resume_exact_seeded_share", 1.0, HIGHER),
        Goal("vLLM tokens/s over torch's at 16 streams", "vllm_over_torch_tokens_per_s_at_16", 1.0, HIGHER, "x"),
    )

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", choices=["tiny", "bench"])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--out", type=Path, default=Path("bench/results/engines.json"))
    parser.add_argument(
        "--vllm-cores",
        default="auto",
        help="VLLM_CPU_OMP_THREADS_BIND of the measured vLLM engine (auto: vLLM's choice)",
    )
    args = parser.parse_args(argv)
    model_dir = model_dir_for(args.preset)
    engines = {kind: _run_child(kind, model_dir, args) for kind in ("torch", "vllm")}
    resume = _run_child("resume", model_dir, args)

    rows = []
    for kind, result in engines.items():
        for n, level in result["concurrency"].items():
            rows.append(
                [
                    kind,
                    n,
                    level["ttft_p50_ms"],
                    level["ttft_p99_ms"],
                    level["tokens_per_s"],
                    result["start_s"],
                    result["rss_bytes"] / (1 << 20),
                ]
            )
    print(f"\nengines on the {args.preset} model ({args.tokens} tokens per stream, median of {args.rounds} rounds)")
    print_table(["engine", "streams", "TTFT p50 ms", "TTFT p99 ms", "tokens/s", "start s", "RSS MiB"], rows)
    print(
        f"vLLM itself (AsyncLLM, no Ballast engine around it) at {max(CONCURRENCY)} streams: "
        f"{engines['vllm']['raw_vllm_tokens_per_s_at_16']:.0f} tokens/s"
    )
    print_table(["vLLM resume", "exact", "trials"], [[mode, r["exact"], r["trials"]] for mode, r in resume.items()])

    top = str(max(CONCURRENCY))
    result = {
        "preset": args.preset,
        "tokens_per_stream": args.tokens,
        "rounds": args.rounds,
        "engine": "torch and vllm (vllm-cpu) in turn",
        "engines": {
            kind: {"start_s": r["start_s"], "rss_bytes": r["rss_bytes"], **r["concurrency"]}
            for kind, r in engines.items()
        },
        "raw_vllm_tokens_per_s_at_16": engines["vllm"]["raw_vllm_tokens_per_s_at_16"],
        "vllm_resume_exact_greedy": resume["greedy"]["exact"],
        "vllm_resume_exact_seeded": resume["seeded"]["exact"],
        "vllm_resume_trials": args.trials,
        "vllm_resume_mismatches": {mode: r["mismatches"] for mode, r in resume.items()},
    }
    measured = {
        "resume_exact_greedy_share": resume["greedy"]["exact"] / max(1, resume["greedy"]["trials"]),
        "resume_exact_seeded_share": resume["seeded"]["exact"] / max(1, resume["seeded"]["trials"]),
        # Each level's tokens/s is already the median of its rounds.
        "vllm_over_torch_tokens_per_s_at_16": engines["vllm"]["concurrency"][top]["tokens_per_s"]
        / engines["torch"]["concurrency"][top]["tokens_per_s"],
    }
    result.update(measured)
    result.update(judge(GOALS, measured))
    print_goals(result)
    print(f"wrote {write_result(args.out, result)}")
    return 0 if result["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
