"""Session affinity through the real router: a session's turns stay on the worker that holds
its KV, and move when that worker overheats."""

from __future__ import annotations

import uuid

import pytest
import pytest_asyncio

from ballast.v1 import inference_pb2_grpc
from services.cli.client import chat_request, collect, open_channel
from services.router.app import create_server as create_router
from services.worker.app import create_server as create_worker
from tests.component.conftest import API_KEY, make_config
from tests.polling import poll

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(300)]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def mesh(etcd_server, tiny_model_dir, tmp_path_factory):
    prefix = f"/ballast-affinity-{uuid.uuid4().hex[:8]}/"
    folder = tmp_path_factory.mktemp("affinity")
    workers = []
    for name in ("w-a", "w-b"):
        config = make_config(
            etcd_server,
            tiny_model_dir,
            prefix,
            BALLAST__WORKER__ID=name,
            BALLAST__WORKER__TEMPERATURE_FILE=str(folder / f"{name}.temperature"),
            BALLAST__ETCD__HEARTBEAT_S="0.2",
        )
        workers.append(await create_worker(config))
    router = await create_router(make_config(etcd_server, tiny_model_dir, prefix))
    assert await router.membership.wait_for(lambda ws: {"w-a", "w-b"} <= set(ws), timeout=10)
    yield router, {w.worker_id: w for w in workers}, folder
    await router.shutdown(grace_s=1.0)
    for worker in workers:
        await worker.shutdown(grace_s=1.0)


def published(router, worker_id: str) -> float | None:
    """The temperature the router's membership holds for a worker (a heartbeat and a watch
    after the worker read it)."""
    record = router.membership.get(worker_id)
    return record.temperature_c if record is not None else None


def served_by(workers, before):
    return {wid: w.state.served - before[wid] for wid, w in workers.items()}


async def test_session_turns_stick_to_one_worker_until_it_overheats(mesh):
    router, workers, folder = mesh
    async with open_channel(router.address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        before = {wid: w.state.served for wid, w in workers.items()}
        for turn in range(6):
            await collect(stub, chat_request(f"turn {turn}", max_tokens=4, session_id="s-1"), API_KEY)
        counts = served_by(workers, before)
        assert sorted(counts.values()) == [0, 6], counts
        home = next(wid for wid, n in counts.items() if n == 6)
        other = next(wid for wid in workers if wid != home)
        # Another session spreads to the idle worker; the first one still sticks.
        (folder / f"{home}.temperature").write_text("85")
        assert await poll(lambda: published(router, home) == 85, 15), "the router never saw 85"
        before = {wid: w.state.served for wid, w in workers.items()}
        for turn in range(3):
            await collect(stub, chat_request(f"hot turn {turn}", max_tokens=4, session_id="s-1"), API_KEY)
        assert served_by(workers, before) == {home: 0, other: 3}
        # The session now lives on the other worker, and stays there.
        (folder / f"{home}.temperature").write_text("60")
        assert await poll(lambda: published(router, home) == 60, 15), "the router never saw 60"
        before = {wid: w.state.served for wid, w in workers.items()}
        for turn in range(3):
            await collect(stub, chat_request(f"cool turn {turn}", max_tokens=4, session_id="s-1"), API_KEY)
        assert served_by(workers, before) == {home: 0, other: 3}
