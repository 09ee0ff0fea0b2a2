"""The rule engine: matching, slots, Chinese, streaming pieces, and bad files named by line."""

from __future__ import annotations

import textwrap

import pytest

from services.router.degrade.rules import RuleEngine, RulesError, request_text, split_pieces, stream_text
from services.router.requests import Message

MINIMAL = textwrap.dedent("""\
    version: 1
    slots:
      product:
        words: [phone case, phone, 手机壳]
        default: {en: "item", zh: "商品"}
    intents:
      - name: stock
        keywords: [in stock, 有货]
        answer:
          en: "Stock of the {product} is on its page."
          zh: "{product}的库存以页面为准。"
      - name: order
        patterns: ['order\\s*#?(?P<order_id>\\d{4,})']
        answer: "Order {order_id} is on its way."
    default:
      answer: "Saved; a full answer follows."
    """)


def engine(text: str = MINIMAL) -> RuleEngine:
    return RuleEngine.from_text(text, "rules.yaml")


def test_keyword_match_fills_the_slot_with_the_longest_word():
    answer = engine().answer("Is the blue phone case in stock?")
    assert answer.intent == "stock" and answer.matched
    assert answer.text == "Stock of the phone case is on its page."


def test_slot_default_when_no_word_is_there():
    assert engine().answer("anything in stock?").text == "Stock of the item is on its page."


def test_named_group_of_a_pattern_is_a_slot():
    answer = engine().answer("where is order #123456")
    assert answer.intent == "order" and answer.text == "Order 123456 is on its way."


def test_no_match_gives_the_default_answer():
    answer = engine().answer("hello")
    assert answer.intent == "default" and not answer.matched
    assert answer.text == "Saved; a full answer follows."


def test_chinese_text_gets_the_chinese_answer():
    answer = engine().answer("手机壳还有货吗？")
    assert answer.intent == "stock" and answer.language == "zh"
    assert answer.text == "手机壳的库存以页面为准。"


def test_full_width_and_case_are_normalised():
    assert engine().answer("ＩＮ ＳＴＯＣＫ?").intent == "stock"


def test_ascii_keywords_match_whole_words_only():
    text = MINIMAL.replace("[in stock, 有货]", "[price, 有货]")
    assert engine(text).answer("a priceless answer").intent == "default"
    assert engine(text).answer("what price?").intent == "stock"


def test_priority_then_hits_then_file_order():
    text = textwrap.dedent("""\
        intents:
          - {name: a, keywords: [refund], answer: A}
          - {name: b, keywords: [refund, broken], answer: B}
          - {name: c, keywords: [refund], priority: 5, answer: C}
        default: {answer: D}
        """)
    rules = engine(text)
    assert rules.answer("refund please, it is broken").intent == "c"
    assert engine(text.replace("priority: 5", "priority: 0")).answer("refund, broken").intent == "b"
    assert engine(text.replace("priority: 5", "priority: 0")).answer("refund").intent == "a"


def test_bundled_intents_cover_english_and_chinese():
    rules = RuleEngine.default_rules()
    cases = {
        "Where is my order #12345?": "order_status",
        "我的订单到哪了": "order_status",
        "I want a refund for the charger": "refund",
        "我要退款": "refund",
        "How much is the laptop?": "price",
        "耳机多少钱": "price",
        "Is the watch in stock?": "stock",
        "手机壳有货吗": "stock",
        "My card declined at payment": "payment",
        "支付失败了怎么办": "payment",
        "hello": "fallback",
    }
    for text, intent in cases.items():
        assert rules.answer(text).intent == intent, text
    assert "charger" in rules.answer("I want a refund for the charger").text
    assert "耳机" in rules.answer("耳机多少钱").text
    assert "12345" in rules.answer("Where is my order #12345?").text


def test_request_text_reads_the_last_user_message():
    class Request:
        messages = (
            Message("system", "be brief"),
            Message("user", "first"),
            Message("assistant", "ok"),
            Message("user", "is it in stock?"),
            Message("assistant", "…"),
        )
        prompt = None

    assert request_text(Request()) == "is it in stock?"


def test_pieces_rebuild_the_text_and_split_chinese_by_characters():
    text = "We are busy right now, so here is a quick answer."
    pieces = split_pieces(text, 8)
    assert "".join(pieces) == text and len(pieces) > 3
    chinese = "当前咨询量较大，先为您简要说明。"
    assert "".join(split_pieces(chinese, 4)) == chinese
    assert all(len(p) <= 5 for p in split_pieces(chinese, 4))


async def test_stream_text_yields_every_piece():
    pieces = [p async for p in stream_text("one two three four five six", 6)]
    assert "".join(pieces) == "one two three four five six" and len(pieces) > 1


@pytest.mark.parametrize(
    ("text", "line", "fragment"),
    [
        (
            "intents:\n  - name: a\n    keywords: [x]\n    answer: 'hi {nope}'\ndefault: {answer: d}\n",
            4,
            "unknown slot {nope}",
        ),
        (
            "intents:\n  - name: a\n    patterns: ['(unclosed']\n    answer: hi\ndefault: {answer: d}\n",
            3,
            "invalid regular expression",
        ),
        (
            "intents:\n  - name: a\n    keywords: [x]\n    answer: hi\n    colour: red\ndefault: {answer: d}\n",
            5,
            "unknown field 'colour'",
        ),
        ("intents:\n  - name: a\n    answer: hi\ndefault: {answer: d}\n", 2, "needs 'keywords' or 'patterns'"),
        (
            "intents:\n  - {name: a, keywords: [x], answer: hi}\n  - {name: a, keywords: [y], answer: ho}\ndefault: {answer: d}\n",
            3,
            "already used on line 2",
        ),
        ("intents: []\n", 1, "'default' answer is required"),
        ("version: 1\nversion: 2\ndefault: {answer: d}\n", 2, "duplicate key 'version'"),
        ("default:\n  answer: [a, b\n", 3, ""),
        ("slots:\n  product: {words: [a], pattern: b}\ndefault: {answer: d}\n", 2, "exactly one of"),
        (
            "intents:\n  - name: a\n    keywords: [x]\n    priority: high\n    answer: hi\ndefault: {answer: d}\n",
            4,
            "priority",
        ),
        (
            "intents:\n  - name: a\n    keywords: [x]\n    answer: 'hi {product!r}'\ndefault: {answer: d}\n",
            4,
            "plain name",
        ),
    ],
)
def test_bad_files_are_rejected_naming_the_line(text, line, fragment):
    with pytest.raises(RulesError) as caught:
        RuleEngine.from_text(text, "bad.yaml")
    message = str(caught.value)
    assert message.startswith(f"bad.yaml:{line}:"), message
    assert fragment in message


def test_unreadable_file_names_the_path(tmp_path):
    with pytest.raises(RulesError, match="missing.yaml"):
        RuleEngine.from_file(tmp_path / "missing.yaml")
