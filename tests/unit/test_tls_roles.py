"""Who may call what under mutual TLS: the role a peer's certificate names, and the rules."""

import pytest

from services.common.tls.roles import allowed_roles, may_call, peer_role, role_from_names


def auth(uris=(), cns=()):
    return {"x509_subject_alternative_name": [u.encode() for u in uris], "x509_common_name": [c.encode() for c in cns]}


def test_role_comes_from_the_uri_san_before_the_common_name():
    assert peer_role(auth(["spiffe://ballast/router", "localhost"], ["worker"])) == "router"
    assert peer_role(auth(["localhost", "127.0.0.1"], ["cache"])) == "cache"


def test_no_role_unknown_role_or_two_roles_name_nobody():
    assert peer_role({}) is None
    assert peer_role(auth(["spiffe://ballast/admin"], ["router"])) is None
    assert peer_role(auth(["spiffe://ballast/router", "spiffe://ballast/worker"])) is None
    assert peer_role(auth(cns=["somebody"])) is None
    assert role_from_names([], ["router", "worker"]) is None


@pytest.mark.parametrize(
    "method, role, allowed",
    [
        ("/ballast.v1.Worker/Generate", "router", True),
        ("/ballast.v1.Worker/Generate", "worker", False),
        ("/ballast.v1.Worker/Generate", "backfill", False),
        ("/ballast.v1.Worker/Generate", None, False),
        ("/ballast.v1.KVCache/Put", "worker", True),
        ("/ballast.v1.KVCache/Put", "cli", False),
        ("/ballast.v1.KVCache/Get", "router", False),
        ("/ballast.v1.Backfill/Subscribe", "router", True),
        ("/ballast.v1.Backfill/Subscribe", "cli", False),
        ("/ballast.v1.Inference/Generate", "backfill", True),
        ("/ballast.v1.Inference/Generate", None, True),
        ("/grpc.health.v1.Health/Check", "cli", True),
        ("/ballast.v1.Unknown/Call", "router", False),
    ],
)
def test_rules(method, role, allowed):
    assert may_call(method, role) is allowed


def test_a_service_without_a_rule_is_refused_to_everyone():
    assert allowed_roles("/ballast.v1.Admin/Wipe") == frozenset()
