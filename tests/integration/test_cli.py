"""The README's main job, as a user runs it: `ballast up`, `chat`, `status`, `down`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from services.common.processes import free_port

pytestmark = pytest.mark.integration


def ballast(*args, cwd, timeout=180):
    return subprocess.run(
        [sys.executable, "-m", "services.cli.main", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def test_up_chat_status_down(tmp_path, tiny_model_dir):
    state = tmp_path / "state"
    port = str(free_port())
    up = ballast(
        "up",
        "--state-dir",
        str(state),
        "--model",
        "tiny",
        "--model-dir",
        str(tiny_model_dir),
        "--router-port",
        port,
        cwd=tmp_path,
    )
    assert up.returncode == 0, up.stdout + up.stderr
    pids = [p["pid"] for p in json.loads((state / "mesh.json").read_text())["processes"]]
    try:
        assert len(pids) == 8  # etcd, redis, kafka, cache, backfill, router, 2 workers
        again = ballast(
            "up",
            "--state-dir",
            str(state),
            "--model",
            "tiny",
            "--model-dir",
            str(tiny_model_dir),
            "--router-port",
            port,
            cwd=tmp_path,
        )
        assert again.returncode == 0 and "already running" in again.stdout

        chat = ballast("chat", "Where is my order?", "--state-dir", str(state), "--max-tokens", "16", cwd=tmp_path)
        assert chat.returncode == 0, chat.stderr
        assert chat.stdout.strip()
        assert "generated tokens" in chat.stderr

        status = ballast("status", "--state-dir", str(state), cwd=tmp_path)
        assert status.returncode == 0, status.stderr
        assert status.stdout.count("serving") == 2
        assert "worker-1" in status.stdout and "worker-2" in status.stdout
        assert "breaker" in status.stdout and status.stdout.count("closed") == 2

        denied = ballast("chat", "hi", "--state-dir", str(state), "--api-key", "wrong", cwd=tmp_path)
        assert denied.returncode == 1 and "UNAUTHENTICATED" in denied.stderr
    finally:
        down = ballast("down", "--state-dir", str(state), cwd=tmp_path)
    assert down.returncode == 0, down.stderr
    assert "mismatch" not in down.stdout
    assert not any(alive(pid) for pid in pids)
    assert not (state / "mesh.json").exists()
