"""Fitting conversations into the model's context with the model's tokenizer and chat template:
the policies (error, drop_oldest, entity_aware), max_turns, the Chinese and English
"what was that price again?" cases, and retention on the synthetic evaluation set."""

from __future__ import annotations

import random
from dataclasses import replace
from types import SimpleNamespace

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from services.common.errors import InvalidArgument
from services.common.generation import Sampling
from services.router.context import (
    ContextMetrics,
    ContextPolicy,
    fit_conversation,
    fit_request,
    retention_rate,
    synthetic_cases,
)
from services.router.requests import InferenceRequest, Message
from services.router.tokenization import ModelTokenizer
from services.worker.tiny_model import BOS, CHAT_TEMPLATE, IM_END, corpus, train_tokenizer

MAX_TOKENS = 32


@pytest.fixture(scope="module")
def tokenizer() -> ModelTokenizer:
    # The tiny model's tokenizer and template without building its weights.
    info = SimpleNamespace(
        model_version="test",
        max_context=2048,
        tokenizer_json=train_tokenizer(corpus(), 512).to_str().encode(),
        chat_template=CHAT_TEMPLATE,
        bos_token=BOS,
        eos_token=IM_END,
    )
    return ModelTokenizer.from_model_info(info)


def request(messages, max_tokens: int = MAX_TOKENS) -> InferenceRequest:
    return InferenceRequest("r", "", "t", "tiny", Sampling(max_tokens), "A", messages=tuple(messages))


@pytest.fixture(scope="module")
def encode(tokenizer):
    return lambda messages: tokenizer.encode(request(messages))


def chat(*pairs: tuple[str, str], system: str = "", last: str = "") -> list[Message]:
    out = [Message("system", system)] if system else []
    for q, a in pairs:
        out += [Message("user", q), Message("assistant", a)]
    return out + ([Message("user", last)] if last else [])


ZH_FILLER = [
    ("我的订单{n}在哪里？", "您的订单{n}已经发货，预计三天到达。"),
    ("耳机有货吗？", "有货，耳机的价格是 {p} 元，今天发货。"),
    ("怎么修改收货地址？", "请在发货前打开订单，点击修改地址。"),
    ("可以用微信支付吗？", "可以，结账时支持微信支付。"),
    ("跑步鞋可以退吗？", "跑步鞋可以在七天内退货。"),
    ("咖啡机打折吗？", "咖啡机本周打八折，价格是 {p} 元。"),
]
EN_FILLER = [
    ("Where is my order {n}?", "Your order {n} has shipped and arrives in three days."),
    ("Are the headphones in stock?", "Yes, the headphones are in stock and cost {p} dollars."),
    ("How do I change my delivery address?", "Open your order in the app and tap Change address."),
    ("Can I pay with PayPal?", "Yes, we accept PayPal at checkout."),
    ("Can I return the running shoes?", "You can return the running shoes within 30 days."),
    ("Is the coffee maker on sale?", "The coffee maker is 20% off this week, now {p} dollars."),
]


def filler(templates, count: int, seed: int = 7) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    pairs = []
    for _ in range(count):
        q, a = rng.choice(templates)
        slots = {"n": rng.randrange(10000, 99999), "p": rng.randrange(50, 900)}
        pairs.append((q.format(**slots), a.format(**slots)))
    return pairs


def zh_conversation(turns: int = 30) -> list[Message]:
    return chat(
        ("手机壳多少钱？", "这款手机壳的价格是 39 元，有黑色和白色。"),
        *filler(ZH_FILLER, turns),
        system="你是一个购物客服助手。",
        last="刚才说的手机壳价格是多少",
    )


def en_conversation(turns: int = 30) -> list[Message]:
    return chat(
        ("How much is the phone case?", "The phone case costs 39 dollars, product id PC-2041."),
        *filler(EN_FILLER, turns),
        system="You are a helpful shopping assistant.",
        last="What was the price of the phone case you mentioned?",
    )


def assert_well_formed(fit, messages, max_context: int, encode) -> None:
    assert fit.prompt_tokens + MAX_TOKENS <= max_context
    assert list(fit.prompt_ids) == encode(fit.messages)
    assert fit.messages == tuple(messages[i] for i in fit.kept)
    assert sorted(fit.kept + fit.dropped) == list(range(len(messages)))
    assert fit.messages[0].role == "system" and fit.messages[-1] == messages[-1]
    roles = [m.role for m in fit.messages[1:]]
    # Whole exchanges are dropped, so turns still alternate and every answer keeps its question.
    assert roles == ["user", "assistant"] * (len(roles) // 2) + ["user"]


@pytest.mark.parametrize("make", [zh_conversation, en_conversation], ids=["zh", "en"])
def test_entity_aware_keeps_the_early_price_turn_that_drop_oldest_loses(make, encode):
    messages = make()
    total = len(encode(messages))
    max_context = total // 3 + MAX_TOKENS
    aware = fit_conversation(
        messages, encode, max_context=max_context, max_tokens=MAX_TOKENS, policy=ContextPolicy.ENTITY_AWARE
    )
    assert_well_formed(aware, messages, max_context, encode)
    assert {1, 2} <= set(aware.kept), "the phone case's price turn was dropped"
    assert "39" in "".join(m.content for m in aware.messages)
    assert aware.truncated and aware.original_tokens == total
    # The most recent exchange is kept as well.
    assert len(messages) - 3 in aware.kept and len(messages) - 2 in aware.kept

    oldest = fit_conversation(
        messages, encode, max_context=max_context, max_tokens=MAX_TOKENS, policy=ContextPolicy.DROP_OLDEST
    )
    assert_well_formed(oldest, messages, max_context, encode)
    assert {1, 2} <= set(oldest.dropped)
    assert "39 " not in "".join(m.content for m in oldest.messages)
    # drop_oldest keeps a contiguous tail of exchanges.
    assert list(oldest.kept[1:]) == list(range(oldest.kept[1], len(messages)))


def test_a_conversation_that_fits_is_sent_whole(encode):
    messages = zh_conversation(3)
    fit = fit_conversation(messages, encode, max_context=2048, max_tokens=MAX_TOKENS)
    assert not fit.truncated and fit.messages == tuple(messages)
    assert list(fit.prompt_ids) == encode(messages)


def test_error_policy_reports_the_counts(encode):
    messages = en_conversation(10)
    total = len(encode(messages))
    with pytest.raises(InvalidArgument) as caught:
        fit_conversation(messages, encode, max_context=total + 10, max_tokens=MAX_TOKENS, policy=ContextPolicy.ERROR)
    message = caught.value.message
    assert f"conversation is {total} tokens" in message and f"max_tokens {MAX_TOKENS}" in message
    assert f"context of {total + 10} tokens" in message


def test_nothing_fits_when_the_latest_turn_alone_is_too_long(encode):
    messages = chat(("hi", "hello"), system="You are a helpful shopping assistant.", last="phone case " * 200)
    with pytest.raises(InvalidArgument, match="latest turn alone"):
        fit_conversation(messages, encode, max_context=100, max_tokens=MAX_TOKENS)


def test_max_turns_caps_the_conversation(encode):
    messages = en_conversation(8)  # 1 system + 17 exchanges' worth of turns
    last_four = fit_conversation(
        messages, encode, max_context=2048, max_tokens=MAX_TOKENS, policy=ContextPolicy.DROP_OLDEST, max_turns=5
    )
    assert [i for i in last_four.kept if i] == list(range(len(messages) - 5, len(messages)))
    aware = fit_conversation(messages, encode, max_context=2048, max_tokens=MAX_TOKENS, max_turns=5)
    assert {0, 1, 2} <= set(aware.kept) and len(aware.kept) - 1 <= 5
    with pytest.raises(InvalidArgument, match="max_turns is 5"):
        fit_conversation(
            messages, encode, max_context=2048, max_tokens=MAX_TOKENS, policy=ContextPolicy.ERROR, max_turns=5
        )
    with pytest.raises(InvalidArgument):
        fit_conversation(messages, encode, max_context=2048, max_tokens=MAX_TOKENS, max_turns=0)


def test_a_follow_up_without_names_keeps_the_exchange_before_it(encode):
    messages = chat(
        *filler(EN_FILLER, 12),
        ("Do you sell the desk lamp?", "Yes, the desk lamp is 25 dollars."),
        system="You are a helpful shopping assistant.",
        last="Is it available in white?",
    )
    max_context = len(encode(messages)) // 3 + MAX_TOKENS
    fit = fit_conversation(messages, encode, max_context=max_context, max_tokens=MAX_TOKENS)
    assert {len(messages) - 3, len(messages) - 2} <= set(fit.kept)


def test_fit_request_uses_the_model_context_and_rewrites_the_request(tokenizer):
    messages = zh_conversation()
    small = replace(tokenizer, max_context=len(tokenizer.encode(request(messages))) // 3 + MAX_TOKENS)
    fitted, fit = fit_request(request(messages), small, policy=ContextPolicy.ENTITY_AWARE)
    assert fit.truncated and fitted.messages == fit.messages
    assert small.encode(fitted) == list(fit.prompt_ids)
    prompt = InferenceRequest("r", "", "t", "tiny", Sampling(MAX_TOKENS), "A", prompt="phone case " * 400)
    with pytest.raises(InvalidArgument, match="exceeds the model's context"):
        fit_request(prompt, small)
    short = replace(prompt, prompt="phone case")
    same, fit = fit_request(short, small)
    assert same is short and list(fit.prompt_ids) == small.encode(short) and not fit.truncated


def test_policy_names():
    assert ContextPolicy.parse("") is ContextPolicy.ENTITY_AWARE
    assert ContextPolicy.parse("drop_oldest") is ContextPolicy.DROP_OLDEST
    with pytest.raises(InvalidArgument, match="entity_aware"):
        ContextPolicy.parse("newest")


def test_retention_on_the_evaluation_set(encode):
    cases = synthetic_cases(24, seed=3)
    assert cases == synthetic_cases(24, seed=3)
    assert {c.language for c in cases} == {"en", "zh"}
    aware = retention_rate(cases, encode, ContextPolicy.ENTITY_AWARE)
    oldest = retention_rate(cases, encode, ContextPolicy.DROP_OLDEST)
    assert aware.rate >= 0.9 and aware.by_language["zh"] >= 0.9
    assert oldest.rate < aware.rate


def test_metrics_count_truncations_and_publish_retention(encode):
    reader = InMemoryMetricReader()
    metrics = ContextMetrics(MeterProvider(metric_readers=[reader]).get_meter("test"))
    messages = en_conversation()
    fit = fit_conversation(messages, encode, max_context=len(encode(messages)) // 2, max_tokens=MAX_TOKENS)
    metrics.record(fit, model="tiny")
    metrics.record(fit_conversation(messages[:3], encode, max_context=2048, max_tokens=MAX_TOKENS))
    metrics.set_retention_rate("entity_aware", 0.97)
    points = {
        m.name: [(dict(p.attributes), p.value) for p in m.data.data_points]
        for rm in reader.get_metrics_data().resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
    }
    assert points["ballast_context_truncations"] == [({"policy": "entity_aware", "model": "tiny"}, 1)]
    assert points["ballast_context_dropped_turns"] == [({"policy": "entity_aware", "model": "tiny"}, len(fit.dropped))]
    assert points["ballast_context_retention_rate"] == [({"policy": "entity_aware"}, 0.97)]
