"""GPU suites: the engine conformance suite on CUDA (torch) and on vLLM, and the memory
checks against the real GPU. Every module skips, with its reason, where there is no CUDA GPU
or no vLLM; the reasons are printed at the end of the run, so a skipped GPU suite is never
mistaken for a passing one.

Model: BALLAST_GPU_MODEL_DIR names a Hugging Face model folder to run on; without it the
untrained "bench" preset of the tiny model is built (head dim 64, which vLLM's attention
kernels support; the "tiny" preset's head dim of 16 is below what some of them accept).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

MODEL_ENV = "BALLAST_GPU_MODEL_DIR"


def cuda_skip_reason() -> str:
    """Why CUDA tests cannot run here; "" when they can."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine"
    return ""


def vllm_skip_reason() -> str:
    """Why vLLM tests cannot run here; "" when they can."""
    reason = cuda_skip_reason()
    if reason:
        return reason
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (the gpu extra: pip install 'ballast[gpu]' on a GPU machine)"
    return ""


@pytest.fixture(scope="session")
def gpu_model_dir(tmp_path_factory) -> Path:
    named = os.environ.get(MODEL_ENV)
    if named:
        return Path(named)
    from services.worker.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("bench-model"), preset="bench")


def pytest_terminal_summary(terminalreporter) -> None:
    reasons: dict[str, int] = {}
    for report in terminalreporter.stats.get("skipped", []):
        if "tests/gpu/" not in str(getattr(report, "nodeid", "")) and "tests/gpu/" not in str(report.location[0]):
            continue
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reasons[reason] = reasons.get(reason, 0) + 1
    if reasons:
        terminalreporter.section("GPU suites skipped")
        for reason, count in reasons.items():
            terminalreporter.write_line(f"{count} skipped: {reason}")
