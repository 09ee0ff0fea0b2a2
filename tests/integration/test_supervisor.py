"""A supervised local mesh, as `ballast up` runs it (simulated workers: no model compute).

Redis, the broker, etcd, a router and a worker are SIGKILLed one at a time: each is started
again by the supervisor (a new PID, its restart and its exit reason in the state file and in
`ballast status`) and requests are served again. A stored better answer that nobody fetched
yet survives a Redis SIGKILL (its append-only file). `ballast down` stops every process,
restarted ones included."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import grpc
import pytest

from ballast.v1 import backfill_pb2, inference_pb2_grpc
from services.cli.client import chat_request, collect, open_channel
from services.cli.mesh import LOCAL_API_KEY, MeshSpec, read_state, stop_recorded, wait_for_workers
from services.cli.supervised import launch_daemon, read_supervisor_state, wait_daemon_ready
from tests.served import assert_served

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(600)]

TENANT = "local"  # the tenant of LOCAL_API_KEY in a local mesh


@pytest.fixture(scope="module")
def mesh_dir(tmp_path_factory, tiny_model_dir):
    state_dir = tmp_path_factory.mktemp("supervised-mesh")
    spec = MeshSpec(
        state_dir=state_dir,
        model_dir=tiny_model_dir,
        workers=2,
        engine="sim",
        lease_ttl_s=3,
        fixed_ports=True,
        redis_persist=True,
    )
    daemon = launch_daemon(spec)
    try:
        wait_daemon_ready(daemon, state_dir, timeout=spec.start_timeout_s)
        wait_for_workers(Path(read_state(state_dir)["config"]), 2, timeout=60)
    except BaseException:
        daemon.stop(timeout=60)
        stop_recorded(state_dir)
        raise
    yield state_dir
    stop_recorded(state_dir)
    daemon.stop(timeout=10)  # reaps it (already stopped by then)


def child(state_dir: Path, name: str) -> dict:
    return next(c for c in read_supervisor_state(state_dir)["children"] if c["name"] == name)


def wait_restarted(state_dir: Path, name: str, old_pid: int, timeout_s: float = 90.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        entry = child(state_dir, name)
        if entry["status"] == "up" and entry["pid"] not in (None, old_pid):
            return entry
        assert time.monotonic() < deadline, f"{name} was not restarted: {entry}"
        time.sleep(0.1)


async def served_again(state_dir: Path, timeout_s: float = 60.0) -> None:
    """A request is served through the router (retried while the mesh recovers)."""
    router = read_state(state_dir)["router"]
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        async with open_channel(router) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            try:
                result = await collect(
                    stub,
                    chat_request("Where is my order?", max_tokens=8, raw_prompt=True, allow_degraded=False),
                    LOCAL_API_KEY,
                    timeout=10,
                )
                if result.finished is not None and not result.finished.degradation:
                    assert_served(result)
                    return
                last = result.finished
            except grpc.aio.AioRpcError as error:
                last = error.code()
        await asyncio.sleep(0.5)
    pytest.fail(f"no request served within {timeout_s:.0f}s after the restart (last: {last})")


def ballast_status(state_dir: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "services.cli.main", "status", "--state-dir", str(state_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("name", ["redis", "kafka", "etcd", "router", "worker-1"])
async def test_a_killed_process_is_restarted_and_requests_are_served(mesh_dir, name):
    await served_again(mesh_dir)
    before = child(mesh_dir, name)
    assert before["status"] == "up"
    os.kill(before["pid"], signal.SIGKILL)
    after = await asyncio.to_thread(wait_restarted, mesh_dir, name, before["pid"])
    assert after["restarts"] == before["restarts"] + 1
    assert after["last_exit"]["signal"] == "SIGKILL"
    assert not after["last_exit"]["oom_killed"]
    # mesh.json (what `ballast down` reads) follows the new PID.
    assert next(p for p in read_state(mesh_dir)["processes"] if p["name"] == name)["pid"] == after["pid"]
    row = next(line for line in ballast_status(mesh_dir).splitlines() if line.startswith(f"{name} "))
    assert str(after["pid"]) in row and "killed by SIGKILL" in row
    assert row.split()[3] == str(after["restarts"])
    await served_again(mesh_dir)


async def test_an_undelivered_better_answer_survives_a_redis_restart(mesh_dir):
    import redis.asyncio as aioredis

    from services.backfill.store import AnswerStore
    from services.common.degraded.codec import make_ticket
    from services.config import load_config

    config = load_config(Path(read_state(mesh_dir)["config"]), environ={})
    ticket = make_ticket(TENANT, f"req-{uuid.uuid4().hex}")
    answer = backfill_pb2.BackfilledAnswer(ticket=ticket, tenant=TENANT, text="the better answer", model="tiny")
    client = aioredis.Redis.from_url(config.redis.url)
    try:
        store = AnswerStore(client, config.backfill.redis_prefix, config.backfill.answer_retention_s)
        assert await store.put_once(answer)
    finally:
        await client.aclose()
    # Redis appends a write to its file before it answers: the ticket is there now.
    aof_dir = mesh_dir / "redis" / "appendonlydir"
    assert any(ticket.encode() in f.read_bytes() for f in aof_dir.iterdir())
    before = child(mesh_dir, "redis")
    os.kill(before["pid"], signal.SIGKILL)
    await asyncio.to_thread(wait_restarted, mesh_dir, "redis", before["pid"])
    deadline = time.monotonic() + 60
    async with open_channel(read_state(mesh_dir)["router"]) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        while True:
            try:
                got = await stub.GetBackfill(
                    backfill_pb2.GetAnswerRequest(ticket=ticket), metadata=(("x-api-key", LOCAL_API_KEY),), timeout=10
                )
                break
            except grpc.aio.AioRpcError as error:
                # The backfill service reconnects to Redis; NOT_FOUND would mean the answer is lost.
                assert error.code() == grpc.StatusCode.UNAVAILABLE, error
                assert time.monotonic() < deadline, "the backfill service never reached Redis again"
                await asyncio.sleep(0.3)
    assert got.text == "the better answer" and got.ticket == ticket


async def test_down_stops_every_process_restarted_ones_included(mesh_dir):
    supervisor_pid = read_state(mesh_dir)["supervisor"]["pid"]
    pids = [c["pid"] for c in read_supervisor_state(mesh_dir)["children"]]
    assert None not in pids and len(pids) == 8
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "services.cli.main", "down", "--state-dir", str(mesh_dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "mismatch" not in done.stdout
    assert not any(alive(pid) for pid in pids + [supervisor_pid])
    assert not (mesh_dir / "mesh.json").exists()


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
