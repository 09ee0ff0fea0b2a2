"""Hostile requests against a local mesh: every one answered with a defined status, the router's
loop never held, no worker hurt.

Each case is a function that sends one hostile request (a JSON-Schema bomb in each bounded
keyword, catastrophic patterns, huge enums, deep nesting, 10^5 messages on gRPC and HTTP,
oversized messages, and the largest requests the limits let through) and says what came back.
Around each case the harness measures: the answer's status and time; the router's event-loop
stall, as the slowest answer to a health check (and, for HTTP cases, to GET /v1/models) asked
from a process of its own while the case ran; each worker's peak memory growth (VmHWM); the
workers lost (a PID that changed or died); and whether a normal request is served right after.

Goals, judged in code: 100 % of cases answered with a defined status or a normal answer; router
loop stall p100 <= 100 ms; worker memory growth <= 256 MB per case; 0 workers lost to a bounded
case. A case that is meant to cost workers (a poison request) is reported but not held to the
last goal.

    python -m bench.hostile                      # every case, sim workers
    python -m bench.hostile --cases min_items,http_120k_messages --engine torch

Cases meant to cost workers (`UNBOUNDED`: the poison request of bench/hostile_poison.py) run
last, each on a mesh of its own whose workers run under their keepers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

import grpc
import httpx

from bench.common import model_dir_for, percentile, print_table, stop_on_sigterm, write_result
from bench.goals import HIGHER, LOWER, Goal, judge, print_goals
from bench.loop_probe import LoopProbe

STALL_TARGET_MS = 100.0
MEMORY_TARGET_MB = 256.0
ANSWER_TIMEOUT_S = 30.0

# --- hostile requests (the integration suite sends the same ones) ---------------------------

ARRAY = {"type": "array", "items": {"type": "integer"}}


def laughs(links: int, width: int) -> dict:
    """$defs that each reference the one before `width` times: width**links subschemas."""
    defs: dict = {"a0": {"type": "integer"}}
    for i in range(1, links):
        defs[f"a{i}"] = {"anyOf": [{"$ref": f"#/$defs/a{i - 1}"}] * width}
    return {"$defs": defs, "$ref": f"#/$defs/a{links - 1}"}


def nested(levels: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


# name -> (schema, or its JSON text; a word the refusal names)
BOMBS: dict[str, tuple[object, str]] = {
    "min_items": ({**ARRAY, "minItems": 1_000_000_000}, "max_items"),
    "max_items": ({**ARRAY, "maxItems": 1_000_000}, "max_items"),
    "min_contains": ({**ARRAY, "contains": {"type": "integer"}, "minContains": 10**9}, "max_items"),
    "prefix_items": ({"type": "array", "prefixItems": [{}] * 2000}, "max_items"),
    "item_sum": (
        {"type": "object", "properties": {f"a{i}": {**ARRAY, "maxItems": 1000} for i in range(20)}},
        "max_total_items",
    ),
    "min_length": ({"type": "string", "minLength": 1_000_000_000}, "max_length"),
    "max_length": ({"type": "string", "maxLength": 10**7}, "max_length"),
    "min_properties": ({"type": "object", "minProperties": 10**9}, "max_properties"),
    "enum": ({"enum": list(range(5000))}, "max_enum"),
    "any_of": (
        {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}}} for i in range(1000)]},
        "max_branches",
    ),
    "all_of": ({"allOf": [{"type": "object"}] * 1000}, "max_branches"),
    "ref_laughs": (laughs(4, 64), "max_subschemas"),
    "ref_loop": ({"$defs": {"a": {"allOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"}, "infinite recursion"),
    "deep_nesting": (nested(60), "max_depth"),
    "nested_quantifiers": ({"type": "string", "pattern": "^(a+)+$"}, "nests quantifiers"),
    "overlapping_alternatives": ({"type": "string", "pattern": "^(a|aa)*$"}, "alternatives"),
    "pattern_properties": (
        {"type": "object", "patternProperties": {"^(x*)*$": {"type": "integer"}}},
        "nests quantifiers",
    ),
    "huge_repeat": ({"type": "string", "pattern": "^a{1,1000000}$"}, "max_pattern_repeat"),
    "backreference": ({"type": "string", "pattern": "^(a)\\1$"}, "backreference"),
    "lookaround": ({"type": "string", "pattern": "^(?!x)a$"}, "lookaround"),
    "format": ({"type": "string", "format": "credit-card"}, "formats"),
    "huge_integer": ('{"type": "array", "maxItems": ' + "9" * 5000 + "}", "not usable JSON"),
    "deep_json": ('{"type": "object", "default": ' + "[" * 10000 + "]" * 10000 + "}", "max_json_depth"),
}
LEGAL_CONTENT = "the blue kettle costs 42 dollars, ships in two days and comes with a warranty of 1 yr"


def schema_request(schema: object):
    from services.cli.client import chat_request

    request = chat_request("Describe the order as JSON.", max_tokens=16, allow_degraded=False)
    request.response_format = schema if isinstance(schema, str) else json.dumps(schema)
    return request


def chat(count: int, content: str):
    """A conversation of `count` alternating messages, the last from the user."""
    from ballast.v1 import inference_pb2
    from services.cli.client import chat_request

    request = chat_request("", max_tokens=8, allow_degraded=False)
    del request.conversation.messages[:]
    request.conversation.messages.extend(
        inference_pb2.ChatMessage(role="user" if i % 2 == 0 else "assistant", content=content) for i in range(count)
    )
    request.conversation.messages[-1].role = "user"
    return request


def http_chat_body(count: int) -> bytes:
    """120,000 empty messages is 3.96 MB of JSON, under the HTTP body limit."""
    return json.dumps({"model": "tiny", "messages": [{"role": "user", "content": ""}] * count}).encode()


# --- cases ----------------------------------------------------------------------------------


@dataclass
class Answer:
    status: str  # a gRPC code name in lower case, an HTTP status, or "served"
    detail: str = ""


@dataclass
class Target:
    """What a case talks to."""

    router: object  # ballast.v1 InferenceStub
    http: httpx.AsyncClient
    mesh: object


@dataclass(frozen=True)
class Case:
    name: str
    run: Callable[[Target], Awaitable[Answer]]
    http: bool = False  # measure /v1/models too
    expect: str = "invalid_argument"  # the defined answer it should get


async def grpc_answer(target: Target, request) -> Answer:
    from services.cli.client import collect
    from services.cli.mesh import LOCAL_API_KEY

    try:
        result = await collect(target.router, request, LOCAL_API_KEY, timeout=ANSWER_TIMEOUT_S)
    except grpc.aio.AioRpcError as error:
        return Answer(error.code().name.lower(), error.details() or "")
    if result.finished is None:
        return Answer("unfinished")
    if result.finished.degradation:
        return Answer("degraded", str(result.finished.degradation))
    return Answer("served", result.text[:80])


async def http_answer(target: Target, body: bytes) -> Answer:
    response = await target.http.post("/chat/completions", content=body, headers={"content-type": "application/json"})
    try:
        detail = response.json().get("error", {}).get("message", "")
    except ValueError:
        detail = response.text[:200]
    return Answer("served" if response.status_code == 200 else str(response.status_code), detail)


def _bomb_case(name: str) -> Case:
    schema, _word = BOMBS[name]
    return Case(name, lambda target: grpc_answer(target, schema_request(schema)))


def _legal_schema() -> dict:
    props = {f"field_{i}": {"type": "string", "maxLength": 20} for i in range(600)}
    return {"type": "object", "properties": props, "required": ["field_0"]}


CASES: list[Case] = [
    *(_bomb_case(name) for name in BOMBS),
    Case("grpc_100k_messages", lambda t: grpc_answer(t, chat(100_000, ""))),
    Case("grpc_20k_messages", lambda t: grpc_answer(t, chat(20_000, ""))),
    Case("huge_message", lambda t: grpc_answer(t, chat(1, "x" * 150_000))),
    Case("prompt_over_limit", lambda t: grpc_answer(t, chat(4, "word " * 19_000))),
    Case("largest_legal_chat", lambda t: grpc_answer(t, chat(2048, LEGAL_CONTENT)), expect="served"),
    Case("large_legal_schema", lambda t: grpc_answer(t, schema_request(_legal_schema())), expect="served"),
    Case("http_120k_messages", lambda t: http_answer(t, http_chat_body(120_000)), http=True, expect="400"),
    Case(
        "http_deep_content",
        lambda t: http_answer(
            t,
            json.dumps(
                {"model": "tiny", "messages": [{"role": "user", "content": json.loads("[" * 200 + "]" * 200)}]}
            ).encode(),
        ),
        http=True,
        expect="400",
    ),
]
# Cases that cost workers by design, each run on a mesh of its own whose workers run under
# their keepers (`worker.respawn`): name -> the case function, given the running mesh, and
# returning the row's numbers. Not held to "no worker lost".
UNBOUNDED: dict[str, Callable[[object], Awaitable[dict]]] = {}


async def _poison(mesh) -> dict:
    from bench.hostile_poison import poison_case

    result = await poison_case(mesh)
    return {
        "status": str(result.get("answer_code", "")).lower(),
        "expected": "failed_precondition",
        "detail": str(result.get("answer_reason", "")),
        "workers_lost": result["workers_lost"],
        "served_after": result.get("served_again_s") is not None,
        "poison": result,
    }


UNBOUNDED["poison"] = _poison

# Statuses that are an answer the client can act on; anything else (internal, unknown,
# unavailable from a dead worker, a stream that never finished) is not.
DEFINED = {"invalid_argument", "400", "413", "served", "resource_exhausted", "failed_precondition"}


# --- the harness ----------------------------------------------------------------------------


def _peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


async def _served_after(target: Target) -> bool:
    from services.cli.client import chat_request

    answer = await grpc_answer(target, chat_request("Is the blue kettle in stock?", max_tokens=8, allow_degraded=False))
    return answer.status == "served"


async def run_case(case: Case, target: Target, probe: LoopProbe, http_probe: LoopProbe) -> dict:
    workers = target.mesh.workers()
    pids = {w.name: w.pid for w in workers}
    peaks = {w.name: _peak_rss(w.pid) for w in workers}
    start = time.monotonic()
    try:
        answer = await asyncio.wait_for(case.run(target), ANSWER_TIMEOUT_S)
    except (asyncio.TimeoutError, httpx.HTTPError) as error:
        answer = Answer("no_answer", type(error).__name__)
    end = time.monotonic()
    stall = await asyncio.to_thread(probe.worst, start, end)
    if case.http:
        stall = max(stall, await asyncio.to_thread(http_probe.worst, start, end))
    after = {w.name: w for w in target.mesh.workers()}
    lost = sum(
        1
        for name, pid in pids.items()
        if name not in after or after[name].pid != pid or not after[name].process.alive()
    )
    growth = max(
        (
            _peak_rss(after[name].pid) - peaks[name]
            for name in pids
            if name in after and after[name].pid == pids[name] and after[name].process.alive()
        ),
        default=0,
    )
    return {
        "case": case.name,
        "status": answer.status,
        "expected": case.expect,
        "detail": answer.detail[:160],
        "defined": answer.status in DEFINED,
        "as_expected": answer.status == case.expect,
        "seconds": end - start,
        "stall_ms": stall * 1000,
        "worker_growth_mb": growth / (1 << 20),
        "workers_lost": lost,
        "bounded": True,
        "served_after": await _served_after(target),
    }


async def _run(mesh, cases: list[Case]) -> list[dict]:
    from services.cli.client import open_channel
    from services.cli.mesh import LOCAL_API_KEY
    from ballast.v1 import inference_pb2_grpc

    rows = []
    with (
        LoopProbe.grpc(mesh.router_address) as probe,
        LoopProbe.http(f"{mesh.http_base_url}/models", LOCAL_API_KEY) as http_probe,
    ):
        async with (
            open_channel(mesh.router_address) as channel,
            httpx.AsyncClient(
                base_url=mesh.http_base_url, headers={"x-api-key": LOCAL_API_KEY}, timeout=ANSWER_TIMEOUT_S
            ) as http,
        ):
            target = Target(inference_pb2_grpc.InferenceStub(channel), http, mesh)
            for case in cases:
                row = await run_case(case, target, probe, http_probe)
                print(
                    f"  {row['case']}: {row['status']} in {row['seconds']:.2f}s, stall {row['stall_ms']:.0f} ms, "
                    f"worker +{row['worker_growth_mb']:.0f} MB, lost {row['workers_lost']}",
                    flush=True,
                )
                rows.append(row)
    return rows


GOALS = [
    Goal("cases answered with a defined status or a normal answer", "defined_fraction", 1.0, HIGHER),
    Goal("router loop stall p100", "stall_ms_p100", STALL_TARGET_MS, LOWER, " ms"),
    Goal("worker memory growth per case (max)", "worker_growth_mb_max", MEMORY_TARGET_MB, LOWER, " MB"),
    Goal("workers lost to bounded cases", "workers_lost_bounded", 0.0, LOWER),
]


def summarize(rows: list[dict]) -> dict:
    """The judged numbers of a run's rows."""
    return {
        "defined_fraction": sum(r["defined"] for r in rows) / len(rows) if rows else 0.0,
        "stall_ms_p100": max((r["stall_ms"] for r in rows), default=float("nan")),
        "stall_ms_p50": percentile([r["stall_ms"] for r in rows], 50),
        "worker_growth_mb_max": max((r["worker_growth_mb"] for r in rows), default=float("nan")),
        "workers_lost_bounded": float(sum(r["workers_lost"] for r in rows if r["bounded"])),
        "served_after_fraction": sum(r["served_after"] for r in rows) / len(rows) if rows else 0.0,
    }


async def _run_unbounded(mesh, name: str) -> dict:
    with LoopProbe.grpc(mesh.router_address) as probe:
        start = time.monotonic()
        row = await UNBOUNDED[name](mesh)
        end = time.monotonic()
        stall = await asyncio.to_thread(probe.worst, start, end)
    row.update(
        {
            "case": name,
            "defined": row["status"] in DEFINED,
            "as_expected": row["status"] == row["expected"],
            "seconds": end - start,
            "stall_ms": stall * 1000,
            "worker_growth_mb": 0.0,
            "bounded": False,
        }
    )
    print(
        f"  {name}: {row['status']} in {row['seconds']:.2f}s, stall {row['stall_ms']:.0f} ms, "
        f"lost {row['workers_lost']} (unbounded)",
        flush=True,
    )
    return row


def run_benchmark(names: list[str] | None, engine: str, out: Path) -> int:
    from services.cli.mesh import Mesh, MeshSpec

    cases = [c for c in CASES if names is None or c.name in names]
    unbounded = [n for n in UNBOUNDED if names is None or n in names]
    unknown = set(names or ()) - {c.name for c in cases} - set(unbounded)
    if unknown:
        known = [c.name for c in CASES] + list(UNBOUNDED)
        raise SystemExit(f"unknown cases: {', '.join(sorted(unknown))}; known: {', '.join(known)}")
    model_dir = model_dir_for("tiny")
    rows: list[dict] = []
    if cases:
        with tempfile.TemporaryDirectory(prefix="ballast-hostile-") as state:
            mesh = Mesh(
                MeshSpec(state_dir=Path(state), model_dir=model_dir, workers=2, engine=engine, worker_capacity=4)
            ).start()
            try:
                rows += asyncio.run(_run(mesh, cases))
            finally:
                mesh.stop()
    for name in unbounded:
        with tempfile.TemporaryDirectory(prefix=f"ballast-hostile-{name}-") as state:
            # Sim workers: the poison's crash knob is the sim engine's.
            mesh = Mesh(
                MeshSpec(
                    state_dir=Path(state),
                    model_dir=model_dir,
                    workers=3,
                    engine="sim",
                    lease_ttl_s=3,
                    worker_capacity=4,
                    overrides={"worker": {"respawn": True}},
                )
            ).start()
            try:
                rows.append(asyncio.run(_run_unbounded(mesh, name)))
            finally:
                mesh.stop()
    print()
    print_table(
        ["case", "status", "expected", "seconds", "stall ms", "worker +MB", "lost", "served after"],
        [
            [
                r["case"],
                r["status"],
                r["expected"],
                r["seconds"],
                r["stall_ms"],
                r["worker_growth_mb"],
                r["workers_lost"],
                r["served_after"],
            ]
            for r in rows
        ],
    )
    result = {"engine": engine, "cases": rows, **summarize(rows), "complete": names is None}
    result.update(judge(GOALS, result))
    print_goals(result)
    print(f"wrote {write_result(out, result)}")
    return 0 if result["met"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--engine", default="sim", choices=["sim", "torch"])
    parser.add_argument("--out", type=Path, default=Path("bench/results/hostile.json"))
    args = parser.parse_args(argv)
    stop_on_sigterm()
    names = [n for n in args.cases.split(",") if n] or None
    return run_benchmark(names, args.engine, args.out)


if __name__ == "__main__":
    sys.exit(main())
