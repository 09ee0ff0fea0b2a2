"""The `tls` config section, shared by every service (each reads its own certificate files,
usually through `BALLAST__TLS__CERT_FILE` / `BALLAST__TLS__KEY_FILE`)."""

from __future__ import annotations

from pydantic import Field, model_validator

from services.common.config import Section


class TLSConfig(Section):
    enabled: bool = Field(
        False,
        description="Mutual TLS between services: every internal port requires a client certificate "
        "signed by ca_file, and every channel presents cert_file.",
    )
    ca_file: str = Field("", description="PEM file of the CA(s) that sign every Ballast certificate.")
    cert_file: str = Field(
        "",
        description="PEM certificate of this process, naming its role (URI SAN spiffe://ballast/<role> "
        "or CN=<role>); re-read when it changes.",
    )
    key_file: str = Field("", description="PEM private key of cert_file; re-read when it changes.")
    public_tls: bool = Field(
        True,
        description="With enabled: serve the router's public port over TLS too (false: plaintext, "
        "e.g. behind a balancer that terminates TLS).",
    )
    require_client_cert_public: bool = Field(
        False,
        description="With enabled and public_tls: the router's public port also requires a client "
        "certificate signed by ca_file.",
    )
    health_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="With enabled: a plaintext port that serves only grpc.health.v1, for probes that cannot "
        "speak TLS (the kubelet's gRPC probes); every other call there is PERMISSION_DENIED. "
        "Unset: none.",
    )
    target_name_override: str = Field(
        "",
        description="Name checked against servers' certificates instead of the dialled host (for "
        "certificates that name a service rather than each address); empty: the host.",
    )

    @model_validator(mode="after")
    def _files_named(self) -> "TLSConfig":
        if self.enabled:
            missing = [name for name in ("ca_file", "cert_file", "key_file") if not getattr(self, name)]
            if missing:
                raise ValueError(f"tls.enabled needs {', '.join(missing)}")
        return self

    @property
    def public_port_secure(self) -> bool:
        """Whether the router's public port speaks TLS."""
        return self.enabled and self.public_tls

    def towards_public_port(self) -> "TLSConfig":
        """The settings a client uses to reach the router's public port: these, or plaintext
        when that port is plaintext."""
        return self if self.public_port_secure else TLSConfig()
