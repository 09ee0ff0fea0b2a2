"""One router of two processes on one port (`router.processes: 2`): clients that open their own
connections reach both processes through the one address, each answer served by the model
(not degraded); a process SIGKILLed is started again by its parent while the other keeps the
port serving; and SIGTERM to the parent stops both."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import grpc
import psutil
import pytest

from ballast.v1 import inference_pb2_grpc
from services.cli.client import chat_request, collect
from services.cli.mesh import LOCAL_API_KEY, Mesh, MeshSpec
from services.common.grpc_server import CHANNEL_OPTIONS
from tests.integration.test_mesh import metric_value, scrape
from tests.served import assert_served

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(300)]

PROMPT = "Is the red charger in stock, and what does it cost?"
PROCESS_LINE = re.compile(r"^PROCESS router (\d+)/(\d+) pid=(\d+) metrics=(\d+)$")


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_model_dir):
    # A slot for every request a test sends at once: each process admits on its own view of the
    # worker, and a queued request on a router without measured service times yet may be
    # degraded by its wait estimate (the tests here are about the port, not admission).
    spec = MeshSpec(
        state_dir=tmp_path_factory.mktemp("router-processes"),
        model_dir=tiny_model_dir,
        workers=1,
        worker_capacity=24,
        overrides={"router": {"processes": 2}},
    )
    running = Mesh(spec).start()
    try:
        # Mesh.start waits for the worker's lease; a router process that started before the
        # worker registered learns of it from its watch a moment later, and a request it takes
        # meanwhile finds no live worker and is degraded.
        for _, metrics_port in processes(running).values():
            asyncio.run(wait_routes(metrics_port))
        yield running
    finally:
        running.stop()


def router_service(mesh):
    return next(s for s in mesh.services if s.name == "router")


def processes(mesh) -> dict[int, tuple[int, int]]:
    """Each slot's latest process, from the parent's log: slot -> (pid, metrics port)."""
    found: dict[int, tuple[int, int]] = {}
    for line in router_service(mesh).process.log_path.read_text(errors="replace").splitlines():
        match = PROCESS_LINE.match(line.strip())
        if match:
            found[int(match[1])] = (int(match[3]), int(match[4]))
    return found


async def served_by_fresh_connections(mesh, count: int) -> None:
    """`count` requests, each on a connection of its own (no shared subchannel), all served."""

    async def one(i: int) -> None:
        options = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
        async with grpc.aio.insecure_channel(mesh.router_address, options=options) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            result = await collect(stub, chat_request(PROMPT, max_tokens=8, raw_prompt=True), LOCAL_API_KEY)
            assert_served(result)

    await asyncio.gather(*(one(i) for i in range(count)))


async def wait_routes(metrics_port: int, timeout: float = 30.0) -> None:
    """Until the router process behind `metrics_port` counts a routable worker (its own view)."""
    deadline = time.monotonic() + timeout
    while metric_value(await scrape(metrics_port), "ballast_router_worker_routable") < 1:
        assert time.monotonic() < deadline, f"the router process on metrics port {metrics_port} routes to no worker"
        await asyncio.sleep(0.1)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def requests_of(metrics_port: int) -> float:
    return metric_value(await scrape(metrics_port), "ballast_router_requests_total")


async def test_two_processes_serve_one_address(mesh):
    children = processes(mesh)
    assert sorted(children) == [0, 1]
    parent = psutil.Process(router_service(mesh).process.pid)
    assert {pid for pid, _ in children.values()} == {child.pid for child in parent.children()}
    before = {slot: await requests_of(port) for slot, (_, port) in children.items()}
    await served_by_fresh_connections(mesh, 24)
    after = {slot: await requests_of(port) for slot, (_, port) in children.items()}
    served = {slot: after[slot] - before[slot] for slot in children}
    print(f"requests served per process: {served}")
    assert sum(served.values()) == 24
    # The kernel spread the connections: both processes took some (24 connections all landing
    # on one of two listeners has odds of 1 in 2^23).
    assert all(count > 0 for count in served.values()), served


async def test_a_killed_process_comes_back_and_the_port_keeps_serving(mesh):
    children = processes(mesh)
    killed_pid = children[1][0]
    os.kill(killed_pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    # Gone means reaped by its parent, not a zombie: a killed thread-group leader shows as a
    # zombie while its other threads are still exiting, and until the last of them has, the
    # process's files (its listening socket among them) stay open, so a connection the kernel
    # hands that socket meanwhile is reset when it closes.
    while psutil.pid_exists(killed_pid):
        assert time.monotonic() < deadline, "the killed router process is still there"
        await asyncio.sleep(0.05)
    # Its listening socket went with it: the other process holds the port meanwhile.
    await served_by_fresh_connections(mesh, 6)
    deadline = time.monotonic() + 60
    while processes(mesh)[1][0] == killed_pid:
        assert time.monotonic() < deadline, "the killed router process was not started again"
        await asyncio.sleep(0.2)
    new_pid, port = processes(mesh)[1]
    assert psutil.pid_exists(new_pid)
    await wait_routes(port)
    before = await requests_of(port)
    await served_by_fresh_connections(mesh, 24)
    assert await requests_of(port) > before


async def test_sigterm_to_the_parent_stops_every_process(mesh):
    parent = router_service(mesh).process.pid
    pids = [pid for pid, _ in processes(mesh).values()]
    assert all(alive(pid) for pid in pids)
    os.kill(parent, signal.SIGTERM)  # the parent alone: it must pass the stop on
    deadline = time.monotonic() + 30
    while alive(parent) or any(alive(pid) for pid in pids):
        assert time.monotonic() < deadline, "a router process outlived its parent's SIGTERM"
        await asyncio.sleep(0.1)
