"""The rules every engine follows for guided decoding (services.worker.guided): resumed ids
that leave the schema's grammar are refused as bad input, and a document ends at the token
that completes it (only EOS could follow) or at an EOS chosen while it is complete."""

from __future__ import annotations

import json

import pytest

from services.common.errors import InvalidArgument
from services.worker.guided import DocumentEnd, document_end
from tests.unit.test_guided import EOS, compiler, encode, tokenizer  # noqa: F401  (fixtures)

ORDER = {
    "type": "object",
    "properties": {"order": {"type": "integer"}, "status": {"enum": ["late", "shipped"]}},
    "required": ["order", "status"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("sent", ["hello", '{"order":1,"colour"', '{"order":1,"status":"late"}x'])
def test_resumed_ids_that_leave_the_grammar_are_invalid_arguments(compiler, tokenizer, sent):
    with pytest.raises(InvalidArgument) as caught:
        compiler.for_request(json.dumps(ORDER), encode(tokenizer, sent))
    assert caught.value.retriable is False
    assert "response_format" in caught.value.message


def test_resumed_ids_that_fit_continue_the_grammar(compiler, tokenizer):
    ids = encode(tokenizer, '{"order":12,')
    guide = compiler.for_request(json.dumps(ORDER), ids)
    assert guide.consumed == len(ids) and not guide.accepting


def test_a_document_ends_at_the_token_that_completes_it(compiler, tokenizer):
    guide = compiler.for_request(json.dumps(ORDER))
    ends = []
    for token in encode(tokenizer, '{"order":12,"status":"late"}'):
        guide.advance(token)
        ends.append(document_end(guide, token))
    assert ends[-1] is DocumentEnd.COMPLETE and set(ends[:-1]) == {None}


def test_an_eos_in_an_accepting_state_ends_the_document_before_it(compiler, tokenizer):
    guide = compiler.for_request(json.dumps({"type": "integer"}), encode(tokenizer, "12"))
    assert guide.accepting and not guide.finished  # more digits could follow
    [digit] = encode(tokenizer, "3")
    guide.advance(digit)
    assert document_end(guide, digit) is None
    guide.advance(EOS[1])
    assert document_end(guide, EOS[1]) is DocumentEnd.AT_EOS


def test_an_eos_before_the_document_is_complete_does_not_fit(compiler):
    from services.worker.guided import GuideMismatch

    guide = compiler.for_request(json.dumps(ORDER))
    with pytest.raises(GuideMismatch):
        guide.advance(EOS[0])
