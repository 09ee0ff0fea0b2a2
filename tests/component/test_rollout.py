"""Rollouts through the real router: two model versions on real workers, the rollout document
in real etcd written by `ballast rollout`, and the SLO gate writing its own decisions."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio
import yaml

from ballast.v1 import inference_pb2_grpc
from services.cli.client import chat_request, collect, open_channel
from services.cli.main import main as ballast
from services.common.membership import make_client
from services.router.app import RouterApp, create_server as create_router
from services.router.rollout.split import Role, choose
from services.router.rollout.state import Phase, Rollout
from services.router.rollout.store import RolloutStore
from services.worker.app import WorkerApp, create_server as create_worker
from services.worker.engine import EngineRequest, Sampling
from tests.component.conftest import API_KEY, TENANT, make_config
from tests.model_variants import tiny_model_v2_dir  # noqa: F401  (fixture)

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(240)]

PROMPTS = (
    "Where is my order? I paid for a blue phone case yesterday.",
    "Can I pay with PayPal?",
    "I was charged twice for the coffee maker.",
    "Is the winter coat in stock?",
    "How do I change my delivery address?",
    "The customer paid for a gift card with",
)


@dataclass
class RolloutMesh:
    router: RouterApp
    stable: WorkerApp
    candidate: WorkerApp
    fault_file: Path
    config_file: Path

    @property
    def v1(self) -> str:
        return self.stable.engine.model.version

    @property
    def v2(self) -> str:
        return self.candidate.engine.model.version


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def mesh(etcd_server, tiny_model_dir, tiny_model_v2_dir, tmp_path_factory):
    prefix = f"/ballast-rollout-{uuid.uuid4().hex[:8]}/"
    folder = tmp_path_factory.mktemp("rollout")
    fault_file = folder / "candidate.fault"
    fast = {"BALLAST__ETCD__HEARTBEAT_S": "0.2"}
    stable = await create_worker(make_config(etcd_server, tiny_model_dir, prefix, BALLAST__WORKER__ID="w-v1", **fast))
    candidate = await create_worker(
        make_config(
            etcd_server,
            tiny_model_v2_dir,
            prefix,
            BALLAST__WORKER__ID="w-v2",
            BALLAST__WORKER__FAULT_FILE=str(fault_file),
            **fast,
        )
    )
    router = await create_router(make_config(etcd_server, tiny_model_dir, prefix))
    assert await router.membership.wait_for(lambda ws: {"w-v1", "w-v2"} <= set(ws), timeout=10)
    assert await router.servicer.rollouts.leader.wait_leader(timeout=15)
    config_file = folder / "ballast.yaml"
    config_file.write_text(
        yaml.safe_dump({"etcd": {"host": etcd_server.host, "port": etcd_server.port, "prefix": prefix}})
    )
    yield RolloutMesh(router, stable, candidate, fault_file, config_file)
    await router.shutdown(grace_s=1.0)
    for worker in (stable, candidate):
        await worker.shutdown(grace_s=1.0)


@pytest_asyncio.fixture(loop_scope="session")
async def stub(mesh):
    async with open_channel(mesh.router.address) as channel:
        yield inference_pb2_grpc.InferenceStub(channel)


async def cli(mesh: RolloutMesh, capsys, *args: str) -> tuple[int, str]:
    """Runs `ballast rollout ...` as an operator would (in a thread: it runs its own loop)."""
    capsys.readouterr()
    code = await asyncio.to_thread(ballast, ["rollout", *args, "--config", str(mesh.config_file)])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


async def stored(mesh: RolloutMesh) -> Rollout | None:
    client = make_client(mesh.router.config.etcd)
    try:
        await client.connect()
        found = await RolloutStore(client, mesh.router.config.etcd).read("tiny")
        return found.rollout if found is not None else None
    finally:
        await client.close()


async def router_follows(mesh: RolloutMesh, predicate, timeout: float = 10.0) -> Rollout:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        rollout = mesh.router.servicer.rollouts.rollouts.get("tiny")
        if rollout is not None and predicate(rollout):
            return rollout
        assert asyncio.get_running_loop().time() < deadline, f"router still has {rollout}"
        await asyncio.sleep(0.05)


async def ask(stub, session_id: str, prompt: str = PROMPTS[0], max_tokens: int = 2):
    return await collect(
        stub, chat_request(prompt, max_tokens=max_tokens, raw_prompt=True, session_id=session_id), API_KEY
    )


async def greedy(worker: WorkerApp, prompt: str, max_tokens: int) -> list[int]:
    ids = []
    request = EngineRequest(
        "direct", tuple(worker.engine.tokenize(prompt)), (), Sampling(max_tokens=max_tokens, temperature=0.0)
    )
    async for delta in worker.engine.generate(request):
        ids.extend(delta.token_ids)
    return ids


LONG_GATE = ("--window-s", "3600", "--min-requests", "100000")


async def test_a_ten_percent_canary_takes_its_sessions_and_keeps_them(mesh, stub, capsys):
    code, out = await cli(mesh, capsys, "start", "tiny", mesh.v2, "--weight", "10", *LONG_GATE)
    assert code == 0, out
    assert f"stable     {mesh.v1}" in out and "running (canary)" in out
    rollout = await router_follows(mesh, lambda r: r.running and r.candidate == mesh.v2)
    assert rollout.stable == mesh.v1  # inferred from the one version the workers ran

    sessions = [f"canary-{i}" for i in range(60)]
    served = {sid: (await ask(stub, sid)).started.model_version for sid in sessions}
    expected = {sid for sid in sessions if choose(rollout, TENANT, sid, "").role is Role.CANDIDATE}
    assert 2 <= len(expected) <= 14  # about a tenth of 60
    assert {sid for sid, version in served.items() if version == mesh.v2} == expected
    assert set(served.values()) == {mesh.v1, mesh.v2}

    # Later turns of the same conversations never hop versions.
    for sid in sorted(expected)[:4] + [s for s in sessions if s not in expected][:4]:
        for _turn in range(2):
            assert (await ask(stub, sid)).started.model_version == served[sid]

    code, out = await cli(mesh, capsys, "status", "tiny")
    assert code == 0 and "running (canary), candidate weight 10%" in out
    code, out = await cli(mesh, capsys, "abort", "tiny", "--reason", "test over")
    assert code == 0 and "rolled_back" in out
    await router_follows(mesh, lambda r: r.state is Phase.ROLLED_BACK)
    assert {(await ask(stub, sid)).started.model_version for sid in sorted(expected)[:3]} == {mesh.v1}


async def test_mirrored_answers_never_reach_the_client(mesh, stub, capsys):
    expected = {p: await greedy(mesh.stable, p, 8) for p in PROMPTS}
    candidate_answers = {p: await greedy(mesh.candidate, p, 8) for p in PROMPTS}
    assert any(expected[p] != candidate_answers[p] for p in PROMPTS)  # the versions do differ

    code, out = await cli(mesh, capsys, "start", "tiny", mesh.v2, "--weight", "0", "--mirror", "100", *LONG_GATE)
    assert code == 0, out
    await router_follows(mesh, lambda r: r.running and r.mirror_percent == 100)
    scored = []
    mesh.router.servicer.rollouts.mirrors.business_score = lambda request, primary, candidate: (
        scored.append((request.request_id, primary, candidate)) or float(primary == candidate)
    )
    copies_before = mesh.candidate.state.served
    for i, prompt in enumerate(PROMPTS):
        result = await ask(stub, f"mirror-{i}", prompt, max_tokens=8)
        assert result.started.model_version == mesh.v1
        assert result.token_ids == expected[prompt]

    # Every request was copied to the candidate, and every copy was compared and measured.
    rollouts = mesh.router.servicer.rollouts
    for _ in range(200):
        if rollouts.reading("tiny").requests == len(PROMPTS):
            break
        await asyncio.sleep(0.05)
    assert mesh.candidate.state.served - copies_before == len(PROMPTS)
    assert rollouts.reading("tiny").requests == len(PROMPTS) and rollouts.reading("tiny").errors == 0
    metrics = mesh.router.telemetry.render()
    assert f'ballast_rollout_mirror_requests_total{{model="tiny",outcome="compared"}} {len(PROMPTS)}.0' in metrics
    assert "ballast_rollout_mirror_token_agreement_count" in metrics
    # The business hook saw both answers: the primary's is what the client got.
    assert (
        len(scored) == len(PROMPTS)
        and f'ballast_rollout_mirror_business_score_count{{model="tiny"}} {len(PROMPTS)}' in metrics
    )
    assert any(primary != candidate for _id, primary, candidate in scored)
    mesh.router.servicer.rollouts.mirrors.business_score = None
    code, out = await cli(mesh, capsys, "abort", "tiny")
    assert code == 0, out


async def test_a_clean_candidate_is_promoted_by_the_gate(mesh, stub, capsys):
    code, out = await cli(
        mesh, capsys, "start", "tiny", mesh.v2, "--weight", "50", "--window-s", "2", "--min-requests", "5"
    )
    assert code == 0, out
    await router_follows(mesh, lambda r: r.running and r.weight == 50)
    # Bursts of asks, so the gate's 2 s window holds its 5 candidate samples however long
    # one ask takes on this machine; the loop is bounded by time, not by a count.
    deadline = time.monotonic() + 60
    burst = 0
    while True:
        await asyncio.gather(*(ask(stub, f"promote-{burst}-{i}") for i in range(8)))
        burst += 1
        decided = await stored(mesh)
        if not decided.running or time.monotonic() > deadline:
            break
    assert decided.state is Phase.PROMOTED, decided
    assert decided.reason.startswith("gate: clean window") and decided.weight == 100
    await router_follows(mesh, lambda r: r.state is Phase.PROMOTED)
    assert {(await ask(stub, f"after-promotion-{i}")).started.model_version for i in range(6)} == {mesh.v2}
    assert 'decision="promote",model="tiny",outcome="written"' in mesh.router.telemetry.render()


async def test_an_erroring_candidate_is_rolled_back_and_clients_never_see_it(mesh, stub, capsys):
    mesh.fault_file.write_text("unavailable")
    try:
        code, out = await cli(mesh, capsys, "start", "tiny", mesh.v2, "--stable", mesh.v1, "--weight", "50", *LONG_GATE)
        assert code == 0, out
        rollout = await router_follows(mesh, lambda r: r.running and r.stable == mesh.v1)
        answered = []
        for i in range(60):
            result = await ask(stub, f"faulty-{i}")
            answered.append(result)
            decided = await stored(mesh)
            if not decided.running:
                break
        assert decided.state is Phase.ROLLED_BACK, decided
        assert "error rate" in decided.reason and decided.weight == 0
        # Canary requests failed on the candidate before any token and fell back to stable.
        assert all(r.finished is not None and r.started.model_version == mesh.v1 for r in answered)
        canaries = [
            f"faulty-{i}" for i in range(200) if choose(rollout, TENANT, f"faulty-{i}", "").role is Role.CANDIDATE
        ]
        await router_follows(mesh, lambda r: r.state is Phase.ROLLED_BACK)
        assert {(await ask(stub, sid)).started.model_version for sid in canaries[:4]} == {mesh.v1}
        code, out = await cli(mesh, capsys, "promote", "tiny")
        assert code == 2 and "already rolled_back" in out
    finally:
        mesh.fault_file.unlink(missing_ok=True)


async def test_a_bad_document_is_refused_and_the_rollout_in_force_stays(mesh, capsys):
    before = Rollout("tiny", mesh.v1, mesh.v2).decided(Phase.ROLLED_BACK, "baseline")
    client = make_client(mesh.router.config.etcd)
    try:
        await client.connect()
        store = RolloutStore(client, mesh.router.config.etcd)
        await client.put(store.key("tiny"), before.to_json())
        await router_follows(mesh, lambda r: r == before)
        await client.put(store.key("tiny"), b'{"model": "tiny", "stable": "a", "candidate": "a", "weight": 10}')
        for _ in range(100):
            if 'ballast_rollout_rejected_documents_total{model="tiny"}' in mesh.router.telemetry.render():
                break
            await asyncio.sleep(0.05)
        assert mesh.router.servicer.rollouts.rollouts["tiny"] == before
        code, out = await cli(mesh, capsys, "status")
        assert code == 0 and "tiny: invalid: rollout field 'candidate'" in out
        code, out = await cli(mesh, capsys, "start", "tiny", mesh.v2, "--stable", mesh.v1)
        assert code == 2 and "is invalid" in out
    finally:
        await client.close()


async def test_of_two_writers_with_the_same_revision_only_one_wins(mesh):
    client = make_client(mesh.router.config.etcd)
    try:
        await client.connect()
        store = RolloutStore(client, mesh.router.config.etcd)
        await client.put(store.key("tiny"), Rollout("tiny", mesh.v1, mesh.v2, reason="baseline").to_json())
        seen = await store.read("tiny")
        promote = seen.rollout.decided(Phase.PROMOTED, "writer a")
        roll_back = seen.rollout.decided(Phase.ROLLED_BACK, "writer b")
        results = await asyncio.gather(store.swap(promote, seen.mod_revision), store.swap(roll_back, seen.mod_revision))
        assert sorted(results) == [False, True]
        assert (await store.read("tiny")).rollout == (promote if results[0] else roll_back)
        # A document that does not exist yet can be created only once.
        fresh = Rollout("tiny-new", "a", "b")
        assert await store.swap(fresh, 0) and not await store.swap(fresh, 0)
    finally:
        await client.close()
