"""Fault knobs of a simulated worker: what chaos and failover tests set on it.

A `SimFaults` value is set at start (`worker.sim_faults` in the config) and replaced while the
worker runs by writing JSON to the etcd key `{prefix}sim/faults/{worker_id}` (deleting the
key clears them). Each knob:

- `fail_after_tokens`: every stream fails (UNAVAILABLE, like an engine that died) once it
  has produced this many tokens in this worker.
- `hang`: streams stop producing tokens (and new ones start none) until cleared.
- `slowdown`: every prefill and decode wait is this many times longer.
- `temperature_c`: the GPU temperature the worker reports.
- `fail_health`: health checks answer NOT_SERVING and the worker stops taking requests.
- `crash`: the worker ends at once, as a killed process would: open streams break, its lease
  is left to expire.
- `ready_delay_s`: how long the engine takes to become ready at start (start-up only).
- `crash_on_marker`: a query of death. The worker ends at once, as `crash` does, when a
  request whose prompt contains this text reaches its engine (after the prefill wait: it
  dies taking the request on, as an engine running out of memory in prefill would).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any


# A marker is a short tag in a prompt, not a document.
MAX_MARKER_CHARS = 256


class SimFaultsError(ValueError):
    """A fault setting that is not JSON, names an unknown knob or has a bad value."""


@dataclass(frozen=True)
class SimFaults:
    fail_after_tokens: int | None = None
    hang: bool = False
    slowdown: float = 1.0
    temperature_c: float | None = None
    fail_health: bool = False
    crash: bool = False
    ready_delay_s: float = 0.0
    crash_on_marker: str | None = None

    def __post_init__(self) -> None:
        if self.fail_after_tokens is not None and (
            not isinstance(self.fail_after_tokens, int) or self.fail_after_tokens < 0
        ):
            raise SimFaultsError("fail_after_tokens must be a whole number >= 0")
        if not isinstance(self.slowdown, (int, float)) or not 0.01 <= self.slowdown <= 1000:
            raise SimFaultsError("slowdown must be a factor between 0.01 and 1000")
        if self.ready_delay_s < 0:
            raise SimFaultsError("ready_delay_s must be >= 0")
        if self.crash_on_marker is not None and (
            not isinstance(self.crash_on_marker, str) or not 0 < len(self.crash_on_marker) <= MAX_MARKER_CHARS
        ):
            raise SimFaultsError(f"crash_on_marker must be a text of 1 to {MAX_MARKER_CHARS} characters")
        for name in ("hang", "fail_health", "crash"):
            if not isinstance(getattr(self, name), bool):
                raise SimFaultsError(f"{name} must be true or false")

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "SimFaults":
        if not data:
            return cls()
        if not isinstance(data, dict):
            raise SimFaultsError("fault settings must be a JSON object")
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise SimFaultsError(f"unknown fault knobs {sorted(unknown)}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise SimFaultsError(str(exc)) from None

    @classmethod
    def from_json(cls, raw: bytes | str | None) -> "SimFaults":
        if raw is None or raw in (b"", ""):
            return cls()
        try:
            return cls.from_dict(json.loads(raw))
        except json.JSONDecodeError as exc:
            raise SimFaultsError(f"fault settings are not JSON: {exc}") from None

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in asdict(self).items() if v != getattr(SimFaults(), k)})


def faults_key(prefix: str, worker_id: str) -> str:
    """The etcd key whose JSON value sets a sim worker's faults while it runs."""
    return f"{prefix}sim/faults/{worker_id}"
