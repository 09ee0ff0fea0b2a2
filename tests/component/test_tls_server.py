"""A gRPC server under mutual TLS, in process: role rules per call type, refused handshakes,
and a server certificate replaced on disk taking effect at the next connection."""

import asyncio
import socket
import ssl

import grpc
import pytest
from cryptography import x509

from services.cli import certs
from services.common.grpc_server import bind, new_server
from services.common.tls.credentials import open_channel, public_server_credentials, server_credentials
from services.common.tls.settings import TLSConfig


def tls_for(directory, role, **changes):
    return TLSConfig(
        enabled=True,
        ca_file=str(directory / certs.CA_CERT),
        cert_file=str(certs.cert_path(directory, role)),
        key_file=str(certs.key_path(directory, role)),
        **changes,
    )


@pytest.fixture(scope="module")
def cert_dir(tmp_path_factory):
    return certs.init_certs(tmp_path_factory.mktemp("certs"))


class Calls:
    def __init__(self):
        self.count = 0

    def handlers(self):
        async def unary(request, context):
            self.count += 1
            return request

        async def server_stream(request, context):
            self.count += 1
            yield request

        async def client_stream(requests, context):
            self.count += 1
            return b"".join([r async for r in requests])

        return [
            grpc.method_handlers_generic_handler(
                "ballast.v1.Worker",
                {
                    "Generate": grpc.unary_stream_rpc_method_handler(server_stream),
                    "GetModelInfo": grpc.unary_unary_rpc_method_handler(unary),
                },
            ),
            grpc.method_handlers_generic_handler(
                "ballast.v1.KVCache", {"Put": grpc.stream_unary_rpc_method_handler(client_stream)}
            ),
            grpc.method_handlers_generic_handler(
                "ballast.v1.Inference", {"Generate": grpc.unary_stream_rpc_method_handler(server_stream)}
            ),
        ]


async def serve(tls, credentials):
    calls = Calls()
    server = new_server(tls=tls)
    server.add_generic_rpc_handlers(calls.handlers())
    port = bind(server, "127.0.0.1", 0, credentials)
    await server.start()
    return server, port, calls


async def call(channel, method, kind="unary"):
    if kind == "unary":
        return await channel.unary_unary(method)(b"x", timeout=5)
    if kind == "server_stream":
        return [m async for m in channel.unary_stream(method)(b"x", timeout=5)]
    return await channel.stream_unary(method)(iter([b"a", b"b"]), timeout=5)


async def refused(channel, method, kind="unary") -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call(channel, method, kind)
    return caught.value.code()


async def test_internal_port_allows_only_the_calling_role(cert_dir):
    server, port, calls = await serve(
        tls_for(cert_dir, "worker"), server_credentials(tls_for(cert_dir, "worker"), "worker")
    )
    address = f"127.0.0.1:{port}"
    try:
        async with open_channel(address, tls_for(cert_dir, "router")) as channel:
            assert await call(channel, "/ballast.v1.Worker/Generate", "server_stream") == [b"x"]
            assert await call(channel, "/ballast.v1.Worker/GetModelInfo") == b"x"
        assert calls.count == 2
        async with open_channel(address, tls_for(cert_dir, "worker")) as channel:
            assert (
                await refused(channel, "/ballast.v1.Worker/Generate", "server_stream")
                == grpc.StatusCode.PERMISSION_DENIED
            )
            assert await refused(channel, "/ballast.v1.Worker/GetModelInfo") == grpc.StatusCode.PERMISSION_DENIED
        async with open_channel(address, tls_for(cert_dir, "cli")) as channel:
            assert (
                await refused(channel, "/ballast.v1.KVCache/Put", "client_stream") == grpc.StatusCode.PERMISSION_DENIED
            )
            assert await call(channel, "/ballast.v1.Inference/Generate", "server_stream") == [b"x"]
        async with open_channel(address, tls_for(cert_dir, "worker")) as channel:
            assert await call(channel, "/ballast.v1.KVCache/Put", "client_stream") == b"ab"
        assert calls.count == 4  # the refused calls reached no handler
    finally:
        await server.stop(0)


async def test_handshake_refuses_no_certificate_and_another_ca(cert_dir, tmp_path):
    server, port, calls = await serve(
        tls_for(cert_dir, "worker"), server_credentials(tls_for(cert_dir, "worker"), "worker")
    )
    address = f"127.0.0.1:{port}"
    other = certs.init_certs(tmp_path / "other", roles=("router",))
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            assert await refused(channel, "/ballast.v1.Worker/GetModelInfo") == grpc.StatusCode.UNAVAILABLE
        ca_only = grpc.ssl_channel_credentials((cert_dir / certs.CA_CERT).read_bytes())
        async with grpc.aio.secure_channel(address, ca_only) as channel:
            assert await refused(channel, "/ballast.v1.Worker/GetModelInfo") == grpc.StatusCode.UNAVAILABLE
        # The other CA's router certificate, presented by a client that trusts our CA.
        foreign_credentials = grpc.ssl_channel_credentials(
            (cert_dir / certs.CA_CERT).read_bytes(),
            certs.key_path(other, "router").read_bytes(),
            certs.cert_path(other, "router").read_bytes(),
        )
        async with grpc.aio.secure_channel(address, foreign_credentials) as channel:
            assert await refused(channel, "/ballast.v1.Worker/GetModelInfo") == grpc.StatusCode.UNAVAILABLE
        assert calls.count == 0
    finally:
        await server.stop(0)


def presented_serial(port: int, ca_file) -> int:
    context = ssl.create_default_context(cafile=str(ca_file))
    context.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls_socket:
            return x509.load_der_x509_certificate(tls_socket.getpeercert(binary_form=True)).serial_number


async def test_public_port_needs_no_client_certificate_and_reloads_its_own(cert_dir, tmp_path):
    # The router's files in a folder of their own: this test replaces them.
    own = tmp_path / "router"
    own.mkdir()
    (own / certs.CA_CERT).write_bytes((cert_dir / certs.CA_CERT).read_bytes())
    authority = certs.load_authority(cert_dir)
    certs.write_role(own, authority, "router")
    tls = tls_for(own, "router")
    server, port, calls = await serve(tls, public_server_credentials(tls, "router"))
    address = f"127.0.0.1:{port}"
    ca_only = grpc.ssl_channel_credentials((cert_dir / certs.CA_CERT).read_bytes())
    try:
        before = await asyncio.to_thread(presented_serial, port, own / certs.CA_CERT)
        async with grpc.aio.secure_channel(address, ca_only) as channel:
            assert await call(channel, "/ballast.v1.Inference/Generate", "server_stream") == [b"x"]
        certs.write_role(own, authority, "router")
        after = await asyncio.to_thread(presented_serial, port, own / certs.CA_CERT)
        assert after != before
        assert after == x509.load_pem_x509_certificate(certs.cert_path(own, "router").read_bytes()).serial_number
        async with grpc.aio.secure_channel(address, ca_only) as channel:
            assert await call(channel, "/ballast.v1.Inference/Generate", "server_stream") == [b"x"]
    finally:
        await server.stop(0)


async def test_a_broken_replacement_keeps_the_working_certificate(cert_dir, tmp_path):
    own = tmp_path / "worker"
    own.mkdir()
    (own / certs.CA_CERT).write_bytes((cert_dir / certs.CA_CERT).read_bytes())
    certs.write_role(own, certs.load_authority(cert_dir), "worker")
    tls = tls_for(own, "worker")
    server, port, calls = await serve(tls, server_credentials(tls, "worker"))
    try:
        before = await asyncio.to_thread(presented_serial_with_client, port, cert_dir)
        certs.key_path(own, "worker").write_text("half-written\n")
        after = await asyncio.to_thread(presented_serial_with_client, port, cert_dir)
        assert after == before
    finally:
        await server.stop(0)


def presented_serial_with_client(port: int, cert_dir) -> int:
    context = ssl.create_default_context(cafile=str(cert_dir / certs.CA_CERT))
    context.load_cert_chain(str(certs.cert_path(cert_dir, "router")), str(certs.key_path(cert_dir, "router")))
    context.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls_socket:
            return x509.load_der_x509_certificate(tls_socket.getpeercert(binary_form=True)).serial_number


async def test_the_plaintext_health_port_serves_health_checks_only(cert_dir):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from services.common.grpc_server import add_health_and_reflection, bind_health_port, set_serving

    tls = tls_for(cert_dir, "worker", health_port=0)
    calls = Calls()
    server = new_server(tls=tls)
    server.add_generic_rpc_handlers(calls.handlers())
    health = add_health_and_reflection(server, ["ballast.v1.Worker"])
    port = bind(server, "127.0.0.1", 0, server_credentials(tls, "worker"))
    health_port = bind_health_port(server, "127.0.0.1", tls)
    await server.start()
    await set_serving(health, ["ballast.v1.Worker"], True)
    try:
        assert health_port and health_port != port
        async with grpc.aio.insecure_channel(f"127.0.0.1:{health_port}") as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            for method, kind in (
                ("/ballast.v1.Worker/Generate", "server_stream"),
                ("/ballast.v1.Worker/GetModelInfo", "unary"),
                ("/ballast.v1.KVCache/Put", "client_stream"),
                ("/ballast.v1.Inference/Generate", "server_stream"),
            ):
                assert await refused(channel, method, kind) == grpc.StatusCode.PERMISSION_DENIED, method
        # The TLS port still serves the router as before.
        async with open_channel(f"127.0.0.1:{port}", tls_for(cert_dir, "router")) as channel:
            assert await call(channel, "/ballast.v1.Worker/GetModelInfo") == b"x"
        assert calls.count == 1  # nothing that came in plaintext reached a handler
    finally:
        await server.stop(0)


async def test_no_health_port_unless_asked_or_without_tls(cert_dir):
    from services.common.grpc_server import bind_health_port

    server = new_server()
    try:
        assert bind_health_port(server, "127.0.0.1", tls_for(cert_dir, "worker")) is None
        assert bind_health_port(server, "127.0.0.1", TLSConfig(health_port=0)) is None
    finally:
        await server.stop(0)
