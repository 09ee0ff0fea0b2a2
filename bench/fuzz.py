"""Fuzzing every RPC of a live local mesh: nothing crashes, every call ends with a defined
status, and a canary tenant's session, KV and answers are unchanged afterwards.

One run starts the local mesh (router, two tiny-model workers, the cache on Redis, the
backfill service on the Kafka-protocol broker, etcd), then:
  1. the canary: tenant "local" runs a greedy session turn and its next turn; the worker
     saves the session's KV to the cache (its blocks are looked up by name);
  2. for each of the 13 RPCs (public Inference, the internal Worker, KVCache and Backfill
     services), `--cases` frames from `bench.fuzz_cases` (structured, mutated templates,
     raw bytes) plus one oversized frame, sent as raw bytes with a short deadline, at most
     `--concurrency` at once; the public API is called with the fuzz tenant's key, no key, or
     a wrong one;
  3. the canary again: the same turn must give the same answer, its KV blocks must still be
     there, and every service must be the same process as before, with its memory and open
     files within bounds.
A call "ends with a defined status" when it gets OK or a gRPC status the services set on
purpose; UNKNOWN (an unhandled exception in a handler) or INTERNAL counts as undefined.
Goals, judged in code: at least `--cases` per RPC, 0 crashes, 0 undefined statuses, the
canary intact. Writes bench/results/fuzz.json; exits 1 when a goal is missed. All traffic
goes to 127.0.0.1 and is bounded by the case count and each call's deadline.

    python -m bench.fuzz [--cases 10000] [--concurrency 16] [--seed 1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from bench.common import model_dir_for, print_table, stop_on_sigterm, write_result
from bench.fuzz_cases import make_case, oversized_frame
from bench.goals import HIGHER, LOWER, Goal, judge, print_goals
from ballast.v1 import (
    backfill_answers_pb2,
    common_pb2,
    inference_pb2,
    kvcache_pb2,
    worker_pb2,
)
from services.cache.blocks import chain_hashes
from services.cache.client import KVCacheClient
from services.cache.types import KVScope
from services.cli.client import chat_request, collect, open_channel
from services.cli.mesh import BACKFILL_API_KEY, LOCAL_API_KEY, Mesh, MeshSpec
from services.common.grpc_server import MAX_MESSAGE_BYTES

FUZZ_KEY = "fuzz-key"
CANARY_TENANT = "local"
CALL_DEADLINE_S = 2.0
STREAM_READ_LIMIT = 64
UNDEFINED = {"UNKNOWN", "INTERNAL"}
CANARY_PROMPT = "Customer 9001 asks where order 5120 is and when it will be delivered to the office."
BLOCK_TOKENS = 32  # worker.kv_block_tokens of the local mesh


@dataclass(frozen=True)
class Rpc:
    service: str  # which process serves it: router, worker, cache, backfill
    path: str  # /package.Service/Method
    kind: str  # unary, server_stream, client_stream or bidi_stream
    request_type: type
    template: Any
    public: bool = False


def rpcs() -> list[Rpc]:
    scope = kvcache_pb2.KVScope(model_version="v1", tenant="fuzz")
    layout = kvcache_pb2.KVLayout(dtype="float32", shape=[2, 2, 2, 32, 32], layers=2, block_tokens=32)
    hashes = [bytes(range(32))]
    generate = chat_request("Where is my order?", max_tokens=4)
    return [
        Rpc("router", "/ballast.v1.Inference/Generate", "server_stream", inference_pb2.GenerateRequest, generate, True),
        Rpc(
            "router",
            "/ballast.v1.Inference/Subscribe",
            "server_stream",
            backfill_answers_pb2.SubscribeRequest,
            backfill_answers_pb2.SubscribeRequest(session_id="fuzz-session"),
            True,
        ),
        Rpc(
            "router",
            "/ballast.v1.Inference/GetBackfill",
            "unary",
            backfill_answers_pb2.GetAnswerRequest,
            backfill_answers_pb2.GetAnswerRequest(ticket="bf-0000"),
            True,
        ),
        Rpc(
            "worker",
            "/ballast.v1.Worker/Generate",
            "server_stream",
            worker_pb2.WorkerGenerateRequest,
            worker_pb2.WorkerGenerateRequest(
                request_id="fuzz",
                tenant="fuzz",
                prompt_ids=[5, 6, 7, 8],
                sampling=common_pb2.SamplingParams(max_tokens=4),
            ),
        ),
        Rpc(
            "worker",
            "/ballast.v1.Worker/Relay",
            "bidi_stream",
            worker_pb2.RelayActions,
            worker_pb2.RelayActions(
                actions=[
                    worker_pb2.RelayAction(
                        stream_id=1,
                        start=worker_pb2.RelayStart(
                            request=worker_pb2.WorkerGenerateRequest(
                                request_id="fuzz-relay",
                                tenant="fuzz",
                                prompt_ids=[5, 6, 7, 8],
                                sampling=common_pb2.SamplingParams(max_tokens=4),
                            ),
                            timeout_ms=2000,
                        ),
                    )
                ]
            ),
        ),
        Rpc(
            "worker",
            "/ballast.v1.Worker/GetModelInfo",
            "unary",
            worker_pb2.ModelInfoRequest,
            worker_pb2.ModelInfoRequest(),
        ),
        Rpc(
            "cache",
            "/ballast.v1.KVCache/Put",
            "client_stream",
            kvcache_pb2.KVPutRequest,
            kvcache_pb2.KVPutRequest(open=kvcache_pb2.KVPutOpen(scope=scope, ttl_s=60)),
        ),
        Rpc(
            "cache",
            "/ballast.v1.KVCache/Get",
            "server_stream",
            kvcache_pb2.KVGetRequest,
            kvcache_pb2.KVGetRequest(scope=scope, block_hashes=hashes, layout=layout),
        ),
        Rpc(
            "cache",
            "/ballast.v1.KVCache/Lookup",
            "unary",
            kvcache_pb2.KVLookupRequest,
            kvcache_pb2.KVLookupRequest(scope=scope, block_hashes=hashes),
        ),
        Rpc(
            "cache",
            "/ballast.v1.KVCache/Delete",
            "unary",
            kvcache_pb2.KVDeleteRequest,
            kvcache_pb2.KVDeleteRequest(scope=scope, block_hashes=hashes),
        ),
        Rpc("cache", "/ballast.v1.KVCache/Stats", "unary", kvcache_pb2.KVStatsRequest, kvcache_pb2.KVStatsRequest()),
        Rpc(
            "backfill",
            "/ballast.v1.Backfill/Subscribe",
            "server_stream",
            backfill_answers_pb2.SubscribeRequest,
            backfill_answers_pb2.SubscribeRequest(session_id="fuzz-session"),
        ),
        Rpc(
            "backfill",
            "/ballast.v1.Backfill/GetAnswer",
            "unary",
            backfill_answers_pb2.GetAnswerRequest,
            backfill_answers_pb2.GetAnswerRequest(ticket="bf-0000"),
        ),
    ]


def _identity(data: bytes) -> bytes:
    return data


def _metadata(rpc: Rpc, rng: random.Random) -> tuple[tuple[str, str], ...]:
    if not rpc.public:
        return ()
    roll = rng.random()
    if roll < 0.7:
        return (("x-api-key", FUZZ_KEY),)
    if roll < 0.85:
        return ()
    return (("x-api-key", rng.choice(("", "nope", "local-dev-key ", "x" * 300))),)


async def _read_some(call) -> None:
    """Reads a streamed answer to its end, or cancels it after STREAM_READ_LIMIT messages."""
    read = 0
    async for _reply in call:
        read += 1
        if read >= STREAM_READ_LIMIT:
            call.cancel()
            return


async def _call(channel: grpc.aio.Channel, rpc: Rpc, frames: list[bytes], metadata) -> str:
    """One call; returns the status code's name."""
    try:
        if rpc.kind == "unary":
            method = channel.unary_unary(rpc.path, request_serializer=_identity, response_deserializer=_identity)
            await method(frames[0], timeout=CALL_DEADLINE_S, metadata=metadata)
        elif rpc.kind == "server_stream":
            method = channel.unary_stream(rpc.path, request_serializer=_identity, response_deserializer=_identity)
            await _read_some(method(frames[0], timeout=CALL_DEADLINE_S, metadata=metadata))
        elif rpc.kind == "bidi_stream":
            method = channel.stream_stream(rpc.path, request_serializer=_identity, response_deserializer=_identity)
            await _read_some(method(iter(frames), timeout=CALL_DEADLINE_S, metadata=metadata))
        else:
            method = channel.stream_unary(rpc.path, request_serializer=_identity, response_deserializer=_identity)
            await method(iter(frames), timeout=CALL_DEADLINE_S, metadata=metadata)
    except grpc.aio.AioRpcError as exc:
        return exc.code().name
    except asyncio.CancelledError:
        return "CANCELLED"
    return "OK"


def _frames(rpc: Rpc, rng: random.Random) -> tuple[str, list[bytes]]:
    kind, frame = make_case(rpc.request_type, rpc.template, rng)
    if rpc.kind not in ("client_stream", "bidi_stream"):
        return kind, [frame]
    # A Put or Relay stream: the case first, then up to two more frames of any kind.
    more = [make_case(rpc.request_type, rpc.template, rng)[1] for _ in range(rng.choice((0, 1, 2)))]
    return kind, [frame, *more]


async def fuzz_rpc(address: str, channel: grpc.aio.Channel, rpc: Rpc, cases: int, concurrency: int, seed: int) -> dict:
    rng = random.Random(f"{seed}:{rpc.path}")
    codes: Counter = Counter()
    kinds: Counter = Counter()
    gate = asyncio.Semaphore(concurrency)

    async def one(frames: list[bytes], metadata) -> None:
        async with gate:
            codes[await _call(channel, rpc, frames, metadata)] += 1

    tasks = []
    for _ in range(cases):
        kind, frames = _frames(rpc, rng)
        kinds[kind] += 1
        tasks.append(asyncio.create_task(one(frames, _metadata(rpc, rng))))
        if len(tasks) >= 4 * concurrency:
            await asyncio.gather(*tasks)
            tasks = []
    await asyncio.gather(*tasks)
    # One frame over the servers' receive limit, on a channel that lets it leave: refused by
    # the server, not buffered.
    async with grpc.aio.insecure_channel(
        address,
        options=[
            ("grpc.max_send_message_length", 2 * MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", 2 * MAX_MESSAGE_BYTES),
        ],
    ) as big:
        codes[await _call(big, rpc, [oversized_frame(MAX_MESSAGE_BYTES)], _metadata(rpc, rng))] += 1
    kinds["oversized"] += 1
    return {
        "cases": sum(codes.values()),
        "codes": dict(codes),
        "kinds": dict(kinds),
        "undefined": sum(n for code, n in codes.items() if code in UNDEFINED),
    }


# --- the canary ----------------------------------------------------------------------------
async def _canary_turns(mesh: Mesh) -> list[list[int]]:
    async with open_channel(mesh.router_address) as channel:
        from ballast.v1 import inference_pb2_grpc

        stub = inference_pb2_grpc.InferenceStub(channel)
        answers = []
        prompt = CANARY_PROMPT
        for turn in range(2):
            request = chat_request(
                prompt, max_tokens=24, raw_prompt=True, session_id="canary-session", allow_degraded=False
            )
            result = await collect(stub, request, LOCAL_API_KEY, timeout=60)
            if result.finished is None or result.finished.degradation:
                raise RuntimeError("the canary was not served by the model")
            answers.append(list(result.token_ids))
            prompt = f"{prompt}{result.text} And can it be left with the neighbour?"
        return answers


async def _canary_blocks(mesh: Mesh) -> int:
    """Blocks of the canary's first turn the cache holds (named as the worker names them)."""
    from ballast.v1 import worker_pb2_grpc

    worker = mesh.workers()[0]
    async with open_channel(worker.address) as channel:
        info = await worker_pb2_grpc.WorkerStub(channel).GetModelInfo(worker_pb2.ModelInfoRequest(), timeout=10)
    from services.router.tokenization import ModelTokenizer

    prompt_ids = ModelTokenizer.from_model_info(info).tokenizer.encode(CANARY_PROMPT).ids
    names = chain_hashes(KVScope(info.model_version, CANARY_TENANT), BLOCK_TOKENS, prompt_ids)
    cache = next(s for s in mesh.services if s.name == "cache")
    client = KVCacheClient(cache.address)
    try:
        return await client.lookup(KVScope(info.model_version, CANARY_TENANT), names, 5.0)
    finally:
        await client.close()


def _process_state(mesh: Mesh) -> dict[str, dict]:
    state = {}
    for service in mesh.services:
        pid = service.pid
        try:
            with open(f"/proc/{pid}/status") as status:
                rss_kib = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
            fds = len(os.listdir(f"/proc/{pid}/fd"))
        except (OSError, StopIteration):
            rss_kib, fds = 0, 0
        state[service.name] = {"pid": pid, "alive": service.process.alive(), "rss_mib": rss_kib / 1024, "fds": fds}
    return state


async def _run(mesh: Mesh, cases: int, concurrency: int, seed: int) -> dict:
    canary_before = await _canary_turns(mesh)
    deadline = time.monotonic() + 30
    while (blocks_before := await _canary_blocks(mesh)) == 0:
        if time.monotonic() > deadline:
            raise RuntimeError("the canary's session KV was never saved")
        await asyncio.sleep(0.2)
    before = _process_state(mesh)
    addresses = {
        "router": mesh.router_address,
        "cache": next(s for s in mesh.services if s.name == "cache").address,
        "backfill": next(s for s in mesh.services if s.name == "backfill").address,
        "worker": mesh.workers()[1].address,
    }
    results = {}
    started = time.monotonic()
    for rpc in rpcs():
        async with open_channel(addresses[rpc.service]) as channel:
            results[rpc.path] = await fuzz_rpc(addresses[rpc.service], channel, rpc, cases, concurrency, seed)
        print(f"  {rpc.path}: {results[rpc.path]['cases']} cases, {results[rpc.path]['codes']}", flush=True)
    seconds = time.monotonic() - started
    await asyncio.sleep(2.0)  # let cancelled work finish before looking at the services
    after = _process_state(mesh)
    canary_after = await _canary_turns(mesh)
    blocks_after = await _canary_blocks(mesh)
    return {
        "rpcs": results,
        "seconds": seconds,
        "before": before,
        "after": after,
        "canary_answers_equal": canary_before == canary_after,
        "canary_blocks_before": blocks_before,
        "canary_blocks_after": blocks_after,
    }


GOALS_TEMPLATE = (
    ("fewest cases sent to one RPC", "cases_per_rpc_min", HIGHER),
    ("services that crashed or restarted", "crashes", LOWER),
    ("calls ending UNKNOWN or INTERNAL", "undefined_statuses", LOWER),
    ("canary session, KV and answers intact", "canary_intact", HIGHER),
)


def run_benchmark(cases: int, concurrency: int, seed: int, out: Path) -> int:
    model_dir = model_dir_for("tiny")
    api_keys = {LOCAL_API_KEY: CANARY_TENANT, BACKFILL_API_KEY: "ballast-backfill", FUZZ_KEY: "fuzz"}
    with tempfile.TemporaryDirectory(prefix="ballast-fuzz-") as state:
        mesh = Mesh(MeshSpec(state_dir=Path(state), model_dir=model_dir, workers=2, api_keys=api_keys)).start()
        try:
            run = asyncio.run(_run(mesh, cases, concurrency, seed))
        finally:
            mesh.stop()
    before, after = run["before"], run["after"]
    crashes = sum(1 for name, s in after.items() if not s["alive"] or s["pid"] != before[name]["pid"])
    rows = [
        [
            path.rsplit("/", 2)[-2].split(".")[-1] + "/" + path.rsplit("/", 1)[-1],
            r["cases"],
            r["undefined"],
            " ".join(f"{code}={n}" for code, n in sorted(r["codes"].items())),
        ]
        for path, r in run["rpcs"].items()
    ]
    print(
        f"\nfuzzing every RPC: {cases} cases each (+1 oversized), {concurrency} at once, seed {seed}, "
        f"{run['seconds']:.0f}s"
    )
    print_table(["rpc", "cases", "undefined", "status codes"], rows)
    print_table(
        ["service", "rss MiB before", "rss MiB after", "fds before", "fds after", "same process"],
        [
            [
                name,
                before[name]["rss_mib"],
                s["rss_mib"],
                before[name]["fds"],
                s["fds"],
                s["alive"] and s["pid"] == before[name]["pid"],
            ]
            for name, s in after.items()
        ],
    )
    canary_intact = run["canary_answers_equal"] and run["canary_blocks_after"] >= run["canary_blocks_before"] > 0
    result = {
        "cases_requested": cases,
        "concurrency": concurrency,
        "seed": seed,
        "seconds": run["seconds"],
        "rpcs": run["rpcs"],
        "services_before": before,
        "services_after": after,
        "cases_per_rpc_min": min(r["cases"] for r in run["rpcs"].values()),
        "crashes": crashes,
        "undefined_statuses": sum(r["undefined"] for r in run["rpcs"].values()),
        "canary_answers_equal": run["canary_answers_equal"],
        "canary_blocks_before": run["canary_blocks_before"],
        "canary_blocks_after": run["canary_blocks_after"],
        "canary_intact": 1.0 if canary_intact else 0.0,
        "engine": "torch",
    }
    goals = [
        Goal(
            name, metric, float(cases) if metric == "cases_per_rpc_min" else (1.0 if better == HIGHER else 0.0), better
        )
        for name, metric, better in GOALS_TEMPLATE
    ]
    result.update(judge(goals, result))
    print_goals(result)
    print(f"wrote {write_result(out, result)}")
    return 0 if result["met"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=10_000, help="cases per RPC")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("bench/results/fuzz.json"))
    args = parser.parse_args(argv)
    stop_on_sigterm()
    return run_benchmark(args.cases, args.concurrency, args.seed, args.out)


if __name__ == "__main__":
    sys.exit(main())
