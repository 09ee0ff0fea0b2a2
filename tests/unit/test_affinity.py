"""Session affinity: last worker per (tenant, session), bounded."""

import pytest

from services.router.affinity import SessionAffinity


def test_remembers_the_last_worker_per_tenant_and_session():
    affinity = SessionAffinity()
    affinity.served("acme", "s1", "w1")
    affinity.served("acme", "s1", "w2")
    affinity.served("other", "s1", "w3")
    assert affinity.preferred("acme", "s1") == "w2"
    assert affinity.preferred("other", "s1") == "w3"
    assert affinity.preferred("acme", "s2") is None


def test_requests_without_a_session_have_no_affinity():
    affinity = SessionAffinity()
    affinity.served("acme", "", "w1")
    assert affinity.preferred("acme", "") is None
    assert len(affinity) == 0


def test_bounded_least_recently_used_first():
    affinity = SessionAffinity(max_sessions=2)
    affinity.served("t", "a", "w1")
    affinity.served("t", "b", "w1")
    affinity.preferred("t", "a")  # a is now the most recent
    affinity.served("t", "c", "w1")
    assert affinity.preferred("t", "b") is None
    assert affinity.preferred("t", "a") == "w1" and affinity.preferred("t", "c") == "w1"
    with pytest.raises(ValueError):
        SessionAffinity(0)
