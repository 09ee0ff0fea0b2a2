"""The HTTP front under TLS: with TLS on the public port, the OpenAI-compatible API is HTTPS
with the same certificates (a client trusting the mesh's CA gets answers, streamed too, and
the curl line `ballast up --secure` prints works), and plaintext HTTP is refused there."""

from __future__ import annotations

import asyncio
import json
import logging
import ssl

import httpx
import pytest
import pytest_asyncio

from services.cli import certs
from services.cli.commands import openai_curl
from services.router.app import create_server as create_router
from services.worker.app import create_server as create_worker
from tests.component.conftest import API_KEY, make_config

pytestmark = pytest.mark.asyncio(loop_scope="session")

CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Is the red charger in stock?"}],
    "max_tokens": 8,
    "temperature": 0,
}


@pytest.fixture(scope="module")
def cert_dir(tmp_path_factory):
    return certs.init_certs(tmp_path_factory.mktemp("certs"))


def tls_env(directory, role: str) -> dict[str, str]:
    return {
        "BALLAST__TLS__ENABLED": "true",
        "BALLAST__TLS__CA_FILE": str(directory / certs.CA_CERT),
        "BALLAST__TLS__CERT_FILE": str(certs.cert_path(directory, role)),
        "BALLAST__TLS__KEY_FILE": str(certs.key_path(directory, role)),
    }


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def secure_worker(etcd_server, tiny_model_dir, etcd_prefix, cert_dir):
    app = await create_worker(make_config(etcd_server, tiny_model_dir, etcd_prefix, **tls_env(cert_dir, "worker")))
    await app.registration.registered.wait()
    yield app
    await app.shutdown(grace_s=1.0)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def secure_router(etcd_server, tiny_model_dir, etcd_prefix, cert_dir, secure_worker):
    app = await create_router(
        make_config(
            etcd_server, tiny_model_dir, etcd_prefix, BALLAST__ROUTER__HTTP_PORT="0", **tls_env(cert_dir, "router")
        )
    )
    assert await app.membership.wait_for(lambda workers: secure_worker.worker_id in workers, timeout=10)
    yield app
    await app.shutdown(grace_s=1.0)


def _port(app) -> str:
    return app.http_address.rsplit(":", 1)[1]


async def test_https_with_the_mesh_ca_answers_streamed_and_not(secure_router, cert_dir):
    assert secure_router.http.scheme == "https"
    trust = ssl.create_default_context(cafile=str(cert_dir / certs.CA_CERT))
    async with httpx.AsyncClient(
        base_url=f"https://127.0.0.1:{_port(secure_router)}/v1",
        verify=trust,
        timeout=30,
        headers={"Authorization": f"Bearer {API_KEY}"},
    ) as client:
        assert "tiny" in [m["id"] for m in (await client.get("/models")).json()["data"]]
        whole = await client.post("/chat/completions", json=CHAT)
        assert whole.status_code == 200, whole.text
        assert whole.json()["ballast"]["degradation"] == "none"
        async with client.stream("POST", "/chat/completions", json={**CHAT, "stream": True}) as stream:
            lines = [line async for line in stream.aiter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        text = "".join(
            json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
            for line in lines[:-1]
            if json.loads(line[6:])["choices"]
        )
        assert text == whole.json()["choices"][0]["message"]["content"]


async def test_plaintext_http_is_refused_on_the_https_port(secure_router, cert_dir, caplog):
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            async with httpx.AsyncClient(timeout=10) as client:
                with pytest.raises(httpx.TransportError):
                    await client.get(
                        f"http://127.0.0.1:{_port(secure_router)}/v1/models",
                        headers={"Authorization": f"Bearer {API_KEY}"},
                    )
    # A client that does not trust the mesh's CA is refused by its own side.
    async with httpx.AsyncClient(timeout=10) as client:
        with pytest.raises(httpx.ConnectError):
            await client.get(f"https://127.0.0.1:{_port(secure_router)}/v1/models")
    trust = ssl.create_default_context(cafile=str(cert_dir / certs.CA_CERT))
    async with httpx.AsyncClient(verify=trust, timeout=10) as client:
        response = await client.get(
            f"https://127.0.0.1:{_port(secure_router)}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}
        )
    assert response.status_code == 200
    assert not [r for r in caplog.records if r.exc_info], caplog.records[:3]


async def test_the_printed_curl_line_streams_an_answer(secure_router, cert_dir):
    line = openai_curl(f"https://127.0.0.1:{_port(secure_router)}/v1", API_KEY, cert_dir)
    assert "--cacert" in line
    process = await asyncio.create_subprocess_shell(
        line + " -sS --max-time 30", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, err
    assert out.rstrip().endswith(b"data: [DONE]"), out[-300:]
