"""The engine conformance suite (tests/engine_conformance.py) on the torch engine and the
tiny model, on CPU."""

from __future__ import annotations

import pytest

from tests.engine_conformance import conf_engine, endless  # noqa: F401  (fixtures)
from tests.engine_conformance import EngineConformance, factory_fixture, torch_factory
from tests.model_fixtures import tiny_model_dir  # noqa: F401

engine_factory = factory_fixture(torch_factory(device="cpu"))


@pytest.fixture(scope="module")
def conformance_model_dir(tiny_model_dir):  # noqa: F811
    return tiny_model_dir


class TestTorchEngineConformance(EngineConformance):
    pass
