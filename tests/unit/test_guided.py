"""JsonGuide on the tiny model's tokenizer, without the model: masks, advancing, fast-forward
for resumed streams, completion, errors, and random walks through the mask that can only
ever end in schema-valid JSON."""

from __future__ import annotations

import json
import random

import pytest
import torch

from services.common.errors import InvalidArgument
from services.router.structured import Status, check_schema, repair
from services.worker.guided import GuideCompiler, GuideMismatch
from services.worker.tiny_model import corpus, train_tokenizer

EOS = (3, 1)
PRODUCT = {
    "type": "object",
    "properties": {
        "product_id": {"type": "string", "maxLength": 12},
        "price": {"type": "number"},
        "stock_status": {"enum": ["in_stock", "out_of_stock", "preorder"]},
    },
    "required": ["product_id", "price", "stock_status"],
    "additionalProperties": False,
}
SCHEMAS = {
    "product": PRODUCT,
    "flags": {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    },
    "list": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
    "nested": {
        "type": "object",
        "properties": {
            "c": {
                "type": "object",
                "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,5}$"}},
                "required": ["name"],
                "additionalProperties": False,
            }
        },
        "required": ["c"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(corpus(), 512)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GuideCompiler(tokenizer.to_str(), 512, EOS)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def allowed_text(tokenizer, guide) -> set[str]:
    return {tokenizer.decode([i]) for i in torch.nonzero(guide.mask()).flatten().tolist()}


def test_the_first_step_allows_only_an_opening_brace(compiler, tokenizer):
    guide = compiler.guide(json.dumps(PRODUCT))
    mask = guide.mask()
    assert mask.dtype == torch.bool and mask.shape == (512,)
    assert all(text.startswith("{") for text in allowed_text(tokenizer, guide))
    assert not guide.accepting and not guide.eos_allowed


def test_a_valid_document_is_accepted_then_only_eos_may_follow(compiler, tokenizer):
    guide = compiler.guide(PRODUCT)
    for token in encode(tokenizer, '{"product_id":"P-1","price":39,"stock_status":"in_stock"}'):
        assert guide.mask()[token]
        guide.advance(token)
    assert guide.accepting and guide.finished and guide.eos_allowed
    assert set(torch.nonzero(guide.mask()).flatten().tolist()) == set(EOS)


def test_a_number_at_the_end_may_go_on_or_stop(compiler, tokenizer):
    guide = compiler.guide({"type": "integer"})
    guide.fast_forward(encode(tokenizer, "12"))
    assert guide.accepting and not guide.finished and guide.eos_allowed
    assert any(guide.mask()[t] for t in encode(tokenizer, "3"))


def test_apply_masks_logits_including_ids_past_the_vocabulary(compiler):
    guide = compiler.guide(PRODUCT)
    logits = torch.zeros(600, dtype=torch.float16)
    out = guide.apply(logits)
    assert out.dtype == torch.float32 and out.shape == (600,) and logits.abs().sum() == 0
    assert torch.equal(torch.isfinite(out[:512]), guide.mask())
    assert torch.isinf(out[512:]).all()


def test_fast_forward_reaches_the_same_state_as_step_by_step(compiler, tokenizer):
    ids = encode(tokenizer, '{"product_id":"ab c","price":1')
    stepped = compiler.guide(PRODUCT)
    for token in ids:
        stepped.advance(token)
    resumed = compiler.guide(PRODUCT, generated_ids=ids)
    assert resumed.consumed == stepped.consumed == len(ids)
    assert torch.equal(resumed.mask(), stepped.mask())


def test_tokens_outside_the_grammar_are_refused_with_their_position(compiler, tokenizer):
    with pytest.raises(GuideMismatch) as caught:
        compiler.guide(PRODUCT, generated_ids=encode(tokenizer, '{"product_id":"x","colour":"red"}'))
    assert caught.value.index > 0
    guide = compiler.guide(PRODUCT)
    with pytest.raises(GuideMismatch):
        guide.advance(EOS[0])  # EOS before the document is complete


def test_guides_from_one_compiled_schema_are_independent(compiler, tokenizer):
    a, b = compiler.guide(PRODUCT), compiler.guide(PRODUCT)
    a.fast_forward(encode(tokenizer, '{"product_id":'))
    assert not torch.equal(a.mask(), b.mask())


@pytest.mark.parametrize(
    "schema, words",
    [
        ({"not": {"type": "string"}}, ["guided decoding", "not"]),
        ({"type": "integer", "minimum": 5, "maximum": 3}, ["Unsatisfiable"]),
        ("{nope", ["guided decoding"]),
    ],
)
def test_schemas_that_cannot_be_guided_are_invalid_arguments(compiler, schema, words):
    with pytest.raises(InvalidArgument) as caught:
        compiler.guide(schema)
    for word in words:
        assert word in caught.value.message


def test_from_model_dir_reads_vocab_and_eos(tmp_path, tokenizer):
    (tmp_path / "tokenizer.json").write_text(tokenizer.to_str())
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 520, "eos_token_id": 3}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 1]}))
    compiler = GuideCompiler.from_model_dir(tmp_path)
    assert compiler.vocab_size == 520 and compiler.eos_token_ids == (3, 1)
    assert compiler.guide(PRODUCT).mask().shape == (520,)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_random_walks_through_the_mask_yield_valid_json(compiler, tokenizer, name):
    """Any token the mask allows keeps the output on the grammar: a walk that ends with EOS is
    valid as is; one cut by the step limit is repaired into a valid document."""
    schema = check_schema(json.dumps(SCHEMAS[name]))
    rng = random.Random(name)
    outcomes = set()
    for _ in range(25):
        guide = compiler.guide(schema.text)
        ids: list[int] = []
        for _step in range(rng.choice((8, 40, 200))):
            allowed = torch.nonzero(guide.mask()).flatten().tolist()
            # Prefer EOS when allowed half the time, so walks end both ways.
            token = next((t for t in EOS if t in allowed), None) if rng.random() < 0.5 else None
            token = rng.choice(allowed) if token is None else token
            guide.advance(token)
            if token in EOS:
                break
            ids.append(token)
        text = tokenizer.decode(ids)
        if guide.accepting:
            assert schema.is_valid(json.loads(text)), text
            outcomes.add("complete")
        else:
            result = repair(text, schema)
            outcomes.add(result.status)
            # A string cut before its pattern is satisfied ("nested") has no safe repair.
            assert result.status is not Status.FAILED or name == "nested", (text, result.errors)
    assert "complete" in outcomes
