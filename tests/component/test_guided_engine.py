"""Guided decoding on the tiny model (which cannot write JSON by itself) in a minimal decode
loop: every finished output is schema-valid JSON over many seeds and schemas, an output cut by
max_tokens is repaired by the router's repair step, and a guide rebuilt from already generated
ids continues the same grammar, token for token."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.router.structured import RepairKind, Status, check_schema, repair
from services.worker.guided import DocumentEnd, GuideCompiler, JsonGuide, document_end
from services.worker.sampling import position_generator, select_token
from services.worker.tiny_model import render_chat
from tests.model_fixtures import tiny_model_dir  # noqa: F401

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
    "product_short_id": {
        **PRODUCT,
        "properties": {**PRODUCT["properties"], "product_id": {"type": "string", "maxLength": 10}},
    },
    "order": {
        "type": "object",
        "properties": {
            "order_id": {"type": "integer"},
            "status": {"enum": ["pending", "shipped", "delivered"]},
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
                "properties": {"name": {"type": "string", "maxLength": 12}, "vip": {"type": "boolean"}},
                "required": ["name", "vip"],
                "additionalProperties": False,
            },
            "items": {
                "type": "array",
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "maxLength": 6},
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
PROMPT = render_chat(
    [{"role": "user", "content": "Is the phone case in stock? Answer in JSON."}], add_generation_prompt=True
)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # A tiny model gains nothing from a second intra-op thread, and on a busy 2-core machine
    # its spinning workers make every step many times slower.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)


@pytest.fixture(scope="module")
def compiler(tiny_model_dir):
    return GuideCompiler.from_model_dir(tiny_model_dir)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return tokenizer.encode(PROMPT, add_special_tokens=False)


def decode(
    model,
    prompt_ids: list[int],
    guide: JsonGuide | None,
    *,
    max_tokens: int,
    seed: int,
    eos: tuple[int, ...],
    temperature: float = 1.0,
    generated: list[int] = (),
) -> tuple[list[int], str]:
    """Generates after prompt + `generated` the way an engine would, with the guide hook:
    mask the logits, sample with position seeds, advance, stop where `document_end` says."""
    cache, feed, out = None, [*prompt_ids, *generated], []
    with torch.inference_mode():
        for k in range(max_tokens):
            step = model(input_ids=torch.tensor([feed]), past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache = step.past_key_values
            logits = step.logits[0, -1] if guide is None else guide.apply(step.logits[0, -1])
            position = len(generated) + k
            generator = position_generator(seed, position) if temperature else None
            token = select_token(logits, temperature, 1.0, generator)
            end = None
            if guide is not None:
                guide.advance(token)
                end = document_end(guide, token)  # the engines' own end rule
            if token in eos or end is DocumentEnd.AT_EOS:
                return out, "stop"
            out.append(token)
            if end is DocumentEnd.COMPLETE:
                return out, "stop"
            feed = [token]
    return out, "length"


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_guided_output_is_schema_valid_over_many_seeds(model, tokenizer, compiler, prompt_ids, name):
    schema = check_schema(json.dumps(SCHEMAS[name]))
    reasons = []
    for seed in [*range(6), None]:  # None: greedy
        guide = compiler.guide(schema.text)
        ids, reason = decode(
            model,
            prompt_ids,
            guide,
            max_tokens=80,
            seed=seed or 0,
            eos=compiler.eos_token_ids,
            temperature=0.0 if seed is None else 1.0,
        )
        text = tokenizer.decode(ids)
        reasons.append(reason)
        if reason == "stop":
            assert guide.accepting and schema.is_valid(json.loads(text)), text
        else:
            result = repair(text, schema)
            assert result.status in (Status.VALID, Status.REPAIRED), (text, result.errors)
            assert schema.is_valid(json.loads(result.text))
    if name != "product":  # an unbounded string: the tiny model rarely closes it within 80 tokens
        assert "stop" in reasons


@pytest.mark.parametrize("max_tokens", [3, 9, 17, 30])
def test_output_cut_by_max_tokens_is_repaired(model, tokenizer, compiler, prompt_ids, max_tokens):
    schema = check_schema(json.dumps(PRODUCT))
    ids, reason = decode(
        model, prompt_ids, compiler.guide(schema.text), max_tokens=max_tokens, seed=11, eos=compiler.eos_token_ids
    )
    assert reason == "length" and len(ids) == max_tokens
    text = tokenizer.decode(ids)
    with pytest.raises(ValueError):
        json.loads(text)
    result = repair(text, schema)
    assert result.status is Status.REPAIRED, (text, result.errors)
    assert RepairKind.TRUNCATED in {r.kind for r in result.repairs}
    assert schema.is_valid(json.loads(result.text)) and result.messages


@pytest.mark.parametrize("name, split", [("cart", 1), ("cart", 9), ("order", 5), ("product_short_id", 14)])
def test_a_resumed_stream_continues_the_grammar(model, compiler, prompt_ids, name, split):
    schema = json.dumps(SCHEMAS[name])
    eos = compiler.eos_token_ids
    whole, whole_reason = decode(model, prompt_ids, compiler.guide(schema), max_tokens=40, seed=5, eos=eos)
    assert len(whole) > split
    first = whole[:split]
    # Another replica: fresh KV cache, a guide fast-forwarded over what was already sent.
    guide = compiler.guide(schema, generated_ids=first)
    rest, reason = decode(model, prompt_ids, guide, max_tokens=40 - split, seed=5, eos=eos, generated=first)
    assert first + rest == whole and reason == whole_reason


def test_without_guidance_the_tiny_model_writes_no_valid_json(model, tokenizer, prompt_ids, compiler):
    schema = check_schema(json.dumps(PRODUCT))
    for seed in range(3):
        ids, _reason = decode(model, prompt_ids, None, max_tokens=40, seed=seed, eos=compiler.eos_token_ids)
        assert repair(tokenizer.decode(ids), schema).status is Status.FAILED
