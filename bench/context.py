"""Context retention: entity_aware vs drop_oldest on long conversations (English and Chinese).

Generates conversations in which an early exchange states a fact (a product's price and id),
many unrelated exchanges follow, and the last user message asks for that fact by name; each
is fitted into 30-70 % of its tokens with the tiny model's tokenizer and chat template.
Retention is the share of conversations whose fact exchange survives. Also reports the time
to fit a conversation and how much of it is kept. Prints a table and writes
bench/results/context.json.

    python -m bench.context [--conversations 400] [--seed 0]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

from bench.common import model_dir_for, percentile, print_table, write_result
from services.common.generation import Sampling
from services.router.context import ContextPolicy, fit_conversation, retention_rate, synthetic_cases
from services.router.requests import InferenceRequest
from services.router.tokenization import ModelTokenizer
from services.worker.model_files import describe_model

MAX_TOKENS = 64
POLICIES = (ContextPolicy.ENTITY_AWARE, ContextPolicy.DROP_OLDEST)


def _encoder(model_dir: Path):
    model = describe_model(model_dir, "tiny")
    tokenizer = ModelTokenizer.from_model_info(SimpleNamespace(
        model_version=model.version, max_context=model.max_context, tokenizer_json=model.tokenizer_json,
        chat_template=model.chat_template, bos_token=model.bos_token, eos_token=model.eos_token))
    base = InferenceRequest("bench", "", "bench", "tiny", Sampling(MAX_TOKENS), "A")
    return lambda messages: tokenizer.encode(replace(base, messages=tuple(messages)))


def _fit_stats(cases, encode, policy: ContextPolicy) -> dict:
    """Per-conversation fit time and the share of messages and tokens kept."""
    times, kept_messages, kept_tokens = [], [], []
    for case in cases:
        total = len(encode(case.messages))
        max_context = int(total * case.context_fraction) + MAX_TOKENS
        started = time.perf_counter()
        fit = fit_conversation(case.messages, encode, max_context=max_context, max_tokens=MAX_TOKENS, policy=policy)
        times.append((time.perf_counter() - started) * 1000)
        kept_messages.append(len(fit.kept) / len(case.messages))
        kept_tokens.append(fit.prompt_tokens / total)
    return {
        "fit_ms_p50": percentile(times, 50),
        "fit_ms_p99": percentile(times, 99),
        "kept_message_share": statistics.mean(kept_messages),
        "kept_token_share": statistics.mean(kept_tokens),
    }


def run_benchmark(conversations: int, seed: int, out: Path) -> int:
    encode = _encoder(model_dir_for("tiny"))
    cases = synthetic_cases(conversations, seed=seed)
    turns = [len(c.messages) for c in cases]
    results = {}
    for policy in POLICIES:
        retention = retention_rate(cases, encode, policy, max_tokens=MAX_TOKENS)
        results[policy.value] = {"retention": retention.rate, "by_language": retention.by_language,
                                 **_fit_stats(cases, encode, policy)}
    aware, oldest = results["entity_aware"], results["drop_oldest"]
    result = {
        "conversations": conversations,
        "seed": seed,
        "messages_per_conversation": {"min": min(turns), "max": max(turns), "mean": statistics.mean(turns)},
        "entity_aware_retention": aware["retention"],
        "drop_oldest_retention": oldest["retention"],
        "policies": results,
    }
    print(f"\ncontext retention: {conversations} conversations (en + zh), "
          f"{min(turns)}-{max(turns)} messages, fitted into 30-70% of their tokens")
    print_table(
        ["policy", "retention", "en", "zh", "kept msgs", "kept tokens", "fit p50 ms", "fit p99 ms"],
        [[name, r["retention"], r["by_language"].get("en", 0.0), r["by_language"].get("zh", 0.0),
          r["kept_message_share"], r["kept_token_share"], r["fit_ms_p50"], r["fit_ms_p99"]]
         for name, r in results.items()])
    print(f"wrote {write_result(out, result)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/context.json"))
    args = parser.parse_args(argv)
    return run_benchmark(args.conversations, args.seed, args.out)


if __name__ == "__main__":
    sys.exit(main())
