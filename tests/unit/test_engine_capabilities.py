"""Optional engine capabilities are declared, not probed: each engine class names among its
bases exactly the capability protocols of `services.worker.engine` that it implements, and
the worker wires session KV by those declarations."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.common.config import TelemetryConfig
from services.common.telemetry import Telemetry
from services.worker.engine import CAPABILITIES, ChunkedPrefill, KvAttachable, Stepping, Wakeable
from services.worker.kv import start_session_kv
from services.worker.sim.engine import SimEngine
from services.worker.torch.engine import TorchEngine
from services.worker.vllm.engine import VllmEngine

EXPECTED = {
    TorchEngine: {KvAttachable, ChunkedPrefill, Stepping},
    VllmEngine: {KvAttachable, Wakeable, Stepping},
    SimEngine: {Stepping},
}


def declared(cls: type) -> set[type]:
    return {capability for capability in CAPABILITIES if capability in cls.__mro__}


def members(capability: type) -> set[str]:
    return {name for name in vars(capability) if not name.startswith("_")}


def implements(cls: type, name: str) -> bool:
    """Whether `cls` defines `name` itself (or a base does that is not a capability protocol)."""
    return any(name in vars(base) for base in cls.__mro__ if base not in CAPABILITIES and base is not object)


def test_every_capability_has_members():
    assert all(members(capability) for capability in CAPABILITIES)


@pytest.mark.parametrize("cls", sorted(EXPECTED, key=lambda c: c.__name__), ids=lambda c: c.__name__)
def test_each_engine_class_declares_exactly_what_it_implements(cls):
    assert declared(cls) == EXPECTED[cls]
    for capability in CAPABILITIES:
        defined = {name for name in members(capability) if implements(cls, name)}
        if capability in EXPECTED[cls]:
            assert defined == members(capability), (cls.__name__, capability.__name__)
        else:
            assert not defined, f"{cls.__name__} implements {sorted(defined)} without declaring {capability.__name__}"


class _Attachable(KvAttachable, ChunkedPrefill):
    def __init__(self) -> None:
        self.attached: list[tuple[object, object]] = []

    @property
    def prefill_chunk(self) -> int:
        return 64

    def attach_kv(self, metrics, session_kv=None) -> bool:
        self.attached.append((metrics, session_kv))
        return True


class _Plain:
    """An engine without any optional capability."""


async def test_session_kv_is_attached_to_an_engine_that_declares_it():
    telemetry = Telemetry("worker", TelemetryConfig(enabled=False))
    engine = _Attachable()
    assert await start_session_kv(SimpleNamespace(cache_address=""), engine, telemetry) is None
    [(metrics, session)] = engine.attached
    assert metrics is not None and session is None  # metrics always, persistence only with a cache
    assert await start_session_kv(SimpleNamespace(cache_address="127.0.0.1:1"), _Plain(), telemetry) is None
    assert isinstance(engine, KvAttachable) and not isinstance(_Plain(), (KvAttachable, ChunkedPrefill, Wakeable))
