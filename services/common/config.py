"""The shared pieces of Ballast's typed configuration: the `Section` base, the sections every
service reads (etcd, Redis, Kafka, auth, telemetry), and the loader.

One file (`ballast.yaml`) holds every section; each service's own sections live with the
service, and `services/config.py` assembles them into the root `BallastConfig`.
Environment variables override any field: `BALLAST__ROUTER__PORT=50051` sets
`router.port` (double underscores separate levels). A variable's value replaces the file's
at its path; a JSON map replaces the whole map (so `BALLAST__AUTH__API_KEYS` is the key list,
not keys added to the file's). A bad value fails at start-up with a message naming the field.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from services.common.tier import Tier, parse_tier

ENV_PREFIX = "BALLAST__"
CONFIG_PATH_ENV = "BALLAST_CONFIG"


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, not silently ignored."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class BackingTLSConfig(Section):
    """TLS from a Ballast service to a backing service (etcd, Redis or Kafka). Checked at
    start-up like the `tls` section: a missing, unreadable, non-PEM or expired file, or a key
    that is not the certificate's, refuses to start."""

    enabled: bool = Field(False, description="Speak TLS to this server.")
    ca_file: str = Field(
        "", description="PEM CA bundle that signs the server's certificate; empty: the system's trust store."
    )
    cert_file: str = Field(
        "", description="PEM client certificate, for a server that requires one (mutual TLS); with key_file."
    )
    key_file: str = Field("", description="PEM private key of cert_file.")

    @model_validator(mode="after")
    def _certificate_with_key(self) -> "BackingTLSConfig":
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("cert_file and key_file go together")
        return self


class EtcdConfig(Section):
    host: str = Field("127.0.0.1", description="etcd client host (one member; see `endpoints`).")
    port: int = Field(2379, ge=1, le=65535, description="etcd client port.")
    endpoints: list[str] = Field(
        default_factory=list,
        description="Client addresses (host:port) of every member of an etcd cluster; when set, host and "
        "port are not used. Calls go to one member and move to another when it fails.",
    )
    prefix: str = Field("/ballast/", description="Root of every Ballast key.")
    timeout_s: float = Field(2.0, gt=0, description="Deadline of each etcd call.")
    lease_ttl_s: int = Field(3, ge=2, le=60, description="TTL of a worker's membership lease.")
    heartbeat_s: float = Field(
        1.0, gt=0, description="How often a worker refreshes its lease, and its record when something in it changed."
    )
    record_refresh_s: float = Field(
        30.0,
        gt=0,
        description="Longest a worker leaves its record unwritten while nothing in it changes. An "
        "unchanged record is not written at each heartbeat: every write wakes every "
        "router's watch, and with many idle workers those wake-ups are most of a "
        "router's idle work.",
    )
    reconnect_backoff_s: float = Field(0.5, gt=0, description="First wait before reconnecting.")
    username: str = Field(
        "",
        description="etcd user (with `auth enable` on the cluster); empty: none, "
        "or the client certificate's CN when etcd checks certificates.",
    )
    password: str = Field("", description="Password of `username` (BALLAST__ETCD__PASSWORD).")
    tls: BackingTLSConfig = Field(default_factory=BackingTLSConfig, description="TLS to etcd.")

    @field_validator("endpoints")
    @classmethod
    def _host_and_port(cls, value: list[str]) -> list[str]:
        for endpoint in value:
            host, sep, port = endpoint.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"{endpoint!r} is not host:port")
        return value

    @property
    def members(self) -> list[str]:
        """host:port of each member to try (the endpoints, else host and port)."""
        return list(self.endpoints) or [f"{self.host}:{self.port}"]

    @property
    def display(self) -> str:
        """Where etcd is, for messages."""
        return ",".join(self.members)

    @field_validator("prefix")
    @classmethod
    def _slash_terminated(cls, value: str) -> str:
        if not value.startswith("/") or not value.endswith("/"):
            raise ValueError("must start and end with '/'")
        return value

    @model_validator(mode="after")
    def _user_with_password(self) -> "EtcdConfig":
        if bool(self.username) != bool(self.password):
            raise ValueError("username and password go together")
        return self


class RedisConfig(Section):
    url: str = Field("redis://127.0.0.1:6379/0", description="Redis (or Redis Cluster seed) URL; rediss:// for TLS.")
    timeout_s: float = Field(1.0, gt=0, description="Deadline of each Redis call.")
    username: str = Field("", description="ACL user (AUTH username password); empty: `default`.")
    password: str = Field("", description="Password of the ACL user, or requirepass (BALLAST__REDIS__PASSWORD).")
    tls: BackingTLSConfig = Field(
        default_factory=BackingTLSConfig, description="TLS to Redis (also turned on by a rediss:// URL)."
    )
    cluster: bool = Field(
        False,
        description="The URL names one node of a Redis Cluster: the client "
        "discovers the others and follows slot moves.",
    )
    wait_replicas: int = Field(
        0,
        ge=0,
        description="Backfill writes on a Redis Cluster wait (WAIT) until this many replicas "
        "have them, so a master failover loses no stored answer or delivery mark; "
        "0: no wait. Set it to the replicas per master.",
    )
    wait_timeout_ms: int = Field(
        500, gt=0, description="Longest such a wait; the write then counts as done, with a warning."
    )

    def connection_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of redis-py's from_url() beyond the URL: credentials and TLS."""
        kwargs: dict[str, Any] = {}
        if self.username:
            kwargs["username"] = self.username
        if self.password:
            kwargs["password"] = self.password
        if self.tls.enabled or self.url.startswith("rediss://"):
            if self.tls.ca_file:
                kwargs["ssl_ca_certs"] = self.tls.ca_file
            if self.tls.cert_file:
                kwargs["ssl_certfile"] = self.tls.cert_file
                kwargs["ssl_keyfile"] = self.tls.key_file
        return kwargs

    @property
    def display_url(self) -> str:
        """The URL without any user or password in it, for logs."""
        scheme, sep, rest = self.url.partition("://")
        return f"{scheme}{sep}{rest.rsplit('@', 1)[-1]}" if sep else self.url

    @property
    def effective_url(self) -> str:
        """The URL with its scheme set by `tls.enabled` (redis-py picks TLS by scheme)."""
        if self.tls.enabled and self.url.startswith("redis://"):
            return "rediss://" + self.url[len("redis://") :]
        return self.url


class KafkaConfig(Section):
    bootstrap: str = Field("127.0.0.1:9092", description="Kafka bootstrap servers.")
    timeout_s: float = Field(5.0, gt=0, description="Deadline of admin and produce calls.")
    sasl_mechanism: Literal["", "PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] = Field(
        "", description="SASL mechanism; empty: no SASL."
    )
    username: str = Field("", description="SASL user.")
    password: str = Field("", description="SASL password (BALLAST__KAFKA__PASSWORD).")
    tls: BackingTLSConfig = Field(default_factory=BackingTLSConfig, description="TLS to the brokers.")

    @model_validator(mode="after")
    def _sasl_credentials(self) -> "KafkaConfig":
        if self.sasl_mechanism and not (self.username and self.password):
            raise ValueError("sasl_mechanism needs username and password")
        return self

    def security_properties(self) -> dict[str, str]:
        """librdkafka properties for SASL and TLS (empty for a plaintext broker)."""
        sasl = bool(self.sasl_mechanism)
        protocol = {
            (False, False): "PLAINTEXT",
            (False, True): "SSL",
            (True, False): "SASL_PLAINTEXT",
            (True, True): "SASL_SSL",
        }[(sasl, self.tls.enabled)]
        if protocol == "PLAINTEXT":
            return {}
        properties = {"security.protocol": protocol}
        if sasl:
            properties.update(
                {"sasl.mechanism": self.sasl_mechanism, "sasl.username": self.username, "sasl.password": self.password}
            )
        if self.tls.enabled:
            if self.tls.ca_file:
                properties["ssl.ca.location"] = self.tls.ca_file
            if self.tls.cert_file:
                properties["ssl.certificate.location"] = self.tls.cert_file
                properties["ssl.key.location"] = self.tls.key_file
        return properties


# A tier a grant or a ceiling names: S, A or B (`TIER_ORDER`), as text in the file; anything
# else (AUTO included) is refused, the message naming the field.
TierName = Annotated[Tier, BeforeValidator(lambda raw: parse_tier(raw, "a tier"))]


class ApiKey(Section):
    """An API key written as a mapping, for a key that needs more than its tenant's name."""

    tenant: str = Field(..., min_length=1, description="Tenant the key belongs to.")
    max_tier: TierName | None = Field(
        None, description="Highest tier calls with this key may claim, below the tenant's grant; none: the grant's."
    )
    acts_for_tenants: bool = Field(
        False,
        description="Calls with this key may name another tenant in x-ballast-on-behalf-of and run as it "
        "(the backfill's key, whose replays count against the tenant that degraded).",
    )


class TenantGrant(Section):
    """What a tenant may claim."""

    tiers: list[TierName] = Field(
        default_factory=lambda: [Tier.A, Tier.B],
        min_length=1,
        description="Tiers its requests may ask for (or be tagged with); a higher one is capped to the highest "
        "of these, never refused.",
    )


class AuthConfig(Section):
    enabled: bool = Field(True, description="Require an API key on public calls.")
    api_keys: dict[str, str | ApiKey] = Field(
        default_factory=dict, description="API key -> tenant name, or -> {tenant, max_tier, acts_for_tenants}."
    )
    default_tenant: str = Field("local", description="Tenant of every call when auth is off.")
    tenants: dict[str, TenantGrant] = Field(
        default_factory=dict, description="Tier grants by tenant; a tenant not named here gets default_grant."
    )
    default_grant: TenantGrant = Field(
        default_factory=TenantGrant, description="Grant of every tenant not in `tenants` (A and B: S is earned)."
    )

    def key(self, api_key: str) -> ApiKey | None:
        """The key's entry in its mapping form, or None for an unknown key."""
        entry = self.api_keys.get(api_key)
        if entry is None or isinstance(entry, ApiKey):
            return entry
        return ApiKey(tenant=entry)

    def keys_of(self, tenant: str) -> list[str]:
        """The API keys of a tenant, sorted."""
        return sorted(k for k in self.api_keys if (entry := self.key(k)) is not None and entry.tenant == tenant)

    def grant(self, tenant: str) -> TenantGrant:
        return self.tenants.get(tenant, self.default_grant)


class TracingConfig(Section):
    endpoint: str = Field(
        "",
        description="OTLP/gRPC collector (host:port or http[s]://host:port); empty: no exporter, "
        "trace context still propagates.",
    )
    sample_ratio: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="Share of new traces recorded; a call that arrives with a trace context follows its caller.",
    )
    insecure: bool = Field(True, description="Plaintext to the collector (false: TLS).")
    export_timeout_s: float = Field(10.0, gt=0, description="Deadline of each export to the collector.")

    @field_validator("endpoint")
    @classmethod
    def _host_and_port(cls, value: str) -> str:
        address = value.split("://", 1)[-1].rstrip("/")
        if value and (":" not in address or not address.rsplit(":", 1)[1].isdigit()):
            raise ValueError("must be host:port (or http[s]://host:port), or empty to export nothing")
        return value


class TelemetryConfig(Section):
    metrics_host: str = Field("127.0.0.1", description="Bind address of /metrics.")
    metrics_port: int = Field(0, ge=0, le=65535, description="Port of /metrics; 0 picks one.")
    enabled: bool = Field(True, description="Serve Prometheus metrics.")
    tracing: TracingConfig = Field(default_factory=TracingConfig, description="Distributed traces (OTLP).")
    loop_lag_interval_s: float = Field(
        0.25,
        gt=0,
        le=10,
        description="How often the event loop's lag is measured (a timer that reports how late it fired).",
    )
    loop_lag_warn_ms: float = Field(
        1000,
        gt=0,
        description="An event-loop lag this long or longer is logged (at most one line a minute).",
    )


class ConfigError(Exception):
    """The configuration is invalid; the message names the field."""


def _env_overrides(environ: dict[str, str]) -> list[tuple[list[str], Any]]:
    """(path, value) of every BALLAST__ variable, shallowest path first."""
    overrides: list[tuple[list[str], Any]] = []
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        path = [part.lower() for part in name[len(ENV_PREFIX) :].split("__") if part]
        if not path:
            continue
        # JSON lets env values carry numbers, booleans and maps; plain strings stay strings.
        try:
            value: Any = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        overrides.append((path, value))
    # A map set whole goes first, so a deeper variable still lands inside it.
    return sorted(overrides, key=lambda item: len(item[0]))


def _apply(data: dict[str, Any], overrides: list[tuple[list[str], Any]]) -> dict[str, Any]:
    """The file's data with each override put at its path. A value replaces what the file has
    there, a map included: BALLAST__AUTH__API_KEYS is the whole key list, so a key left out of
    it is revoked, not kept from the file."""
    result = copy.deepcopy(data)
    for path, value in overrides:
        node = result
        for part in path[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child
        node[path[-1]] = value
    return result


def _describe(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"])
        lines.append(f"config field '{field}': {item['msg']}")
    return "; ".join(lines)


Root = TypeVar("Root", bound=BaseModel)


def load_sections(root: type[Root], path: str | Path | None = None, environ: dict[str, str] | None = None) -> Root:
    """Reads the YAML file (if any), applies env overrides, validates it all as `root`."""
    environ = dict(os.environ if environ is None else environ)
    path = path or environ.get(CONFIG_PATH_ENV) or None
    data: dict[str, Any] = {}
    if path:
        try:
            loaded = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from exc
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        data = loaded
    data = _apply(data, _env_overrides(environ))
    try:
        return root.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from None
