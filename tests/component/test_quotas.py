"""Per-tenant quotas through a real router and worker: a tenant at its requests-per-minute
limit is refused RESOURCE_EXHAUSTED with reason quota_exceeded and a retry hint, nothing
runs on the worker for the refused request, another tenant is not affected, and the tenant
is served again once the hint's time has passed."""

from __future__ import annotations

import asyncio
import math
import time

import grpc
import pytest
import pytest_asyncio

from services.cli.client import chat_request, collect, open_channel
from services.common.faults import RETRY_AFTER_KEY
from services.router.app import create_server as create_router
from tests.component.conftest import API_KEY, TENANT, make_config
from tests.served import assert_served
from ballast.v1 import inference_pb2_grpc

pytestmark = pytest.mark.asyncio(loop_scope="session")

LIMIT = 20  # requests per minute: a burst of 20, then one every 3 s
OTHER_KEY = "other-key"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def quota_router(etcd_server, tiny_model_dir, etcd_prefix, worker_app):
    config = make_config(
        etcd_server,
        tiny_model_dir,
        etcd_prefix,
        **{
            "BALLAST__AUTH__API_KEYS": f'{{"{API_KEY}": "{TENANT}", "{OTHER_KEY}": "other"}}',
            "BALLAST__ROUTER__QUOTAS__TENANTS": f'{{"{TENANT}": {{"requests_per_minute": {LIMIT}}}}}',
        },
    )
    app = await create_router(config)
    assert await app.membership.wait_for(lambda workers: worker_app.worker_id in workers, timeout=10)
    yield app
    await app.shutdown(grace_s=1.0)


async def test_a_tenant_over_its_quota_is_refused_with_a_hint_and_served_after_it(quota_router, worker_app):
    async with open_channel(quota_router.address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        served_before = worker_app.state.served
        # Requests one after another until the first refusal. The bucket refills while they
        # run (one request every 60 / LIMIT s), so a slow machine may be served a few more
        # than the burst: exactly as many as the time they took refilled.
        started = time.monotonic()
        served = 0
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            while served <= 2 * LIMIT:
                assert_served(await collect(stub, chat_request(f"q{served}", max_tokens=1, raw_prompt=True), API_KEY))
                served += 1
        refilled = (time.monotonic() - started) * LIMIT / 60
        assert LIMIT <= served <= LIMIT + math.floor(refilled), (served, refilled)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        trailers = dict(refused.value.trailing_metadata() or ())
        assert trailers["ballast-reason"] == "quota_exceeded"
        hint_s = int(trailers[RETRY_AFTER_KEY]) / 1000
        assert 0 < hint_s <= 60 / LIMIT
        assert worker_app.state.served == served_before + served  # the refused one never ran
        # Another tenant has its own (unlimited) quota.
        assert_served(await collect(stub, chat_request("other", max_tokens=1, raw_prompt=True), OTHER_KEY))
        await asyncio.sleep(hint_s + 0.1)
        assert_served(await collect(stub, chat_request("after the hint", max_tokens=1, raw_prompt=True), API_KEY))
