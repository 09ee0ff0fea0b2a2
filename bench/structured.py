"""Structured output on SmolLM2-135M-Instruct (or the tiny model): raw vs guided vs
guided+repair vs repair-only.

Generates answers for N requests over a mix of JSON Schemas (a product schema with
product_id / price / stock_status among them) twice, without and with guided decoding
(services.worker.guided), in an in-process batched decode loop, then scores four modes:

- raw: the model's text as is;
- guided: the guided text as is (cut by max_tokens or not);
- guided_repair: the guided text through the router's repair step;
- repair_only: the raw text through the repair step (an engine without guidance).

parse_rate is the share that parses as JSON (for the repair modes: where repair found a
document), schema_valid_rate the share that conforms to its schema (after repair, for the
repair modes). Each answer's fate is reported apart: valid as generated, repaired without
inventing a value, repaired by filling one in (a default, the first enum value, a zero), or
failed; the headline `valid_rate` excludes filled answers, which conform but say what the
model never did. Validity is judged by the `jsonschema` library, not by Ballast's repair.
Whether the values are right is judged only coarsely, on the trained model: the share of
guided answers that carry the number the question names (an order id, say), an entity check
that needs no model. Sampling at temperature 0.7 (the model's chat default). Goal, judged in
code: guided + repair valid (without fills) for at least 99 % of the answers. Also measures the cost
of guidance in tokens/s, batched and one sequence at a time (as the torch engine decodes),
and the guide's own CPU time per token. Prints tables and writes bench/results/structured.json.

    python -m bench.structured [--model smollm2|tiny] [--requests 300] [--batch 25] [--single 2] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.common import model_dir_for, percentile, print_table, write_result
from bench.goals import HIGHER, Goal, judge, print_goals
from services.router.structured import RepairKind, Status, check_schema, repair
from services.worker.guided import GuideCompiler
from services.worker.sampling import position_generator, select_token
from services.worker.tiny_model import CHAT_TEMPLATE

PRODUCT = {
    "type": "object",
    "properties": {
        "product_id": {"type": "string"},
        "price": {"type": "number"},
        "stock_status": {"enum": ["in_stock", "out_of_stock", "preorder"]},
    },
    "required": ["product_id", "price", "stock_status"],
    "additionalProperties": False,
}
SCHEMAS = {
    "product": PRODUCT,
    "product_sku": {
        **PRODUCT,
        "properties": {**PRODUCT["properties"], "product_id": {"type": "string", "pattern": "^P-[0-9]{3,6}$"}},
    },
    "order": {
        "type": "object",
        "properties": {
            "order_id": {"type": "integer"},
            "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
            "gift": {"type": "boolean"},
        },
        "required": ["order_id", "status", "gift"],
        "additionalProperties": False,
    },
    "cart": {
        "type": "object",
        "properties": {
            "customer": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 16}, "vip": {"type": "boolean"}},
                "required": ["name", "vip"],
                "additionalProperties": False,
            },
            "items": {
                "type": "array",
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["customer", "items"],
        "additionalProperties": False,
    },
    "sentiment": {
        "type": "object",
        "properties": {
            "label": {"enum": ["positive", "neutral", "negative"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["label", "confidence"],
        "additionalProperties": False,
    },
}
QUESTIONS = {
    "product": "Is the phone case in stock? Reply in JSON with product_id, price and stock_status.",
    "product_sku": "What does the coffee maker cost? Reply in JSON with product_id, price and stock_status.",
    "order": "Where is my order 48213? Reply in JSON with order_id, status and gift.",
    "cart": "What is in my cart? Reply in JSON with customer and items.",
    "sentiment": "I was charged twice for the headphones! Classify this message in JSON.",
}
# Budgets cycle per batch. On the tiny model some answers are cut by max_tokens on purpose (the
# repair step's work); the trained model writes real values, and its budgets are what a client
# asking for these documents would give (a few are still cut: repair closes them).
MAX_TOKENS = {"tiny": (32, 64, 96), "smollm2": (64, 96, 128)}
MODES = ("raw", "guided", "guided_repair", "repair_only")
GOALS = (Goal("guided + repair answers valid without filled-in values", "guided_repair_valid_rate", 0.99, HIGHER),)


@dataclass
class Generation:
    texts: list[str] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0
    # CPU time of this thread: on a shared machine, wall time also counts other processes.
    cpu_seconds: float = 0.0
    guide_cpu_seconds: float = 0.0
    stopped: int = 0


# The number each question names, which a right answer carries (the order id, say).
ENTITIES = {"order": "48213"}


class Decoder:
    """A batched decode loop over rows that share one prompt, with optional guides per row."""

    def __init__(self, model_dir: Path, temperature: float) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        template_file = Path(model_dir) / "chat_template.jinja"
        self.chat_template = template_file.read_text() if template_file.exists() else CHAT_TEMPLATE
        self.compiler = GuideCompiler.from_model_dir(model_dir)
        self.eos = set(self.compiler.eos_token_ids)
        self.temperature = temperature

    def prompt_ids(self, question: str) -> list[int]:
        chat = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": question}],
            chat_template=self.chat_template,
            tokenize=False,
            add_generation_prompt=True,
        )
        return self.tokenizer.encode(chat, add_special_tokens=False)

    def run(
        self, prompt: list[int], seeds: list[int], max_tokens: int, schema_text: str | None, ignore_eos: bool = False
    ) -> Generation:
        """Generates one row per seed; `ignore_eos` (unguided only) makes every row run to
        max_tokens, so raw and guided throughput compare equal lengths."""
        rows = len(seeds)
        guides = [self.compiler.guide(schema_text) for _ in seeds] if schema_text else None
        outputs: list[list[int]] = [[] for _ in seeds]
        active = [True] * rows
        result = Generation()
        started, cpu_started = time.perf_counter(), time.thread_time()
        feed = torch.tensor([prompt] * rows)
        cache = None
        with torch.inference_mode():
            for position in range(max_tokens):
                step = self.model(input_ids=feed, past_key_values=cache, use_cache=True, logits_to_keep=1)
                cache = step.past_key_values
                nxt = []
                for row in range(rows):
                    token = next(iter(self.eos))
                    if active[row]:
                        logits = step.logits[row, -1]
                        if ignore_eos:
                            logits = logits.clone()
                            logits[list(self.eos)] = float("-inf")
                        if guides:
                            t0 = time.thread_time()
                            logits = guides[row].apply(logits)
                            result.guide_cpu_seconds += time.thread_time() - t0
                        token = select_token(logits, self.temperature, 1.0, position_generator(seeds[row], position))
                        if guides:
                            t0 = time.thread_time()
                            guides[row].advance(token)
                            result.guide_cpu_seconds += time.thread_time() - t0
                        result.tokens += 1
                        if token in self.eos:
                            active[row] = False
                            result.stopped += 1
                        else:
                            outputs[row].append(token)
                            if guides and guides[row].finished:
                                active[row] = False
                                result.stopped += 1
                    nxt.append(token)
                if not any(active):
                    break
                feed = torch.tensor(nxt).unsqueeze(1)
        result.seconds = time.perf_counter() - started
        result.cpu_seconds = time.thread_time() - cpu_started
        result.texts = [self.tokenizer.decode(ids) for ids in outputs]
        result.lengths = [len(ids) for ids in outputs]
        return result


def _strict(text: str, schema) -> tuple[bool, bool]:
    try:
        value = json.loads(text)
    except ValueError:
        return False, False
    return True, schema.is_valid(value)


def _score(texts_by_mode: dict[str, list[tuple[str, object]]]) -> dict:
    """Per mode: parse and schema-valid rates, and for the repair modes each answer's fate:
    valid as generated, repaired without inventing a value, repaired by filling in a value
    the model never wrote (a default, the first enum value, a zero), or failed. The headline
    `valid_rate` counts only the first two: a filled answer conforms but says what the
    model did not."""
    modes = {}
    for mode, items in texts_by_mode.items():
        parsed = valid = 0
        statuses: Counter = Counter()
        kinds: Counter = Counter()
        fates: Counter = Counter()
        for text, schema in items:
            if mode in ("raw", "guided"):
                ok_parse, ok_valid = _strict(text, schema)
                fates["valid_as_generated" if ok_valid else "failed"] += 1
            else:
                result = repair(text, schema)
                statuses[result.status.value] += 1
                kinds.update(r.kind.value for r in result.repairs)
                ok_parse = result.value is not None or result.status is not Status.FAILED
                ok_valid = result.status is not Status.FAILED
                fates[_fate(result)] += 1
            parsed += ok_parse
            valid += ok_valid
        count = max(1, len(items))
        entry = {
            "parse_rate": parsed / count,
            "schema_valid_rate": valid / count,
            "requests": len(items),
            "fates": {fate: fates[fate] for fate in FATES},
            "valid_rate": (fates["valid_as_generated"] + fates["repaired_without_fill"]) / count,
        }
        if statuses:
            entry["statuses"] = dict(statuses)
            entry["repairs_by_kind"] = dict(kinds)
        modes[mode] = entry
    return modes


FATES = ("valid_as_generated", "repaired_without_fill", "repaired_with_fill", "failed")


def _fate(result) -> str:
    if result.status is Status.VALID:
        return "valid_as_generated"
    if result.status is Status.FAILED:
        return "failed"
    filled = any(r.kind is RepairKind.FILLED for r in result.repairs)
    return "repaired_with_fill" if filled else "repaired_without_fill"


def _throughput(decoder: Decoder, batch: int, single: int, max_tokens: int = 64) -> dict:
    """Tokens/s raw vs guided at equal lengths: the raw model with EOS masked, the guided one
    on the product schema (the tiny model never closes its free-text product_id, so it runs
    to max_tokens too). One batch of `batch` rows, and `single` requests one at a time (as
    the torch engine decodes). Wall and CPU time; on a shared machine trust the CPU numbers."""
    schema = check_schema(json.dumps(PRODUCT))
    prompt = decoder.prompt_ids(QUESTIONS["product"])
    out: dict = {}
    for label, rows, runs in (("batched", batch, 1), ("single_sequence", 1, single)):
        if not runs:
            continue
        entry: dict = {"rows": rows, "requests": 2 * rows * runs, "max_tokens": max_tokens}
        sums = {mode: Generation() for mode in ("raw", "guided")}
        # Modes alternate run by run (twice each, order swapped) so load drift on a shared
        # machine hits both alike.
        for run in range(2 * runs):
            order = (("raw", None), ("guided", schema.text))
            for mode, text in order if run % 2 == 0 else order[::-1]:
                gen = decoder.run(
                    prompt, [20_000 + run * rows + r for r in range(rows)], max_tokens, text, ignore_eos=text is None
                )
                total = sums[mode]
                total.tokens += gen.tokens
                total.seconds += gen.seconds
                total.cpu_seconds += gen.cpu_seconds
                total.guide_cpu_seconds += gen.guide_cpu_seconds
        for mode, total in sums.items():
            entry[f"{mode}_tokens_per_s"] = total.tokens / total.seconds
            entry[f"{mode}_tokens_per_cpu_s"] = total.tokens / total.cpu_seconds
        entry["guide_cpu_us_per_token"] = sums["guided"].guide_cpu_seconds / sums["guided"].tokens * 1e6
        entry["guidance_cost"] = 1 - entry["guided_tokens_per_s"] / entry["raw_tokens_per_s"]
        entry["guidance_cpu_cost"] = 1 - entry["guided_tokens_per_cpu_s"] / entry["raw_tokens_per_cpu_s"]
        out[label] = entry
    return out


def _entity_rate(items: list[tuple[str, object]], entity: str) -> float:
    """The share of answers whose parsed document carries `entity` among its values."""
    hits = 0
    for text, _schema in items:
        try:
            value = json.loads(text)
        except ValueError:
            continue
        hits += entity in json.dumps(value)
    return hits / max(1, len(items))


def run_benchmark(
    requests: int, batch: int, out: Path, single: int = 10, model: str = "smollm2", temperature: float = 0.7
) -> int:
    torch.set_num_threads(1)  # a second intra-op thread only adds spinning on 2 shared cores
    decoder = Decoder(model_dir_for(model), temperature)
    schemas = {name: check_schema(json.dumps(doc)) for name, doc in SCHEMAS.items()}
    names = sorted(SCHEMAS)
    texts: dict[str, list[tuple[str, object]]] = {mode: [] for mode in MODES}
    by_schema: dict[str, dict[str, list]] = {n: {m: [] for m in MODES} for n in names}
    stopped = 0
    lengths: dict[str, list[int]] = {"raw": [], "guided": []}
    started = time.perf_counter()
    budgets = MAX_TOKENS[model]
    batches = [list(range(i, min(i + batch, requests))) for i in range(0, requests, batch)]
    for b, ids in enumerate(batches):
        name = names[b % len(names)]
        max_tokens = budgets[(b // len(names)) % len(budgets)]
        schema = schemas[name]
        prompt = decoder.prompt_ids(QUESTIONS[name])
        raw = decoder.run(prompt, ids, max_tokens, None)
        guided = decoder.run(prompt, ids, max_tokens, schema.text)
        stopped += guided.stopped
        lengths["raw"] += raw.lengths
        lengths["guided"] += guided.lengths
        for mode, source in (("raw", raw), ("repair_only", raw), ("guided", guided), ("guided_repair", guided)):
            pairs = [(t, schema) for t in source.texts]
            texts[mode] += pairs
            by_schema[name][mode] += pairs
        print(
            f"batch {b + 1}/{len(batches)}: {name}, max_tokens {max_tokens}, {time.perf_counter() - started:.0f}s",
            flush=True,
        )

    modes = _score(texts)
    schema_rows = {name: _score(per) for name, per in by_schema.items()}
    throughput = _throughput(decoder, batch, single)
    entities = {
        name: {mode: _entity_rate(by_schema[name][mode], entity) for mode in ("raw", "guided")}
        for name, entity in ENTITIES.items()
    }
    result = {
        "model": model,
        "temperature": temperature,
        "entities": entities,
        "requests": requests,
        "schemas": names,
        "max_tokens": list(budgets),
        "modes": modes,
        "by_schema": {
            name: {m: {k: v for k, v in e.items() if k.endswith("rate")} for m, e in per.items()}
            for name, per in schema_rows.items()
        },
        "throughput": throughput,
        "guided_stopped_rate": stopped / requests,
        "answer_tokens": {mode: {"p50": percentile(v, 50), "p99": percentile(v, 99)} for mode, v in lengths.items()},
        "seconds": time.perf_counter() - started,
    }
    print(
        f"\nstructured output: {requests} requests, schemas {', '.join(names)}, model {model}, "
        f"temperature {temperature}"
    )
    print_table(
        ["mode", "parse_rate", "schema_valid_rate", "statuses"],
        [
            [
                m,
                modes[m]["parse_rate"],
                modes[m]["schema_valid_rate"],
                " ".join(f"{k}={v}" for k, v in sorted(modes[m].get("statuses", {}).items())),
            ]
            for m in MODES
        ],
    )
    print()
    print_table(
        ["schema", *(f"{m} valid" for m in MODES)],
        [[n, *(schema_rows[n][m]["schema_valid_rate"] for m in MODES)] for n in names],
    )
    print()
    print_table(
        [
            "decode",
            "raw tok/s",
            "guided tok/s",
            "cost",
            "raw tok/cpu-s",
            "guided tok/cpu-s",
            "cpu cost",
            "guide us/token",
        ],
        [
            [
                f"{label} ({t['rows']} rows)",
                t["raw_tokens_per_s"],
                t["guided_tokens_per_s"],
                t["guidance_cost"],
                t["raw_tokens_per_cpu_s"],
                t["guided_tokens_per_cpu_s"],
                t["guidance_cpu_cost"],
                t["guide_cpu_us_per_token"],
            ]
            for label, t in throughput.items()
        ],
    )
    print(f"guided answers that ended on their own: {result['guided_stopped_rate']:.3f}")
    print_table(
        ["mode", *FATES, "valid (no fills)"],
        [[m, *(modes[m]["fates"][f] for f in FATES), modes[m]["valid_rate"]] for m in MODES],
    )
    for name, rates in entities.items():
        print(
            f"{name} answers carrying the question's {ENTITIES[name]}: raw {rates['raw']:.2f}, "
            f"guided {rates['guided']:.2f}"
        )
    result["engine"] = "torch (in-process batched decode)"
    result["guided_repair_valid_rate"] = modes["guided_repair"]["valid_rate"]
    result.update(judge(GOALS, result))
    print_goals(result)
    print(f"wrote {write_result(out, result)}")
    return 0 if result["met"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        choices=["smollm2", "tiny"],
        default="smollm2",
        help="smollm2 (a trained instruct model) or tiny (Ballast's small untrained-ish model)",
    )
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--batch", type=int, default=25, help="rows decoded together")
    parser.add_argument("--single", type=int, default=2, help="requests for the one-sequence tokens/s check")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--quick", action="store_true", help="50 requests in batches of 10, for a fast check")
    parser.add_argument("--out", type=Path, default=Path("bench/results/structured.json"))
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.batch = 50, 10
    return run_benchmark(args.requests, args.batch, args.out, args.single, args.model, args.temperature)


if __name__ == "__main__":
    sys.exit(main())
