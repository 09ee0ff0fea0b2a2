"""In-process router and worker servers on port 0 against a real etcd (one per test module)."""

from __future__ import annotations

import tempfile
import uuid
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from ballast.v1 import inference_pb2_grpc, worker_pb2_grpc
from services.common.grpc_server import CHANNEL_OPTIONS
from services.config import load_config
from services.router.app import create_server as create_router
from services.worker.app import create_server as create_worker

API_KEY = "test-key"
TENANT = "acme"


def make_config(etcd_server, model_dir, prefix: str, **overrides):
    # Each router gets its own outbox; component tests run no broker, so no hand-off.
    outbox = Path(tempfile.mkdtemp(prefix="ballast-outbox-")) / "degraded.sqlite"
    environ = {
        "BALLAST__DEGRADE__OUTBOX_PATH": str(outbox),
        "BALLAST__DEGRADE__HANDOFF": "false",
        "BALLAST__ETCD__HOST": etcd_server.host,
        "BALLAST__ETCD__PORT": str(etcd_server.port),
        "BALLAST__ETCD__PREFIX": prefix,
        # Router and worker share one event loop (and the GIL with the engine thread) here; on a
        # loaded 2-core CI host a 3 s lease can lapse between heartbeats, and a re-granted lease
        # looks like a new worker incarnation with free slots. No test here times lease expiry.
        "BALLAST__ETCD__LEASE_TTL_S": "10",
        "BALLAST__AUTH__API_KEYS": f'{{"{API_KEY}": "{TENANT}"}}',
        # The tier tests ask for S: this tenant may claim every tier.
        "BALLAST__AUTH__TENANTS": f'{{"{TENANT}": {{"tiers": ["S", "A", "B"]}}}}',
        "BALLAST__ROUTER__PORT": "0",
        "BALLAST__ROUTER__MODELS": '["tiny", "tiny-unserved"]',
        "BALLAST__WORKER__PORT": "0",
        "BALLAST__WORKER__MODEL_DIR": str(model_dir),
        "BALLAST__WORKER__MAX_CONCURRENCY": "4",
        "BALLAST__WORKER__DRAIN_GRACE_S": "5",
        "BALLAST__TELEMETRY__METRICS_PORT": "0",
    }
    environ.update(overrides)
    return load_config(environ=environ)


@pytest.fixture(scope="module")
def etcd_prefix():
    return f"/ballast-test-{uuid.uuid4().hex[:8]}/"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def worker_app(etcd_server, tiny_model_dir, etcd_prefix):
    app = await create_worker(make_config(etcd_server, tiny_model_dir, etcd_prefix))
    await app.registration.registered.wait()
    yield app
    await app.shutdown(grace_s=1.0)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def router_app(etcd_server, tiny_model_dir, etcd_prefix, worker_app):
    app = await create_router(make_config(etcd_server, tiny_model_dir, etcd_prefix))
    assert await app.membership.wait_for(lambda workers: worker_app.worker_id in workers, timeout=10)
    yield app
    await app.shutdown(grace_s=1.0)


@pytest_asyncio.fixture(loop_scope="session")
async def router_stub(router_app):
    async with grpc.aio.insecure_channel(router_app.address, options=CHANNEL_OPTIONS) as channel:
        yield inference_pb2_grpc.InferenceStub(channel)


@pytest_asyncio.fixture(loop_scope="session")
async def worker_stub(worker_app):
    async with grpc.aio.insecure_channel(worker_app.address, options=CHANNEL_OPTIONS) as channel:
        yield worker_pb2_grpc.WorkerStub(channel)
