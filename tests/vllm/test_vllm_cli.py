"""`ballast up --engine vllm` as a user runs it: the local mesh with a vLLM worker streams a
model answer (not a degraded one) through the router, and `ballast down` stops every process
it started, vLLM's engine process included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.vllm.conftest import require_vllm

require_vllm()

from services.common.processes import free_port  # noqa: E402
from tests.integration.test_cli import alive, ballast  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (vLLM's engine core and its workers)."""
    found, queue = [], [pid]
    while queue:
        parent = queue.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            children = (task / "children").read_text().split() if (task / "children").exists() else []
            for child in map(int, children):
                found.append(child)
                queue.append(child)
    return found


def test_up_with_vllm_workers_streams_a_model_answer_and_down_stops_everything(tmp_path, tiny_model_dir):
    state = tmp_path / "state"
    up = ballast(
        "up",
        "--engine",
        "vllm",
        "--workers",
        "1",
        "--state-dir",
        str(state),
        "--model-dir",
        str(tiny_model_dir),
        "--router-port",
        str(free_port()),
        cwd=tmp_path,
        timeout=500,
    )
    assert up.returncode == 0, up.stdout + up.stderr
    processes = json.loads((state / "mesh.json").read_text())["processes"]
    worker = next(p["pid"] for p in processes if p["name"] == "worker-1")
    pids = [p["pid"] for p in processes] + descendants(worker)
    try:
        assert len(descendants(worker)) >= 1, "no vLLM engine process under the worker"
        config = (state / "ballast.yaml").read_text()
        assert "engine: vllm" in config
        chat = ballast("chat", "Where is my order?", "--state-dir", str(state), "--max-tokens", "16", cwd=tmp_path)
        assert chat.returncode == 0, chat.stderr
        assert chat.stdout.strip() and "generated tokens" in chat.stderr
        assert "degraded" not in chat.stderr, chat.stderr
    finally:
        down = ballast("down", "--state-dir", str(state), cwd=tmp_path)
    assert down.returncode == 0, down.stderr
    assert not any(alive(pid) for pid in pids)
