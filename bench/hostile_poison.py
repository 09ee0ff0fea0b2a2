"""A hostile case: a query of death against a running local mesh of sim workers.

`poison_case(mesh)` arms every sim worker with the `crash_on_marker` fault knob (through its
etcd fault key; a worker its keeper restarts reads it again), sends one request whose prompt
holds the marker, and measures what it cost:

- `workers_lost`: worker processes that died (a keeper's serving pid changed, or the process
  is gone), over the whole case; goal at most 2.
- `backfill_replays`: replays the backfill ran meanwhile, after a degraded copy of the poison
  was handed to Kafka as a router that degraded it before the quarantine would have; goal 0
  (the backfill parks it instead: `parked` says whether it did within the wait).
- `served_again_s`: seconds from sending the poison until a normal request (degradation off)
  was served again; goal at most 10.
- `workers_back_s`: seconds from sending the poison until every worker runs and is registered
  again (their keepers restarted the lost ones); reported, not judged.

Also: the poison's answer (`answer_code`, `answer_reason`: FAILED_PRECONDITION, quarantined,
never a degraded 200), whether a retry of it under a new request id was refused without a
worker lost, and `goals_met`. Self-contained; the hostile-case harness calls it.

    python -m bench.hostile_poison   # starts a 3-worker sim mesh under keepers, prints, writes JSON
"""

from __future__ import annotations

import asyncio
import json
import secrets
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from bench.common import metric_total

_PF_EXITING = 0x4  # linux/sched.h: the task is getting shut down
GOALS = {"workers_lost": 2, "backfill_replays": 0, "served_again_s": 10.0}
RESULT = Path("bench/results/hostile_poison.json")


def _serving_pids(mesh) -> dict[str, int | None]:
    """Per worker: the pid serving now (a keeper's child, else the process itself; None: dead)."""
    from services.worker.keeper import serving_pid

    pids = {}
    for worker in mesh.workers():
        alive = worker.process.alive()
        child = serving_pid(worker.pid) if alive and worker.pid else None
        pid = child or (worker.pid if alive else None)
        pids[worker.name] = pid if process_running(pid) else None
    return pids


def process_running(pid: int | None) -> bool:
    """A live process: not gone, not a zombie (a worker that just died is one until its keeper
    reaps it) and not on its way out (the poison tests read workers with it too)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (OSError, TypeError):
        return False
    # A process that began exiting (PF_EXITING in its flags) is dead already: it closes its
    # sockets on the way out, so a router can see it gone while it is not yet a zombie.
    return fields[0] not in ("Z", "X") and not int(fields[6]) & _PF_EXITING


def _lost(before: dict[str, int | None], after: dict[str, int | None]) -> int:
    return sum(1 for name, pid in before.items() if pid is not None and after.get(name) != pid)


async def _metric(port: int | None, name: str, **labels: str) -> float:
    if not port:
        return 0.0
    return metric_total(await asyncio.to_thread(_scrape, port), name, **labels)


def _scrape(port: int) -> str:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as reply:
            return reply.read().decode()
    except OSError:
        return ""


def _port(mesh, name: str) -> int | None:
    return next((s.metrics_port for s in mesh.services if s.name == name), None)


async def _set_marker(mesh, marker: str | None) -> None:
    from services.common.etcd_client import make_client
    from services.config import load_config
    from services.worker.sim.faults import SimFaults, faults_key

    etcd = load_config(mesh.config_path, environ={}).etcd
    client = make_client(etcd)
    try:
        for worker in mesh.workers():
            key = faults_key(etcd.prefix, worker.name).encode()
            if marker is None:
                await client.delete(key)
            else:
                await client.put(key, SimFaults(crash_on_marker=marker).to_json().encode())
    finally:
        await client.close()


async def _leases(mesh) -> dict[str, int | None]:
    """Each worker's etcd lease now (a restarted worker registers under a new one)."""
    from services.cli.etcd_view import list_workers
    from services.config import load_config

    etcd = load_config(mesh.config_path, environ={}).etcd
    try:
        return {record.id: record.lease_id for record, _ in await list_workers(etcd)}
    except Exception:  # noqa: BLE001 - etcd busy: nothing known this time
        return {}


async def _all_back(mesh, pids_before: dict, leases_before: dict, deadline: float) -> float | None:
    """When every worker process runs again and each lost one registered under a new lease
    (None: not by `deadline`)."""
    while time.monotonic() < deadline:
        pids = _serving_pids(mesh)
        if all(pids.values()):
            leases = await _leases(mesh)
            if all(
                leases.get(name) is not None and (pids[name] == pid or leases[name] != leases_before.get(name))
                for name, pid in pids_before.items()
            ):
                return time.monotonic()
        await asyncio.sleep(0.1)
    return None


async def _answer(router, request, api_key: str) -> tuple[str, str, bool]:
    """(status code name, ballast reason, degraded) of one request's outcome."""
    from services.cli.client import collect
    from services.common.faults import REASON_KEY

    try:
        result = await collect(router, request, api_key, timeout=60)
    except grpc.aio.AioRpcError as error:
        reason = next((v for k, v in (error.trailing_metadata() or ()) if k == REASON_KEY), "")
        return error.code().name, reason, False
    return "OK", "", bool(result.finished is not None and result.finished.degradation)


async def _hand_off_degraded(mesh, poison, tenant: str) -> None:
    """A degraded copy of the poison on the degraded topic, as a router would have written it."""
    from services.common.degraded.codec import Level, degraded_request_pb, kafka_key, make_ticket
    from services.router.degrade.handoff import HandOff, HandOffSettings
    from services.common.tier import Tier
    from services.router.requests import InferenceRequest, Message
    from services.common.generation import Sampling

    request = InferenceRequest(
        request_id=poison.request_id,
        session_id="",
        tenant=tenant,
        model=poison.model,
        sampling=Sampling(max_tokens=poison.sampling.max_tokens, temperature=0.0),
        tier=Tier.A,
        messages=tuple(Message(m.role, m.content) for m in poison.conversation.messages),
    )
    ticket = make_ticket(tenant, poison.request_id + "-degraded")
    record = degraded_request_pb(
        request,
        ticket=ticket,
        tier=Tier.A,
        level=Level.RULES,
        reason="no_worker",
        degraded_text="(rules)",
        degraded_by="rules",
        received_at=time.time(),
    )
    with tempfile.TemporaryDirectory() as folder:
        handoff = HandOff(
            HandOffSettings(
                outbox_path=Path(folder) / "outbox.sqlite", bootstrap=mesh.kafka.bootstrap, delivery_timeout_s=5
            )
        )
        await handoff.start()
        try:
            await handoff.submit(kafka_key("", ticket), record.SerializeToString())
        finally:
            await handoff.stop(10.0)


async def poison_case(
    mesh,
    api_key: str | None = None,
    tenant: str = "local",
    model: str = "tiny",
    arm: bool = True,
    park_wait_s: float = 60.0,
) -> dict[str, Any]:
    """Runs the poison case on `mesh` (a running services.cli.mesh.Mesh of sim workers).
    `arm`: set the marker knob through etcd (False: the workers' config already holds
    `marker`, passed as the mesh spec's `worker.sim_faults.crash_on_marker`)."""
    from ballast.v1 import inference_pb2_grpc
    from services.cli.client import chat_request, open_channel
    from services.cli.mesh import LOCAL_API_KEY

    api_key = api_key or LOCAL_API_KEY
    configured = mesh.spec.overrides.get("worker", {}).get("sim_faults", {}).get("crash_on_marker")
    marker = configured if not arm and configured else f"POISON-{secrets.token_hex(4)}"
    if arm:
        await _set_marker(mesh, marker)
        await asyncio.sleep(1.0)  # the knob reaches each worker through its etcd watch
    router_port, backfill_port = _port(mesh, "router"), _port(mesh, "backfill")
    replays_before = await _metric(backfill_port, "ballast_backfill_replays_total")
    parked_before = await _metric(backfill_port, "ballast_backfill_dead_lettered_total", cause="quarantined")
    before = _serving_pids(mesh)
    leases_before = await _leases(mesh)
    poison = chat_request(
        f"Summarise this: {marker}", model=model, max_tokens=16, request_id=f"poison-{secrets.token_hex(4)}"
    )
    result: dict[str, Any] = {}
    try:
        async with open_channel(mesh.router_address) as channel:
            router = inference_pb2_grpc.InferenceStub(channel)
            started = time.monotonic()
            result["answer_code"], result["answer_reason"], result["answer_degraded"] = await _answer(
                router, poison, api_key
            )
            answered = time.monotonic()
            lost_by_poison = _serving_pids(mesh)
            retry = chat_request(
                f"Summarise this: {marker}",
                model=model,
                max_tokens=16,
                request_id=f"poison-retry-{secrets.token_hex(4)}",
            )
            retry_code, retry_reason, _ = await _answer(router, retry, api_key)
            result["retry_refused"] = retry_code == "FAILED_PRECONDITION" and retry_reason == "quarantined"
            result["retry_workers_lost"] = _lost(lost_by_poison, _serving_pids(mesh))
            served_at = None
            while time.monotonic() - answered < 60:
                code, _reason, degraded = await _answer(
                    router, chat_request("Where is my order?", model=model, max_tokens=8, allow_degraded=False), api_key
                )
                if code == "OK" and not degraded:
                    served_at = time.monotonic()
                    break
                await asyncio.sleep(0.2)
            result["served_again_s"] = None if served_at is None else round(served_at - started, 3)
            result["answer_s"] = round(answered - started, 3)
            back = await _all_back(mesh, before, leases_before, started + 60)
            result["workers_back_s"] = None if back is None else round(back - started, 3)
        await _hand_off_degraded(mesh, poison, tenant)
        deadline = time.monotonic() + park_wait_s
        parked = False
        while time.monotonic() < deadline:
            if (
                await _metric(backfill_port, "ballast_backfill_dead_lettered_total", cause="quarantined")
                > parked_before
            ):
                parked = True
                break
            await asyncio.sleep(0.5)
        result["parked"] = parked
        result["backfill_replays"] = int(
            await _metric(backfill_port, "ballast_backfill_replays_total") - replays_before
        )
        result["workers_lost"] = _lost(before, _serving_pids(mesh))
        result["quarantined_metric"] = await _metric(
            router_port, "ballast_router_quarantine_total", event="quarantined"
        )
    finally:
        if arm:
            await _set_marker(mesh, None)
    served = result.get("served_again_s")
    result["goals_met"] = {
        "workers_lost": result["workers_lost"] <= GOALS["workers_lost"],
        "backfill_replays": result["backfill_replays"] <= GOALS["backfill_replays"],
        "served_again_s": served is not None and served <= GOALS["served_again_s"],
        "quarantined_not_degraded": result["answer_code"] == "FAILED_PRECONDITION"
        and result["answer_reason"] == "quarantined",
    }
    return result


def main() -> int:
    """Starts a small sim mesh (3 workers under keepers), runs the case, prints and writes JSON."""
    from bench.common import model_dir_for, print_table, write_result
    from services.cli.mesh import Mesh, MeshSpec

    with tempfile.TemporaryDirectory(prefix="ballast-poison-") as state:
        spec = MeshSpec(
            state_dir=Path(state),
            model_dir=model_dir_for("tiny"),
            workers=3,
            engine="sim",
            lease_ttl_s=3,
            worker_capacity=4,
            overrides={"worker": {"respawn": True}},
        )
        mesh = Mesh(spec).start()
        try:
            result = asyncio.run(poison_case(mesh))
        finally:
            mesh.stop()
    print_table(
        ["measure", "value", "goal"],
        [
            ("workers lost", result["workers_lost"], f"<= {GOALS['workers_lost']}"),
            ("backfill replays", result["backfill_replays"], f"<= {GOALS['backfill_replays']}"),
            ("served again (s)", result["served_again_s"], f"<= {GOALS['served_again_s']}"),
            ("all workers back (s)", result["workers_back_s"], "-"),
            ("answer", f"{result['answer_code']} {result['answer_reason']}", "FAILED_PRECONDITION quarantined"),
        ],
    )
    write_result(RESULT, {"case": "poison", **result})
    print(json.dumps(result["goals_met"]))
    return 0 if all(result["goals_met"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
