"""A local Kafka broker behind TLS with client certificates, for `ballast up --secure`.

The bundled Tansu broker cannot serve TLS itself (it ignores its certificate option), so the
secured broker is two processes: Tansu on a loopback port of its own, and a TLS front
(stunnel) on the broker's public port that requires a client certificate from the mesh's CA
and forwards to Tansu. Tansu advertises the front's address, so every connection a Kafka
client opens after bootstrap (librdkafka reconnects to the advertised broker) goes through the
front too.

What this does not give: SASL. With memory storage Tansu cannot create its first SCRAM user,
so the local broker authenticates clients by certificate only; Ballast's SASL settings are
for a production broker.
"""

from __future__ import annotations

import shutil
import socket
import ssl
from pathlib import Path

from services.cli.localservers import BackingSecurity, BinaryNotFoundError, KafkaBroker, LocalServer
from services.common.processes import free_ports

# The certificate the front presents (made by `ballast certs init` with the backing servers').
KAFKA_SERVER_ROLE = "kafka"


def find_stunnel_binary() -> str:
    """Path of stunnel (Debian's `stunnel4` package installs `stunnel4` and `stunnel`)."""
    for name in ("stunnel4", "stunnel"):
        found = shutil.which(name)
        if found:
            return found
    raise BinaryNotFoundError(
        "no stunnel binary found on PATH: the secured local Kafka broker needs it (Debian: apt install stunnel4)"
    )


class TLSFront(LocalServer):
    """stunnel accepting TLS on `port` (client certificate from the CA required) and
    forwarding plaintext to `target_port` on the same host."""

    name = "kafka-tls"
    stop_timeout = 2.0

    def __init__(
        self, state_dir: Path, port: int, target_port: int, security: BackingSecurity, host: str = "127.0.0.1"
    ) -> None:
        super().__init__(state_dir, port, host)
        self.target_port = target_port
        self.security = security

    @property
    def config_path(self) -> Path:
        return self.data_dir / "stunnel.conf"

    def _find_binary(self) -> str:
        return find_stunnel_binary()

    def _config_text(self) -> str:
        sec = self.security
        return "\n".join(
            [
                "foreground = yes",
                "pid =",
                "syslog = no",
                # Refused handshakes are logged; accepted connections are not (a line each).
                "debug = err",
                "[kafka]",
                f"accept = {self.host}:{self.port}",
                f"connect = {self.host}:{self.target_port}",
                f"cert = {sec.cert_file(KAFKA_SERVER_ROLE)}",
                f"key = {sec.key_file(KAFKA_SERVER_ROLE)}",
                f"CAfile = {sec.ca_file}",
                # A client must present a certificate that chains to the CA.
                "requireCert = yes",
                "verifyChain = yes",
                "sslVersionMin = TLSv1.2",
                "",
            ]
        )

    def _argv(self, binary: str) -> list[str]:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(self._config_text())
        return [binary, str(self.config_path)]

    def _probe(self) -> bool:
        # Answering means completing a TLS handshake with the client certificate.
        try:
            with socket.create_connection((self.host, self.port), timeout=1.0) as raw:
                with self.security.client_context().wrap_socket(raw, server_hostname=self.host):
                    return True
        except (OSError, ssl.SSLError):
            return False


class SecureKafkaBroker(KafkaBroker):
    """Tansu on an inner loopback port, reached only through a TLSFront on `port`."""

    def __init__(
        self, state_dir: Path, port: int | None = None, host: str = "127.0.0.1", *, security: BackingSecurity
    ) -> None:
        if port is None:
            port, inner_port = free_ports(2, host)
        else:
            inner_port = next(p for p in free_ports(2, host) if p != port)
        super().__init__(state_dir, port, host)
        self.security = security
        self.inner_port = inner_port
        self.front = TLSFront(state_dir, port, inner_port, security, host)

    def _listener_urls(self) -> tuple[str, str]:
        return f"tcp://{self.host}:{self.inner_port}", f"tcp://{self.host}:{self.port}"

    def client_properties(self) -> dict[str, str]:
        sec = self.security
        return {
            "security.protocol": "SSL",
            "ssl.ca.location": str(sec.ca_file),
            "ssl.certificate.location": str(sec.cert_file(sec.client_role)),
            "ssl.key.location": str(sec.key_file(sec.client_role)),
        }

    def launch(self) -> None:
        super().launch()
        try:
            self.front.launch()
        except BaseException:
            super().stop(timeout=2.0)
            raise

    def wait_ready(self, timeout: float | None = None) -> float:
        try:
            self.front.wait_ready(timeout)
        except BaseException:
            super().stop(timeout=2.0)
            raise
        return super().wait_ready(timeout)

    def parts(self) -> list[LocalServer]:
        return [self, self.front]

    def alive(self) -> bool:
        return super().alive() and self.front.alive()

    def stop(self, timeout: float | None = None) -> None:
        self.front.stop(timeout)
        super().stop(timeout)
