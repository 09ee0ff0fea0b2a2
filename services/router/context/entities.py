"""Entities and keywords of a chat message, to tell which earlier turns the latest one is about.

English and Chinese alike, deterministic and without a dictionary: numbers (prices,
quantities, order numbers), ids (letters mixed with digits: SKU-42, A1234), English words
less stop words and plural endings, and Chinese character bigrams (手机壳 -> 手机, 机壳),
which match a product name however the sentence around it is segmented. Entities weigh
more than words because a shared order number or price says more than a shared word.
"""

from __future__ import annotations

import re
from typing import Mapping

ENTITY_WEIGHT = 2.0
WORD_WEIGHT = 1.0

_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
# Ascii look-arounds, not \b: Python counts CJK characters as word characters, so \b finds
# no boundary in "订单A123".
_ID = re.compile(
    r"(?<![A-Za-z0-9_-])(?=[A-Za-z0-9_-]*\d)(?=[A-Za-z0-9_-]*[A-Za-z])"
    r"[A-Za-z0-9][A-Za-z0-9_-]{2,}(?![A-Za-z0-9_-])"
)
_WORD = re.compile(r"[A-Za-z][A-Za-z']+")
_CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]+")

_STOP_WORDS = frozenset(
    """
a about above after again against all also am an and any are as at be because been before
being below between both but by can could did do does doing done down during each earlier few
for from further get got had has have having he her here hers him his how i if in into is it its
itself just know let like me mentioned more most my no nor not now of off on once only or other
our out over own please remind said same say she should so some such tell than thank thanks that
the their them then there these they this those through to too under until up very want was we
were what when where which while who whom why will with would yes you your yours hello hi okay
ok again ago earlier previous previously told asked question questions answer
""".split()
)

# Function characters: a bigram holding one is grammar (是多, 说的), not a topic.
_STOP_CHARS = frozenset(
    "的了是吗呢吧啊呀哦嗯我你您他她它们在有和与就也都还要会能可以这那个么什怎多少请问一下刚才说过之前"
    "谢好不没对让给把被很太又再啦哪里几"
)


def terms(text: str) -> dict[str, float]:
    """The message's terms with their weights: 'n:' numbers, 'id:' ids, 'w:' English words,
    'zh:' Chinese bigrams."""
    found: dict[str, float] = {}
    for match in _NUMBER.finditer(text):
        found[f"n:{_number(match.group())}"] = ENTITY_WEIGHT
    for match in _ID.finditer(text):
        found[f"id:{match.group().lower()}"] = ENTITY_WEIGHT
    for match in _WORD.finditer(text):
        word = _stem(match.group().lower())
        if len(word) >= 3 and word not in _STOP_WORDS:
            found.setdefault(f"w:{word}", WORD_WEIGHT)
    for run in _CJK.findall(text):
        for a, b in zip(run, run[1:]):
            if a not in _STOP_CHARS and b not in _STOP_CHARS:
                found.setdefault(f"zh:{a}{b}", WORD_WEIGHT)
    return found


def overlap(
    query: Mapping[str, float], candidate: Mapping[str, float], idf: Mapping[str, float] | None = None
) -> float:
    """How much `candidate` is about `query`: shared terms, each by weight x rarity."""
    score = 0.0
    for term, weight in query.items():
        if term in candidate:
            score += weight * (idf.get(term, 1.0) if idf else 1.0)
    return score


def _number(text: str) -> str:
    # "1,299.00" and "1299" are one price; a lone comma in "3,5" is taken as a thousands mark
    # too, which only merges numbers that are rare in shop chats.
    value = text.replace(",", "")
    if "." in value:
        value = value.rstrip("0").rstrip(".")
    return value.lstrip("0") or "0"


def _stem(word: str) -> str:
    if word.endswith("'s"):
        word = word[:-2]
    if len(word) > 4 and word.endswith("ies"):
        return word[:-3] + "y"
    if len(word) > 4 and word.endswith(("sses", "xes", "ches", "shes")):
        return word[:-2]
    if len(word) > 3 and word.endswith("s") and not word.endswith(("ss", "us", "is")):
        return word[:-1]
    return word
