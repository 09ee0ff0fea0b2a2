"""Which header carries the API key: an empty one never hides the other."""

from __future__ import annotations

import pytest

from services.common.auth import _key_from_metadata


@pytest.mark.parametrize(
    "metadata",
    [
        [("x-api-key", ""), ("authorization", "Bearer k1")],
        [("x-api-key", "   "), ("authorization", "Bearer k1")],
        [("authorization", "Bearer "), ("x-api-key", "k1")],
        [("Authorization", "bearer  k1 ")],
        [("X-Api-Key", " k1")],
    ],
)
def test_an_empty_key_header_falls_through_to_the_other(metadata):
    assert _key_from_metadata(metadata) == "k1"


def test_the_first_header_with_a_key_wins():
    assert _key_from_metadata([("x-api-key", "k1"), ("authorization", "Bearer k2")]) == "k1"
    assert _key_from_metadata([("authorization", "Bearer k2"), ("x-api-key", "k1")]) == "k2"


@pytest.mark.parametrize(
    "metadata",
    [
        None,
        [],
        [("x-api-key", "")],
        [("authorization", "Bearer")],
        [("authorization", "Basic k1")],
        [("x-api-key-bin", b"k1")],
    ],
)
def test_no_key(metadata):
    assert _key_from_metadata(metadata) == ""
