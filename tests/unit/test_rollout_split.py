"""The weighted, session-sticky split between the stable and candidate versions."""

from __future__ import annotations

from dataclasses import replace

from services.router.rollout.split import Role, choose
from services.router.rollout.state import Mode, Phase, Rollout

CANARY = Rollout(model="tiny", stable="v-stable", candidate="v-cand", weight=10.0)


def roles(rollout: Rollout, sessions: int = 2000) -> list[Role]:
    return [choose(rollout, "acme", f"session-{i}", f"req-{i}").role for i in range(sessions)]


def test_about_ten_percent_of_sessions_go_to_a_ten_percent_canary():
    on_candidate = roles(CANARY).count(Role.CANDIDATE)
    # 2000 draws at 10 %: mean 200, standard deviation about 13.
    assert 150 <= on_candidate <= 250, on_candidate


def test_a_session_always_gets_the_same_version_whatever_its_requests():
    for i in range(200):
        versions = {choose(CANARY, "acme", f"session-{i}", f"req-{i}-{turn}").version for turn in range(5)}
        assert len(versions) == 1


def test_sessions_differ_by_tenant():
    same_session = [choose(CANARY, f"tenant-{t}", "session-1", "r").role for t in range(500)]
    assert 0 < same_session.count(Role.CANDIDATE) < 500


def test_requests_without_a_session_split_by_request_id():
    drawn = [choose(CANARY, "acme", "", f"req-{i}").role for i in range(2000)]
    assert 150 <= drawn.count(Role.CANDIDATE) <= 250
    assert choose(CANARY, "acme", "", "req-7") == choose(CANARY, "acme", "", "req-7")


def test_raising_the_weight_keeps_every_canary_session_on_the_candidate():
    before = roles(CANARY)
    after = roles(replace(CANARY, weight=30.0))
    assert all(a is Role.CANDIDATE for b, a in zip(before, after) if b is Role.CANDIDATE)
    assert after.count(Role.CANDIDATE) > before.count(Role.CANDIDATE)


def test_weights_zero_and_hundred_send_everything_one_way():
    blue_green = replace(CANARY, mode=Mode.BLUE_GREEN, weight=0.0)
    assert set(roles(blue_green, 300)) == {Role.STABLE}
    assert set(roles(replace(blue_green, weight=100.0), 300)) == {Role.CANDIDATE}


def test_fallbacks_point_at_the_other_version_except_after_a_rollback():
    candidate = choose(replace(CANARY, weight=100.0), "acme", "s", "r")
    assert candidate.versions() == ("v-cand", "v-stable")
    stable = choose(replace(CANARY, weight=0.0), "acme", "s", "r")
    assert stable.versions() == ("v-stable", "v-cand")
    rolled_back = choose(replace(CANARY, weight=100.0, state=Phase.ROLLED_BACK), "acme", "s", "r")
    assert rolled_back.versions() == ("v-stable",)
    promoted = choose(replace(CANARY, weight=0.0, state=Phase.PROMOTED), "acme", "s", "r")
    assert promoted.role is Role.CANDIDATE


def test_mirroring_copies_about_its_share_of_stable_requests_only():
    mirrored = replace(CANARY, weight=10.0, mirror_percent=20.0)
    routes = [choose(mirrored, "acme", f"s-{i}", f"req-{i}") for i in range(2000)]
    copies = [r for r in routes if r.mirror]
    assert all(r.role is Role.STABLE for r in copies)
    stable = sum(1 for r in routes if r.role is Role.STABLE)
    assert 0.15 * stable <= len(copies) <= 0.25 * stable
    assert not any(
        choose(replace(mirrored, state=Phase.PROMOTED), "acme", f"s-{i}", f"req-{i}").mirror for i in range(200)
    )


def test_each_rollout_draws_its_own_slice_of_sessions():
    first = roles(CANARY)
    second = roles(replace(CANARY, candidate="v-other"))
    overlap = sum(1 for a, b in zip(first, second) if a is b is Role.CANDIDATE)
    assert overlap < first.count(Role.CANDIDATE)
