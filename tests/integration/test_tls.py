"""The local mesh under mutual TLS (`ballast up --secure`): requests flow through every
service, a caller without the right certificate or role is refused before any work, the
router's certificate can be replaced on disk while it runs, and etcd and Redis are secured
too (TLS with client certificates, and a password user), and the Kafka broker (TLS with
client certificates), with every service still reaching them."""

from __future__ import annotations

import asyncio
import socket
import ssl

import aetcd.exceptions
import grpc
import pytest
import redis
from confluent_kafka import Consumer, KafkaException, Producer
from confluent_kafka.admin import AdminClient
from cryptography import x509

from ballast.v1 import inference_pb2_grpc, kvcache_pb2, kvcache_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.cli import certs
from services.cli.client import chat_request, collect, open_channel
from services.cli.etcd_view import list_workers
from services.cli.mesh import LOCAL_API_KEY, Mesh, MeshSpec
from services.common.config import EtcdConfig
from services.common.etcd_client import make_client
from services.common.tls.credentials import open_channel as open_service_channel
from services.config import load_config
from tests.integration.test_mesh import metric_value, scrape, wait_streams_on_workers
from tests.served import assert_served

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="session")]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_model_dir):
    spec = MeshSpec(
        state_dir=tmp_path_factory.mktemp("secure-mesh"),
        model_dir=tiny_model_dir,
        workers=1,
        worker_capacity=4,
        secure=True,
    )
    running = Mesh(spec).start()
    yield running
    running.stop()


def mesh_tls(mesh):
    """The mesh's tls section: the cli's certificate."""
    return load_config(mesh.config_path, environ={}).tls


def role_tls(mesh, role, directory=None):
    directory = directory or mesh.certs_dir
    return mesh_tls(mesh).model_copy(
        update={"cert_file": str(certs.cert_path(directory, role)), "key_file": str(certs.key_path(directory, role))}
    )


async def ask(mesh, text="Is the red charger in stock?", session=""):
    async with open_channel(mesh.router_address, mesh_tls(mesh)) as channel:
        return await collect(
            inference_pb2_grpc.InferenceStub(channel),
            chat_request(text, max_tokens=8, session_id=session),
            LOCAL_API_KEY,
            timeout=60,
        )


async def worker_state(mesh):
    worker = mesh.workers()[0]
    records = [record for record, _ in await list_workers(load_config(mesh.config_path, environ={}).etcd)]
    served = metric_value(await scrape(worker.metrics_port), "ballast_worker_requests_total")
    return worker.address, records[0].in_flight, served


async def test_a_request_streams_through_the_secured_mesh(mesh):
    result = await ask(mesh, session="secure-session")
    assert_served(result)
    assert result.token_ids
    # The router reached the backfill, the worker the cache, both over mutual TLS.
    router = next(s for s in mesh.services if s.name == "router")
    assert metric_value(await scrape(router.metrics_port), "ballast_dependency_up", dependency="backfill") == 1
    worker = mesh.workers()[0]
    assert metric_value(await scrape(worker.metrics_port), "ballast_dependency_up", dependency="kvcache") == 1


def generate_request():
    request = worker_pb2.WorkerGenerateRequest(prompt_ids=[1, 2, 3])
    request.sampling.max_tokens = 4
    return request


async def refused_generate(channel) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in worker_pb2_grpc.WorkerStub(channel).Generate(generate_request(), timeout=10):
            pass
    return caught.value.code()


async def test_callers_without_the_right_certificate_reach_no_worker(mesh, tmp_path):
    address, in_flight_before, served_before = await worker_state(mesh)
    async with grpc.aio.insecure_channel(address) as channel:
        assert await refused_generate(channel) == grpc.StatusCode.UNAVAILABLE
    other = certs.init_certs(tmp_path / "other-ca", roles=("router",))
    foreign = role_tls(mesh, "router", other).model_copy(update={"ca_file": str(other / certs.CA_CERT)})
    async with open_service_channel(address, foreign) as channel:
        assert await refused_generate(channel) in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED)
    async with open_service_channel(address, role_tls(mesh, "worker")) as channel:
        assert await refused_generate(channel) == grpc.StatusCode.PERMISSION_DENIED
    cache = next(s for s in mesh.services if s.name == "cache")
    async with open_service_channel(cache.address, role_tls(mesh, "cli")) as channel:
        put = kvcache_pb2_grpc.KVCacheStub(channel).Put(iter([kvcache_pb2.KVPutRequest()]), timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await put
        assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    _, in_flight_after, served_after = await worker_state(mesh)
    assert (in_flight_after, served_after) == (in_flight_before, served_before)


def presented_serial(address: str, ca_file: str) -> int:
    host, port = address.rsplit(":", 1)
    context = ssl.create_default_context(cafile=ca_file)
    context.set_alpn_protocols(["h2"])
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        with context.wrap_socket(raw, server_hostname=host) as tls_socket:
            return x509.load_der_x509_certificate(tls_socket.getpeercert(binary_form=True)).serial_number


async def test_certificates_rotate_under_load_without_a_restart_or_a_broken_stream(mesh):
    router = next(s for s in mesh.services if s.name == "router")
    worker = mesh.workers()[0]
    pids = (router.pid, worker.pid)
    requests = [chat_request(f"Tell me about the red charger #{i}", max_tokens=1500, raw_prompt=True) for i in range(3)]

    async def stream(request):
        async with open_channel(mesh.router_address, mesh_tls(mesh)) as channel:
            return await collect(inference_pb2_grpc.InferenceStub(channel), request, LOCAL_API_KEY, timeout=120)

    references = [await stream(request) for request in requests]
    tasks = [asyncio.create_task(stream(request)) for request in requests]
    await wait_streams_on_workers([worker], tasks)

    # New certificates for the router, the worker and the cache while the streams run.
    ca_file = str(mesh.certs_dir / certs.CA_CERT)
    before = await asyncio.to_thread(presented_serial, mesh.router_address, ca_file)
    authority = certs.load_authority(mesh.certs_dir)
    for role in ("router", "worker", "cache"):
        certs.write_role(mesh.certs_dir, authority, role)
    new_serial = x509.load_pem_x509_certificate(certs.cert_path(mesh.certs_dir, "router").read_bytes()).serial_number
    assert new_serial != before
    assert await asyncio.to_thread(presented_serial, mesh.router_address, ca_file) == new_serial
    assert not all(task.done() for task in tasks), "every stream ended before the rotation"

    for result, reference in zip(await asyncio.gather(*tasks), references):
        assert_served(reference)
        assert_served(result)
        # Not broken and moved: it ran to its end where it started, token for token.
        assert result.finished.resumes == 0
        assert result.token_ids == reference.token_ids
    # New connections after the rotation work too.
    for _ in range(2):
        assert_served(await ask(mesh))
    assert (router.pid, worker.pid) == pids


async def test_etcd_and_redis_are_secured_and_every_service_reaches_them(mesh):
    config = load_config(mesh.config_path, environ={})
    # The services reach both: the worker is registered (etcd), the cache and the backfill
    # service say Redis is up, the router says etcd is.
    assert [record.address for record, _ in await list_workers(config.etcd)] == [mesh.workers()[0].address]
    for name, dependency in (("cache", "redis"), ("backfill", "redis"), ("router", "etcd"), ("backfill", "etcd")):
        service = next(s for s in mesh.services if s.name == name)
        assert metric_value(await scrape(service.metrics_port), "ballast_dependency_up", dependency=dependency) == 1, (
            name,
            dependency,
        )

    # etcd: no TLS, TLS without a user, a wrong password: each refused.
    etcd = config.etcd
    refused = [
        EtcdConfig(host=etcd.host, port=etcd.port, timeout_s=2),
        EtcdConfig(host=etcd.host, port=etcd.port, timeout_s=2, tls=etcd.tls),
        EtcdConfig(
            host=etcd.host,
            port=etcd.port,
            timeout_s=2,
            tls=etcd.tls,
            username=etcd.username,
            password=etcd.password + "x",
        ),
    ]
    for settings in refused:
        client = make_client(settings)
        with pytest.raises((aetcd.exceptions.ClientError, OSError, asyncio.TimeoutError)):
            await client.get(f"{etcd.prefix}workers/".encode())
        await client.close()

    # Redis: plaintext, TLS without a certificate, a wrong password, no user: each refused.
    host, port = mesh.redis.host, mesh.redis.port
    tls_files = {
        "ssl": True,
        "ssl_ca_certs": config.redis.tls.ca_file,
        "ssl_certfile": config.redis.tls.cert_file,
        "ssl_keyfile": config.redis.tls.key_file,
    }
    attempts = [
        {},
        {
            "ssl": True,
            "ssl_ca_certs": config.redis.tls.ca_file,
            "username": config.redis.username,
            "password": config.redis.password,
        },
        {**tls_files, "username": config.redis.username, "password": config.redis.password + "x"},
        tls_files,
    ]
    for kwargs in attempts:
        client = redis.Redis(host=host, port=port, socket_timeout=3, socket_connect_timeout=3, **kwargs)
        with pytest.raises(
            (
                redis.exceptions.ConnectionError,
                redis.exceptions.AuthenticationError,
                redis.exceptions.ResponseError,
                redis.exceptions.TimeoutError,
            )
        ):
            client.ping()
        client.close()
    # And the right files and user get in.
    client = redis.Redis(
        host=host,
        port=port,
        socket_timeout=3,
        **tls_files,
        username=config.redis.username,
        password=config.redis.password,
    )
    assert client.ping()
    client.close()


async def test_the_kafka_broker_takes_only_clients_with_a_certificate(mesh):
    config = load_config(mesh.config_path, environ={})
    bootstrap = config.kafka.bootstrap
    # The backfill service reaches the broker through its TLS front: its check (metadata from
    # the admin client, and the producer) passes.
    backfill = next(s for s in mesh.services if s.name == "backfill")
    assert metric_value(await scrape(backfill.metrics_port), "ballast_dependency_up", dependency="kafka") == 1

    # With the mesh's certificate a record goes in and comes back out.
    secured = {"bootstrap.servers": bootstrap, **config.kafka.security_properties()}
    assert secured["security.protocol"] == "SSL"
    topic = "ballast-tls-check"
    producer = Producer({**secured, "message.timeout.ms": 10000})
    producer.produce(topic, b"sealed")
    assert producer.flush(15) == 0
    consumer = Consumer({**secured, "group.id": "tls-check", "auto.offset.reset": "earliest"})
    consumer.subscribe([topic])
    try:
        values = []
        for _ in range(30):
            message = consumer.poll(1.0)
            if message is not None and message.error() is None:
                values.append(message.value())
                break
        assert values == [b"sealed"]
    finally:
        consumer.close()

    # Plaintext, and TLS without a client certificate: no metadata.
    tls = config.kafka.tls
    for refused in (
        {"bootstrap.servers": bootstrap},
        {"bootstrap.servers": bootstrap, "security.protocol": "SSL", "ssl.ca.location": tls.ca_file},
    ):
        admin = AdminClient({**refused, "socket.timeout.ms": 2000, "log_level": 0})
        with pytest.raises(KafkaException):
            admin.list_topics(timeout=3)
