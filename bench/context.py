"""Context retention: entity_aware vs drop_oldest on long conversations (English and Chinese).

The evaluation set is `bench/fixtures/context_cases.json`: support conversations written by
hand, apart from the policies' code, in which one exchange states a fact (a date, an address,
a return code, an allergy, a size, a budget...) and the last message needs it, mostly
without repeating its words; hand-written filler exchanges go before and after it. Every case
is fitted at 30, 40, 50, 60 and 70 % of its tokens with the tiny model's tokenizer and chat
template, with each policy. Retention is the share of fits that keep both messages of the
fact exchange ("kept", not "answered right": the tiny model is untrained, so its answers
cannot be graded). Also reports the time to fit and how much is kept. Goals, judged in code:
entity_aware retains at least 90 % and no less than drop_oldest. Prints a table, writes
bench/results/context.json, exits 1 when a goal is missed.

    python -m bench.context [--cases bench/fixtures/context_cases.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

from bench.common import model_dir_for, percentile, print_table, write_result
from bench.goals import HIGHER, Goal, judge, print_goals
from services.common.generation import Sampling
from services.router.context import ContextPolicy, fit_conversation, retention_rate
from services.router.context.evaluation import RetentionCase, Turn
from services.common.tier import Tier
from services.router.requests import InferenceRequest
from services.router.tokenization import ModelTokenizer
from services.worker.model_files import describe_model

MAX_TOKENS = 64
POLICIES = (ContextPolicy.ENTITY_AWARE, ContextPolicy.DROP_OLDEST)
FRACTIONS = (0.3, 0.4, 0.5, 0.6, 0.7)
CASES = Path(__file__).parent / "fixtures" / "context_cases.json"
GOALS = (
    Goal("entity_aware keeps the needed exchange", "entity_aware_retention", 0.9, HIGHER),
    Goal("entity_aware retention minus drop_oldest's", "retention_gain", 0.0, HIGHER),
)


def load_cases(path: Path) -> list[RetentionCase]:
    """The hand-written set, each case at every fraction of FRACTIONS."""
    data = json.loads(path.read_text(encoding="utf-8"))
    cases = []
    for i, case in enumerate(data["cases"]):
        lang = case["language"]
        pool = data["filler"][lang]
        fillers = [pool[(3 * i + k) % len(pool)] for k in range(case["filler_before"] + case["filler_after"])]
        messages = [Turn("system", data["system"][lang])]
        for question, answer in fillers[: case["filler_before"]]:
            messages += [Turn("user", question), Turn("assistant", answer)]
        needed = (len(messages), len(messages) + 1)
        messages += [Turn("user", case["fact_user"]), Turn("assistant", case["fact_assistant"])]
        for question, answer in fillers[case["filler_before"] :]:
            messages += [Turn("user", question), Turn("assistant", answer)]
        messages.append(Turn("user", case["question"]))
        cases += [RetentionCase(tuple(messages), needed, lang, fraction, case["id"]) for fraction in FRACTIONS]
    return cases


def _encoder(model_dir: Path):
    model = describe_model(model_dir, "tiny")
    tokenizer = ModelTokenizer.from_model_info(
        SimpleNamespace(
            model_version=model.version,
            max_context=model.max_context,
            tokenizer_json=model.tokenizer_json,
            chat_template=model.chat_template,
            bos_token=model.bos_token,
            eos_token=model.eos_token,
        )
    )
    base = InferenceRequest("bench", "", "bench", "tiny", Sampling(MAX_TOKENS), Tier.A)
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


def _shown_path(path: Path) -> str:
    """The evaluation set as a result names it: relative to the repository when inside it, so
    a result says nothing of the machine it ran on."""
    repo = Path(__file__).resolve().parent.parent
    try:
        return str(path.resolve().relative_to(repo))
    except ValueError:
        return path.name


def run_benchmark(cases_path: Path, out: Path) -> int:
    encode = _encoder(model_dir_for("tiny"))
    cases = load_cases(cases_path)
    turns = [len(c.messages) for c in cases]
    results = {}
    for policy in POLICIES:
        retention = retention_rate(cases, encode, policy, max_tokens=MAX_TOKENS)
        results[policy.value] = {
            "retention": retention.rate,
            "by_language": retention.by_language,
            **_fit_stats(cases, encode, policy),
        }
    aware, oldest = results["entity_aware"], results["drop_oldest"]
    result = {
        "cases": len(cases) // len(FRACTIONS),
        "fits_per_policy": len(cases),
        "fractions": list(FRACTIONS),
        "evaluation_set": _shown_path(cases_path),
        "messages_per_conversation": {"min": min(turns), "max": max(turns), "mean": statistics.mean(turns)},
        "entity_aware_retention": aware["retention"],
        "drop_oldest_retention": oldest["retention"],
        "retention_gain": aware["retention"] - oldest["retention"],
        "policies": results,
        "engine": "none (router context fitting, tiny model's tokenizer)",
    }
    print(
        f"\ncontext retention: {result['cases']} hand-written conversations (en + zh), "
        f"{min(turns)}-{max(turns)} messages, each fitted into {', '.join(f'{f:.0%}' for f in FRACTIONS)} "
        "of its tokens"
    )
    print_table(
        ["policy", "retention", "en", "zh", "kept msgs", "kept tokens", "fit p50 ms", "fit p99 ms"],
        [
            [
                name,
                r["retention"],
                r["by_language"].get("en", 0.0),
                r["by_language"].get("zh", 0.0),
                r["kept_message_share"],
                r["kept_token_share"],
                r["fit_ms_p50"],
                r["fit_ms_p99"],
            ]
            for name, r in results.items()
        ],
    )
    result.update(judge(GOALS, result))
    print_goals(result)
    print(f"wrote {write_result(out, result)}")
    return 0 if result["met"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=Path, default=CASES, help="the evaluation set (JSON)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/context.json"))
    args = parser.parse_args(argv)
    return run_benchmark(args.cases, args.out)


if __name__ == "__main__":
    sys.exit(main())
