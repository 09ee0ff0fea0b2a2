"""Readiness of a gRPC server from its grpc.health.v1 Check (SERVING), not from its log."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


class GrpcHealthProbe:
    """Callable probe: True when `address` answers Check(service) with SERVING.

    With `root_certificates` the channel speaks TLS (and presents `certificate_chain` /
    `private_key` when given: a server that requires client certificates)."""

    def __init__(
        self,
        address: str,
        service: str = "",
        timeout_s: float = 1.0,
        *,
        root_certificates: bytes | None = None,
        private_key: bytes | None = None,
        certificate_chain: bytes | None = None,
    ) -> None:
        self.address = address
        self.service = service
        self.timeout_s = timeout_s
        self._credentials = (
            grpc.ssl_channel_credentials(root_certificates, private_key, certificate_chain)
            if root_certificates is not None
            else None
        )

    def __call__(self) -> bool:
        channel = (
            grpc.secure_channel(self.address, self._credentials)
            if self._credentials is not None
            else grpc.insecure_channel(self.address)
        )
        try:
            stub = health_pb2_grpc.HealthStub(channel)
            answer = stub.Check(health_pb2.HealthCheckRequest(service=self.service), timeout=self.timeout_s)
        except grpc.RpcError:
            return False
        finally:
            channel.close()
        return answer.status == health_pb2.HealthCheckResponse.SERVING

    def __repr__(self) -> str:
        return f"GrpcHealthProbe({self.address!r})"
