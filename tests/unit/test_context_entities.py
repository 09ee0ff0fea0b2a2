"""Terms of a message: numbers, ids, English words and Chinese bigrams, weighted by kind."""

from __future__ import annotations

from services.router.context.entities import ENTITY_WEIGHT, WORD_WEIGHT, overlap, terms


def test_numbers_ids_and_words():
    found = terms("The phone cases cost $1,299.00 each; order SKU-42 ships with A1234.")
    assert found["n:1299"] == ENTITY_WEIGHT
    assert found["id:sku-42"] == ENTITY_WEIGHT and found["id:a1234"] == ENTITY_WEIGHT
    assert found["w:phone"] == WORD_WEIGHT and found["w:case"] == WORD_WEIGHT
    assert "w:the" not in found and "w:each" not in found and "w:ship" in found


def test_chinese_bigrams_skip_function_characters():
    found = terms("刚才说的手机壳价格是多少？")
    assert {"zh:手机", "zh:机壳", "zh:价格"} <= found.keys()
    assert not {"zh:是多", "zh:多少", "zh:说的", "zh:刚才"} & found.keys()


def test_ids_inside_chinese_text():
    found = terms("订单A123的价格是39元")
    assert "id:a123" in found and "n:39" in found and "n:123" in found


def test_plurals_and_possessives_match_their_singular():
    assert terms("the headphones' cases")["w:case"] and "w:headphone" in terms("my headphone's box")


def test_overlap_weighs_rare_terms_higher():
    query = terms("What did the phone case cost?")
    near, far = terms("The phone case costs 39 dollars."), terms("Your order has shipped.")
    assert overlap(query, near) > 0 == overlap(query, far)
    idf = {"w:phone": 3.0, "w:case": 3.0, "w:cost": 0.1}
    assert overlap(query, near, idf) > overlap(query, terms("It will cost more."), idf)


def test_deterministic():
    text = "蓝色外套 blue jacket 39.90 元, id X9-77"
    assert terms(text) == terms(text)
