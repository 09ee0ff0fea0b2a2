"""Session KV on vLLM through Ballast's KV connector: real vLLM (CPU build), the cache
service on Redis, and a torch worker on the same model folder and store.

The two engines name and lay out blocks the same way, so they share sessions: blocks vLLM
saves hold the same keys and values as the torch engine's for the same tokens; a session
saved by the torch worker is restored by vLLM (its prefix comes from the store, and the
answer equals vLLM's own full recompute), and the other way round. With the cache service
gone, vLLM session requests are still served, recomputed, and the loss is in the metrics.
"""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
import torch

from tests.vllm.conftest import require_vllm

require_vllm()

from services.cache.blocks import chain_hashes  # noqa: E402
from services.cache.client import KVCacheClient  # noqa: E402
from services.cache.types import KVScope  # noqa: E402
from services.worker.app import create_server as create_worker  # noqa: E402
from services.worker.kv.tensors import NAMED_DTYPES  # noqa: E402
from services.worker.vllm.checks import read_model_facts  # noqa: E402
from tests.component.test_kv_worker import (  # noqa: E402
    first_turn,
    generate,
    metric,
    next_turn,
    wait_for,
    worker_config,
)
from tests.component.test_kv_worker import cache, etcd_prefix  # noqa: E402,F401  (fixtures)

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(300)]

BLOCK = 32
QUESTION = (
    "My order 4471 was due on Monday but the tracking page has not changed since "
    "Thursday; can you tell me where it is and when it will arrive at my office?"
)


def _config(etcd_server, model_dir, prefix, cache_address, **extra):
    return worker_config(
        etcd_server, model_dir, prefix, cache_address, BALLAST__WORKER__KV_BLOCK_TOKENS=str(BLOCK), **extra
    )


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def vllm_worker(etcd_server, tiny_model_dir, etcd_prefix, cache):
    facts = read_model_facts(tiny_model_dir)
    app = await create_worker(
        _config(
            etcd_server,
            tiny_model_dir,
            etcd_prefix,
            cache.address,
            BALLAST__WORKER__ENGINE="vllm",
            BALLAST__WORKER__KV_CACHE_DTYPE=facts.weights_dtype,
            BALLAST__WORKER__ENFORCE_EAGER="true",
            BALLAST__WORKER__VLLM_CPU_KV_CACHE_GIB="1",
        )
    )
    assert app.session_kv is not None and app.session_kv.available
    yield app
    await app.shutdown(grace_s=1.0)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def torch_worker(etcd_server, tiny_model_dir, etcd_prefix, cache):
    app = await create_worker(_config(etcd_server, tiny_model_dir, etcd_prefix, cache.address))
    assert app.session_kv is not None and app.session_kv.available
    yield app
    await app.shutdown(grace_s=1.0)


def _names(app, tenant: str, tokens: list[int]) -> list[bytes]:
    return chain_hashes(KVScope(app.engine.model.version, tenant), BLOCK, tokens)


async def _stored(cache, app, tenant: str, tokens: list[int]) -> int:
    client = KVCacheClient(cache.address)
    try:
        return await client.lookup(KVScope(app.engine.model.version, tenant), _names(app, tenant, tokens), 2.0)
    finally:
        await client.close()


async def _wait_stored(cache, app, tenant: str, tokens: list[int], blocks: int) -> None:
    deadline = asyncio.get_running_loop().time() + 20
    while await _stored(cache, app, tenant, tokens) < blocks:
        assert asyncio.get_running_loop().time() < deadline, f"{blocks} blocks of {tenant} were never saved"
        await asyncio.sleep(0.1)


async def _fetch(cache, app, tenant: str, tokens: list[int], blocks: int) -> torch.Tensor:
    layout = app.session_kv.layout
    client = KVCacheClient(cache.address)
    try:
        fetched = await client.get(
            KVScope(app.engine.model.version, tenant), _names(app, tenant, tokens)[:blocks], layout, 5.0
        )
    finally:
        await client.close()
    assert fetched.verified_prefix() == blocks
    data = torch.frombuffer(bytes(fetched.buffer[: blocks * layout.block_bytes]), dtype=torch.uint8)
    return data.view(NAMED_DTYPES[layout.dtype]).view(blocks, *layout.shape)


async def test_blocks_vllm_saves_hold_the_torch_engines_keys_and_values(cache, vllm_worker, torch_worker):
    prompt = first_turn(torch_worker, QUESTION)
    blocks = len(prompt) // BLOCK
    assert blocks >= 2
    await generate(torch_worker, prompt, session="bytes", tenant="bytes-torch", max_tokens=2)
    await generate(vllm_worker, prompt, session="bytes", tenant="bytes-vllm", max_tokens=2)
    await _wait_stored(cache, torch_worker, "bytes-torch", prompt, blocks)
    await _wait_stored(cache, vllm_worker, "bytes-vllm", prompt, blocks)
    assert torch_worker.session_kv.layout == vllm_worker.session_kv.layout
    from_torch = await _fetch(cache, torch_worker, "bytes-torch", prompt, blocks)
    from_vllm = await _fetch(cache, vllm_worker, "bytes-vllm", prompt, blocks)
    # Same keys (after RoPE) and values, up to the two engines' float rounding.
    assert from_vllm.abs().max() > 0.1
    torch.testing.assert_close(from_vllm, from_torch, atol=1e-4, rtol=1e-4)


async def test_a_session_saved_by_torch_is_restored_by_vllm_and_answers_as_a_recompute(
    cache, vllm_worker, torch_worker
):
    tenant = "cross-to-vllm"
    prompt = first_turn(torch_worker, QUESTION)
    answer = await generate(torch_worker, prompt, session="s1", tenant=tenant)
    turn = next_turn(torch_worker, prompt, answer, "Thanks. Can you also check order 4472?")
    await _wait_stored(cache, torch_worker, tenant, prompt + answer, (len(prompt) + len(answer)) // BLOCK)
    reference = await generate(vllm_worker, turn, tenant="cross-reference")  # no session: recomputed
    restored_before = metric(vllm_worker, "ballast_worker_kv_prefix_tokens_total", source="cache")
    hits_before = metric(vllm_worker, "ballast_worker_kv_lookups_total", result="hit")
    got = await generate(vllm_worker, turn, session="s1", tenant=tenant)
    assert got == reference
    assert await wait_for(
        lambda: metric(vllm_worker, "ballast_worker_kv_prefix_tokens_total", source="cache") >= restored_before + BLOCK
    )
    assert metric(vllm_worker, "ballast_worker_kv_lookups_total", result="hit") > hits_before


async def test_a_session_saved_by_vllm_is_restored_by_torch_and_answers_as_a_recompute(
    cache, vllm_worker, torch_worker
):
    tenant = "cross-to-torch"
    prompt = first_turn(vllm_worker, QUESTION)
    answer = await generate(vllm_worker, prompt, session="s2", tenant=tenant)
    turn = next_turn(vllm_worker, prompt, answer, "Thanks. Can you also check order 4473?")
    await _wait_stored(cache, vllm_worker, tenant, prompt + answer, (len(prompt) + len(answer) - 1) // BLOCK)
    assert await wait_for(lambda: metric(vllm_worker, "ballast_worker_kv_saved_blocks_total") > 0)
    reference = await generate(torch_worker, turn, tenant="cross-reference")
    restored_before = metric(torch_worker, "ballast_worker_kv_prefix_tokens_total", source="cache")
    got = await generate(torch_worker, turn, session="s2", tenant=tenant)
    assert got == reference
    assert metric(torch_worker, "ballast_worker_kv_prefix_tokens_total", source="cache") >= restored_before + BLOCK


async def test_with_the_cache_gone_vllm_sessions_recompute_and_say_so(cache, vllm_worker, torch_worker):
    prompt = first_turn(vllm_worker, QUESTION + " Also, is there a fee?")
    reference = await generate(vllm_worker, prompt, tenant="gone-reference")
    await cache.shutdown(grace_s=0.5)
    assert await wait_for(lambda: not vllm_worker.session_kv.available)
    got = await generate(vllm_worker, prompt, session="s3", tenant="gone")
    assert got == reference
    assert await wait_for(
        lambda: (
            metric(vllm_worker, "ballast_worker_kv_lookups_total", result="unavailable") > 0
            or metric(vllm_worker, "ballast_worker_kv_saves_total", outcome="unavailable") > 0
        )
    )
