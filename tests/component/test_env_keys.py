"""API keys given through the environment replace the config file's, on a real router: a key
only the file names is refused, so a key is revoked by leaving it out of
BALLAST__AUTH__API_KEYS; a key from the environment whose tenant has no grant claims A and B
only (its S is capped, never refused), while a granted tenant's S stays S."""

from __future__ import annotations

import json

import grpc
import pytest
import pytest_asyncio

from ballast.v1 import common_pb2, inference_pb2_grpc
from services.cli.client import chat_request, collect, open_channel
from services.router.app import create_server as create_router
from tests.component.conftest import API_KEY, TENANT, make_config
from tests.served import assert_served

pytestmark = pytest.mark.asyncio(loop_scope="session")

REVOKED_KEY, ENV_KEY = "revoked-key", "env-only-key"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def env_router(etcd_server, tiny_model_dir, etcd_prefix, worker_app, tmp_path_factory):
    path = tmp_path_factory.mktemp("env-keys") / "ballast.yaml"
    path.write_text(
        json.dumps(
            {
                "auth": {"api_keys": {REVOKED_KEY: TENANT, API_KEY: TENANT}},
                "router": {"quotas": {"prompt_chars_per_token": 2.5}},
            }
        )
    )
    # make_config grants TENANT every tier; newco, named by the environment alone, has no grant.
    config = make_config(
        etcd_server,
        tiny_model_dir,
        etcd_prefix,
        BALLAST_CONFIG=str(path),
        BALLAST__AUTH__API_KEYS=json.dumps({API_KEY: TENANT, ENV_KEY: "newco"}),
    )
    assert config.router.quotas.prompt_chars_per_token == 2.5  # the file was read
    assert set(config.auth.api_keys) == {API_KEY, ENV_KEY}
    app = await create_router(config)
    assert await app.membership.wait_for(lambda workers: worker_app.worker_id in workers, timeout=10)
    yield app
    await app.shutdown(grace_s=1.0)


async def test_environment_keys_replace_the_files_and_ungranted_tenants_get_a_and_b(env_router):
    async with open_channel(env_router.address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as revoked:
            await collect(stub, chat_request("hi", max_tokens=2, raw_prompt=True), REVOKED_KEY)
        assert revoked.value.code() == grpc.StatusCode.UNAUTHENTICATED
        kept = await collect(stub, chat_request("hi", max_tokens=2, tier="S", raw_prompt=True), API_KEY)
        assert_served(kept)
        assert (kept.started.tier, kept.started.tier_reason) == (common_pb2.TIER_S, "explicit")
        capped = await collect(stub, chat_request("hi", max_tokens=2, tier="S", raw_prompt=True), ENV_KEY)
        assert_served(capped)
        assert (capped.started.tier, capped.started.tier_reason) == (common_pb2.TIER_A, "capped_by_grant")
