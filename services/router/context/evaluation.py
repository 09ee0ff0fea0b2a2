"""Context retention on an evaluation set: does the turn the latest question needs survive?

`synthetic_cases` builds long shop-support conversations (English and Chinese) in which an
early exchange states a fact (a product's price and id), many unrelated exchanges follow
(some quoting other products' prices, to be hard), and the last user message asks for that
fact by the product's name. `retention_rate` fits each one into a context smaller than the
conversation with a policy and counts how often the fact's exchange is kept: the value of
`ballast_context_retention_rate`, and the number `bench/context.py` compares across policies.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Sequence

from services.common.errors import InvalidArgument
from services.router.context.window import ContextPolicy, Encode, fit_conversation


@dataclass(frozen=True)
class Turn:
    role: str
    content: str


@dataclass(frozen=True)
class RetentionCase:
    messages: tuple[Turn, ...]
    # Indices of the messages that hold the fact the last question asks for.
    needed: tuple[int, ...]
    language: str
    # Share of the conversation's tokens the context leaves room for.
    context_fraction: float
    fact: str = ""


@dataclass
class Retention:
    rate: float
    total: int
    retained: int
    by_language: dict[str, float] = field(default_factory=dict)


# (English name, Chinese name) of each product.
PRODUCTS = (
    ("phone case", "手机壳"),
    ("coffee maker", "咖啡机"),
    ("running shoes", "跑步鞋"),
    ("blue jacket", "蓝色外套"),
    ("headphones", "耳机"),
    ("winter coat", "冬季大衣"),
    ("gift card", "礼品卡"),
    ("laptop stand", "电脑支架"),
    ("green sweater", "绿色毛衣"),
    ("desk lamp", "台灯"),
    ("water bottle", "保温杯"),
    ("backpack", "双肩包"),
)
_SYSTEM = {"en": "You are a helpful shopping assistant.", "zh": "你是一个购物客服助手。"}
_FACT = {
    "en": ("How much is the {item}?", "The {item} costs {price} dollars, product id {sku}."),
    "zh": ("{item}多少钱？", "{item}的价格是 {price} 元，商品编号 {sku}。"),
}
_ASK = {
    "en": ("What was the price of the {item} you told me about?", "How much did you say the {item} costs?"),
    "zh": ("刚才说的{item}价格是多少？", "之前提到的{item}多少钱来着？"),
}
_FILLER = {
    "en": (
        ("Is the {item} in stock?", "Yes, the {item} is in stock and costs {price} dollars."),
        ("Where is my order {order}?", "Your order {order} has shipped and will arrive in {n} days."),
        ("Can I pay with PayPal?", "Yes, we accept PayPal at checkout."),
        ("How do I change my delivery address?", "Open your order in the app and tap Change address."),
        ("I want to return the {item}.", "You can return the {item} within 30 days for a full refund."),
        ("My payment failed. What should I do?", "Please check your card details and try again."),
        ("Do you ship abroad?", "Yes, we ship to most countries within {n} to {m} business days."),
    ),
    "zh": (
        ("{item}有货吗？", "有货，{item}价格是 {price} 元，今天就可以发货。"),
        ("我的订单{order}在哪里？", "您的订单{order}已经发货，预计{n}天到达。"),
        ("可以用支付宝付款吗？", "可以，结账时支持支付宝。"),
        ("怎么修改收货地址？", "请在发货前打开订单，点击修改地址。"),
        ("我想退{item}。", "{item}可以在七天内退货，退款会原路返回。"),
        ("支付失败了怎么办？", "请检查银行卡信息后重试，或者换一种支付方式。"),
        ("可以寄到国外吗？", "可以，一般{n}到{m}个工作日送达。"),
    ),
}


def synthetic_cases(
    n: int, seed: int = 0, languages: Sequence[str] = ("en", "zh"), filler: tuple[int, int] = (20, 40)
) -> list[RetentionCase]:
    """`n` deterministic conversations, alternating languages."""
    rng = random.Random(seed)
    return [_case(rng, languages[i % len(languages)], filler) for i in range(n)]


def _case(rng: random.Random, lang: str, filler: tuple[int, int]) -> RetentionCase:
    names = [p[0] if lang == "en" else p[1] for p in PRODUCTS]
    item = rng.choice(names)
    others = [x for x in names if x != item]
    price = str(rng.randrange(9, 400))
    sku = f"SKU-{rng.randrange(1000, 9999)}"
    count = rng.randint(*filler)
    fact_at = rng.randrange(0, max(1, (2 * count) // 3))
    messages = [Turn("system", _SYSTEM[lang])]
    needed: tuple[int, ...] = ()
    for k in range(count + 1):
        if k == fact_at:
            q, a = _FACT[lang]
            needed = (len(messages), len(messages) + 1)
            slots = {"item": item, "price": price, "sku": sku}
        else:
            q, a = rng.choice(_FILLER[lang])
            slots = {
                "item": rng.choice(others),
                "price": str(rng.randrange(9, 400)),
                "order": str(rng.randrange(10000, 99999)),
                "n": str(rng.randrange(2, 6)),
                "m": str(rng.randrange(6, 12)),
            }
        messages += [Turn("user", q.format(**slots)), Turn("assistant", a.format(**slots))]
    messages.append(Turn("user", rng.choice(_ASK[lang]).format(item=item)))
    return RetentionCase(tuple(messages), needed, lang, round(rng.uniform(0.3, 0.7), 2), price)


def retention_rate(
    cases: Sequence[RetentionCase], encode: Encode, policy: ContextPolicy, max_tokens: int = 64
) -> Retention:
    """Fits each case into `context_fraction` of its tokens (+ max_tokens) with `policy`;
    a case whose fit fails (InvalidArgument) counts as not retained."""
    retained = 0
    per_lang: dict[str, list[int]] = {}
    for case in cases:
        total = len(encode(case.messages))
        max_context = int(total * case.context_fraction) + max_tokens
        try:
            fit = fit_conversation(case.messages, encode, max_context=max_context, max_tokens=max_tokens, policy=policy)
            ok = set(case.needed) <= set(fit.kept)
        except InvalidArgument:
            ok = False
        retained += ok
        per_lang.setdefault(case.language, []).append(int(ok))
    return Retention(
        rate=retained / len(cases) if cases else 0.0,
        total=len(cases),
        retained=retained,
        by_language={lang: sum(v) / len(v) for lang, v in sorted(per_lang.items())},
    )
