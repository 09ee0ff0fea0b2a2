"""Rollout documents: valid ones round-trip, bad ones are refused with the field named."""

from __future__ import annotations

import json

import pytest

from services.router.rollout.state import GatePolicy, Mode, Phase, Rollout, RolloutError, load_rollout

GOOD = {
    "model": "tiny",
    "stable": "aaaa",
    "candidate": "bbbb",
    "weight": 10,
    "mode": "canary",
    "mirror_percent": 5,
    "state": "running",
    "reason": "started",
    "gate": {"window_s": 30, "min_requests": 40, "max_error_rate": 0.02, "max_p99_ms": 900, "breach_min_requests": 3},
    "updated_at": 1718000000.0,
}


def doc(**changes) -> bytes:
    data = dict(GOOD)
    for key, value in changes.items():
        if value is None:
            data.pop(key)
        else:
            data[key] = value
    return json.dumps(data).encode()


def test_a_valid_document_round_trips():
    rollout = load_rollout(doc(), "tiny")
    assert rollout.weight == 10.0 and rollout.mode is Mode.CANARY and rollout.state is Phase.RUNNING
    assert rollout.gate == GatePolicy(30.0, 40, 0.02, 900.0, 3)
    assert load_rollout(rollout.to_json(), "tiny") == rollout


def test_defaults_fill_what_a_minimal_document_leaves_out():
    rollout = load_rollout(json.dumps({"model": "tiny", "stable": "a", "candidate": "b"}))
    assert rollout == Rollout("tiny", "a", "b")


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"weight": 101}, "weight"),
        ({"weight": -1}, "weight"),
        ({"weight": "10"}, "weight"),
        ({"weight": True}, "weight"),
        ({"mode": "blue-green", "weight": 50}, "weight"),
        ({"mode": "linear"}, "mode"),
        ({"state": "paused"}, "state"),
        ({"mirror_percent": 150}, "mirror_percent"),
        ({"candidate": "aaaa"}, "candidate"),
        ({"stable": ""}, "stable"),
        ({"candidate": None}, "candidate"),
        ({"model": "other"}, "model"),
        ({"gate": {"window_s": 0}}, "gate.window_s"),
        ({"gate": {"min_requests": 0}}, "gate.min_requests"),
        ({"gate": {"max_error_rate": 2}}, "gate.max_error_rate"),
        ({"gate": {"max_p99_ms": -5}}, "gate.max_p99_ms"),
        ({"gate": {"window": 5}}, "window"),
        ({"gate": [1]}, "gate"),
        ({"colour": "blue"}, "colour"),
        ({"reason": "x" * 501}, "reason"),
    ],
)
def test_bad_documents_are_refused_naming_the_field(changes, field):
    with pytest.raises(RolloutError) as err:
        load_rollout(doc(**changes), "tiny")
    assert field in str(err.value)


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"null", b"\xff\xfe"])
def test_garbage_is_refused(raw):
    with pytest.raises(RolloutError):
        load_rollout(raw, "tiny")


def test_blue_green_accepts_only_all_or_nothing():
    assert load_rollout(doc(mode="blue-green", weight=0), "tiny").weight == 0.0
    assert load_rollout(doc(mode="blue-green", weight=100), "tiny").weight == 100.0


def test_a_decision_moves_all_traffic_and_stops_mirroring():
    rollout = load_rollout(doc(), "tiny")
    promoted = rollout.decided(Phase.PROMOTED, "gate: clean window")
    assert (promoted.state, promoted.weight, promoted.mirror_percent) == (Phase.PROMOTED, 100.0, 0.0)
    rolled_back = rollout.decided(Phase.ROLLED_BACK, "gate: error rate")
    assert (rolled_back.state, rolled_back.weight) == (Phase.ROLLED_BACK, 0.0)
    assert load_rollout(rolled_back.to_json(), "tiny") == rolled_back
