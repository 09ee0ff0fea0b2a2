"""Who may call what: each service's certificate names its role, and each gRPC service
accepts calls only from the roles that call it in Ballast's call graph.

  Worker/*    from the router (it schedules and streams every generation)
  KVCache/*   from workers (session KV restore and save; nothing else calls the cache)
  Backfill/*  from the router (it relays Subscribe and GetBackfill)
  Inference/* from any caller that completes the handshake: it is the public API, guarded
              by API keys (the backfill service replays through it, clients use it)
  health, reflection: any caller that completes the handshake

On internal ports the handshake itself requires a certificate signed by the CA, so
"any caller" there means any Ballast service. A service not listed is refused to all.
"""

from __future__ import annotations

from typing import Iterable, Mapping

ROLES = ("router", "worker", "cache", "backfill", "cli")
ROLE_URI_PREFIX = "spiffe://ballast/"

# None: any peer that completed the handshake.
ANY_PEER = None
RULES: dict[str, frozenset[str] | None] = {
    "ballast.v1.Worker": frozenset({"router"}),
    "ballast.v1.KVCache": frozenset({"worker"}),
    "ballast.v1.Backfill": frozenset({"router"}),
    "ballast.v1.Inference": ANY_PEER,
    "grpc.health.v1.Health": ANY_PEER,
    "grpc.reflection.v1alpha.ServerReflection": ANY_PEER,
    "grpc.reflection.v1.ServerReflection": ANY_PEER,
}


# What a call that arrives without TLS (on `tls.health_port`, or on the router's public port
# when that port is plaintext) may reach while TLS is on.
HEALTH_ONLY = frozenset({"grpc.health.v1.Health"})
PUBLIC_PLAINTEXT = HEALTH_ONLY | {
    "ballast.v1.Inference",
    "grpc.reflection.v1alpha.ServerReflection",
    "grpc.reflection.v1.ServerReflection",
}


def role_uri(role: str) -> str:
    return f"{ROLE_URI_PREFIX}{role}"


def role_from_names(uris: Iterable[str], common_names: Iterable[str]) -> str | None:
    """The one role named by the role URIs, else by the common names; None when there is
    none, or more than one (a certificate must not speak for two roles)."""
    from_uris = {u[len(ROLE_URI_PREFIX) :] for u in uris if u.startswith(ROLE_URI_PREFIX)}
    found = from_uris or {cn for cn in common_names if cn in ROLES}
    if len(found) != 1:
        return None
    role = next(iter(found))
    return role if role in ROLES else None


def _texts(values: Iterable[bytes | str]) -> list[str]:
    return [v.decode(errors="replace") if isinstance(v, bytes) else v for v in values]


def peer_role(auth_context: Mapping[str, Iterable[bytes | str]]) -> str | None:
    """The role of a gRPC peer, from `context.auth_context()` (the verified certificate)."""
    uris = _texts(auth_context.get("x509_subject_alternative_name", ()))
    uris += _texts(auth_context.get("peer_spiffe_id", ()))
    return role_from_names(uris, _texts(auth_context.get("x509_common_name", ())))


def service_of(method: str) -> str:
    """ "/ballast.v1.Worker/Generate" -> "ballast.v1.Worker"."""
    return method.strip("/").split("/", 1)[0]


def allowed_roles(method: str) -> frozenset[str] | None:
    """The roles that may call `method`; ANY_PEER (None) for any peer; empty for nobody."""
    return RULES.get(service_of(method), frozenset())


def may_call(method: str, role: str | None) -> bool:
    allowed = allowed_roles(method)
    return allowed is ANY_PEER or role in allowed
