"""Degraded answers beside the better answers the backfill delivers later, judged outside Ballast.

The degradation ladder of `make up` answers from the light pool (the tiny model Ballast builds)
and then the rule engine when the primary pool (SmolLM2-135M-Instruct) cannot; the backfill
later replays the request on SmolLM2 and delivers that answer. This benchmark asks each rung
the same customer questions (greedy, as a replay is) and judges every answer two ways, neither
of them Ballast's own code:

- entities: the share of the question's named things (an order number, a product) the answer
  mentions, by plain case-folded substring match: an answer about "order 48213" should say so;
- likelihood: SmolLM2's mean log-probability per token of the answer as a reply to the
  question (transformers' implementation, not Ballast's engine). It favours SmolLM2's own
  greedy answers, which is why it is not the only judge; its use here is to show how far the
  light model's and the rules' answers are from what a trained model would say.

Goals, judged in code: the backfilled answers at least match each degraded rung on both judges
(means over the questions). Prints a table and writes bench/results/answer_quality.json.

    python -m bench.answer_quality [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

from bench.common import model_dir_for, print_table, write_result
from bench.goals import HIGHER, Goal, judge, print_goals

# (question, the things in it a right answer names)
QUESTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Where is my order 48213? It should have arrived on Monday.", ("48213",)),
    ("I was charged twice for the headphones. Can you refund one payment?", ("headphones", "refund")),
    ("Can I return the blue jacket I bought last week?", ("jacket", "return")),
    ("Is the coffee maker in stock?", ("coffee maker", "stock")),
    ("My order 77120 arrived damaged. What should I do?", ("77120", "damaged")),
    ("How do I change the delivery address of order 5531?", ("5531", "address")),
    ("Do you ship to Canada?", ("canada", "ship")),
    ("What is your return policy for shoes?", ("return", "shoes")),
    ("Can I pay for my order with PayPal?", ("paypal",)),
    ("How long does delivery to London take?", ("london", "deliver")),
    ("I forgot my password. How can I log in to my account?", ("password", "account")),
    ("Cancel order 66102, please. I ordered the wrong size.", ("66102", "cancel")),
)
RUNGS = ("rules", "light", "backfilled")
GOALS = tuple(
    Goal(
        f"backfilled answers at least match the {rung} rung on {judge_name}",
        f"margin_{judge_name}_over_{rung}",
        0.0,
        HIGHER,
    )
    for rung in ("rules", "light")
    for judge_name in ("entities", "likelihood")
)


def entity_share(answer: str, entities: tuple[str, ...]) -> float:
    folded = answer.casefold()
    return sum(entity in folded for entity in entities) / len(entities)


async def _engine_answers(model_dir: Path, name: str, max_tokens: int) -> list[str]:
    """Greedy answers of the torch engine serving `model_dir`, each prompt rendered with the
    folder's own chat template, as the router renders it."""
    import jinja2.sandbox
    from tokenizers import Tokenizer

    from services.common.generation import Sampling
    from services.worker.engine import EngineRequest
    from services.worker.model_files import describe_model
    from services.worker.torch.engine import TorchEngine

    described = describe_model(model_dir, name)
    template = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(
        described.chat_template
    )
    tokenizer = Tokenizer.from_str(described.tokenizer_json.decode())
    engine = TorchEngine(model_dir, name, max_concurrency=4, device="cpu")
    await engine.start()
    try:

        async def one(question: str) -> str:
            text = template.render(
                messages=[{"role": "user", "content": question}],
                add_generation_prompt=True,
                bos_token=described.bos_token,
                eos_token=described.eos_token,
            )
            ids = tuple(tokenizer.encode(text, add_special_tokens=False).ids)
            request = EngineRequest(
                f"quality-{hash(question)}", ids, (), Sampling(temperature=0.0, max_tokens=max_tokens)
            )
            return "".join([delta.text async for delta in engine.generate(request)])

        return list(await asyncio.gather(*(one(q) for q, _ in QUESTIONS)))
    finally:
        await engine.stop()


def _rules_answers() -> list[str]:
    from services.router.degrade.rules import RuleEngine

    rules = RuleEngine.default_rules()
    return [rules.answer(question).text for question, _ in QUESTIONS]


class Likelihood:
    """SmolLM2's mean log-probability per token of an answer to a question (transformers)."""

    def __init__(self, model_dir: Path) -> None:
        import torch
        from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

        self.torch = torch
        self.model = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self.tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
        self.template = (Path(model_dir) / "chat_template.jinja").read_text()

    def __call__(self, question: str, answer: str) -> float:
        torch = self.torch
        prompt = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": question}],
            chat_template=self.template,
            tokenize=False,
            add_generation_prompt=True,
        )
        prompt_ids = self.tokenizer(prompt).input_ids
        answer_ids = self.tokenizer(answer).input_ids
        if not answer_ids:
            return float("-inf")
        ids = torch.tensor([prompt_ids + answer_ids])
        with torch.inference_mode():
            logits = self.model(ids).logits[0, len(prompt_ids) - 1 : -1]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        picked = logprobs.gather(1, torch.tensor(answer_ids).unsqueeze(1))
        return float(picked.mean())


def run_benchmark(max_tokens: int, out: Path) -> int:
    import torch

    torch.set_num_threads(1)  # a second intra-op thread only adds spinning on 2 shared cores
    started = time.perf_counter()
    smollm2_dir, tiny_dir = model_dir_for("smollm2"), model_dir_for("tiny")
    answers = {
        "rules": _rules_answers(),
        "light": asyncio.run(_engine_answers(tiny_dir, "tiny", max_tokens)),
        "backfilled": asyncio.run(_engine_answers(smollm2_dir, "smollm2", max_tokens)),
    }
    likelihood = Likelihood(smollm2_dir)
    rows = []
    for i, (question, entities) in enumerate(QUESTIONS):
        row: dict = {"question": question, "entities": list(entities)}
        for rung in RUNGS:
            row[rung] = {
                "answer": answers[rung][i],
                "entities": entity_share(answers[rung][i], entities),
                "likelihood": likelihood(question, answers[rung][i]),
            }
        rows.append(row)
    means = {
        rung: {
            judge_name: statistics.fmean(r[rung][judge_name] for r in rows) for judge_name in ("entities", "likelihood")
        }
        for rung in RUNGS
    }
    result: dict = {
        "model": "smollm2 (backfilled) vs tiny (light) vs rules",
        "engine": "torch (in process)",
        "max_tokens": max_tokens,
        "questions": len(QUESTIONS),
        "means": means,
        "rows": rows,
    }
    for rung in ("rules", "light"):
        for judge_name in ("entities", "likelihood"):
            result[f"margin_{judge_name}_over_{rung}"] = means["backfilled"][judge_name] - means[rung][judge_name]
    result["seconds"] = time.perf_counter() - started
    print(f"\n{len(QUESTIONS)} questions; each answer judged by entity mentions and SmolLM2's likelihood")
    print_table(
        ["rung", "entities (share named)", "likelihood (mean log-prob/token)"],
        [[rung, means[rung]["entities"], means[rung]["likelihood"]] for rung in RUNGS],
    )
    print("\nfirst question:", QUESTIONS[0][0])
    for rung in RUNGS:
        print(f"  {rung:>10}: {answers[rung][0]!r}")
    result.update(judge(GOALS, result))
    print_goals(result)
    print(f"wrote {write_result(out, result)}")
    return 0 if result["met"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--quick", action="store_true", help="the same run (it is short already)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/answer_quality.json"))
    args = parser.parse_args(argv)
    return run_benchmark(args.max_tokens, args.out)


if __name__ == "__main__":
    sys.exit(main())
