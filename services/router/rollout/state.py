"""The rollout document of one logical model, as kept in etcd at `<prefix>rollout/<model>`.

    {"model": "tiny", "stable": "3f2a...", "candidate": "9c1e...", "weight": 10,
     "mode": "canary", "mirror_percent": 5, "state": "running", "reason": "started",
     "gate": {"window_s": 60, "min_requests": 50, "max_error_rate": 0.05,
              "max_p99_ms": 2000, "breach_min_requests": 5},
     "updated_at": 1718000000.0}

Versions are the workers' model-version hashes. `weight` is the candidate's share of
sessions in percent; blue-green allows only 0 or 100. The gate thresholds travel with the
document, so every router judges the candidate alike. A bad document raises RolloutError
(a ValueError) naming the field; the router then keeps the rollout it had.
"""

from __future__ import annotations

import enum
import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

# Relative to the etcd prefix (`/ballast/` by default); the model name follows.
ROLLOUT_PREFIX = "rollout/"
MAX_REASON_CHARS = 500


class RolloutError(ValueError):
    """A rollout document is invalid; the message names the field."""


class Mode(str, enum.Enum):
    CANARY = "canary"
    BLUE_GREEN = "blue-green"


class Phase(str, enum.Enum):
    RUNNING = "running"
    PROMOTED = "promoted"
    ROLLED_BACK = "rolled_back"


@dataclass(frozen=True)
class GatePolicy:
    """When the SLO gate promotes or rolls back a candidate."""

    # Length of the clean window (s) the candidate must run before promotion; also the
    # span over which its error rate and p99 are measured.
    window_s: float = 60.0
    # Candidate requests the window must hold before a promotion.
    min_requests: int = 50
    # Share of candidate requests that may fail (worker faults, not client errors).
    max_error_rate: float = 0.05
    # Largest p99 time to first token (ms) of the candidate.
    max_p99_ms: float = 2000.0
    # Candidate requests needed before a breach counts (one early error is not a 100 % rate).
    breach_min_requests: int = 5


@dataclass(frozen=True)
class Rollout:
    model: str
    stable: str
    candidate: str
    weight: float = 0.0
    mode: Mode = Mode.CANARY
    mirror_percent: float = 0.0
    state: Phase = Phase.RUNNING
    reason: str = ""
    gate: GatePolicy = field(default_factory=GatePolicy)
    updated_at: float = 0.0

    @property
    def running(self) -> bool:
        return self.state is Phase.RUNNING

    def decided(self, state: Phase, reason: str) -> "Rollout":
        """The document after a promotion or rollback: all traffic on one version, no mirror."""
        weight = 100.0 if state is Phase.PROMOTED else 0.0
        return replace(
            self,
            state=state,
            weight=weight,
            mirror_percent=0.0,
            reason=reason[:MAX_REASON_CHARS],
            updated_at=time.time(),
        )

    def to_json(self) -> bytes:
        data = asdict(self)
        data["mode"] = self.mode.value
        data["state"] = self.state.value
        return json.dumps(data, sort_keys=True).encode()


def rollout_key(prefix: str, model: str) -> str:
    return f"{prefix}{ROLLOUT_PREFIX}{model}"


# ----- parsing ---------------------------------------------------------------------------


def _fail(field_name: str, problem: str) -> RolloutError:
    return RolloutError(f"rollout field '{field_name}': {problem}")


def _only(raw: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(str(key) for key in raw if key not in allowed)
    if unknown:
        raise RolloutError(
            f"{where}: unknown field(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(sorted(allowed))}"
        )


def _text(raw: Any, field_name: str, *, required: bool = True) -> str:
    if not isinstance(raw, str) or (required and not raw.strip()):
        raise _fail(field_name, f"must be a non-empty string (got {raw!r})")
    return raw


def _number(raw: Any, field_name: str, low: float, high: float, *, low_open: bool = False) -> float:
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not math.isfinite(raw):
        raise _fail(field_name, f"must be a number (got {raw!r})")
    if raw < low or raw > high or (low_open and raw == low):
        bounds = f"> {low:g} and <= {high:g}" if low_open else f"from {low:g} to {high:g}"
        raise _fail(field_name, f"must be {bounds} (got {raw!r})")
    return float(raw)


def _count(raw: Any, field_name: str, high: int) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int) or not 1 <= raw <= high:
        raise _fail(field_name, f"must be an integer from 1 to {high} (got {raw!r})")
    return raw


def _enum(kind: type[enum.Enum], raw: Any, field_name: str):
    try:
        return kind(raw)
    except ValueError:
        choices = ", ".join(member.value for member in kind)
        raise _fail(field_name, f"must be one of {choices} (got {raw!r})") from None


def parse_gate(raw: Any) -> GatePolicy:
    if raw is None:
        return GatePolicy()
    if not isinstance(raw, dict):
        raise _fail("gate", f"must be a mapping (got {type(raw).__name__})")
    _only(raw, set(GatePolicy.__dataclass_fields__), "rollout field 'gate'")
    default = GatePolicy()
    return GatePolicy(
        window_s=_number(raw.get("window_s", default.window_s), "gate.window_s", 0, 86_400, low_open=True),
        min_requests=_count(raw.get("min_requests", default.min_requests), "gate.min_requests", 10_000_000),
        max_error_rate=_number(raw.get("max_error_rate", default.max_error_rate), "gate.max_error_rate", 0, 1),
        max_p99_ms=_number(raw.get("max_p99_ms", default.max_p99_ms), "gate.max_p99_ms", 0, 3_600_000, low_open=True),
        breach_min_requests=_count(
            raw.get("breach_min_requests", default.breach_min_requests), "gate.breach_min_requests", 10_000_000
        ),
    )


def parse_rollout(data: Any, model: str | None = None) -> Rollout:
    """Validates a decoded document; `model` (from the etcd key) must match its model field."""
    if not isinstance(data, dict):
        raise RolloutError("rollout: the document must be a mapping")
    _only(data, set(Rollout.__dataclass_fields__), "rollout")
    name = _text(data.get("model"), "model")
    if model is not None and name != model:
        raise _fail("model", f"is {name!r} but the document is stored under model {model!r}")
    stable = _text(data.get("stable"), "stable")
    candidate = _text(data.get("candidate"), "candidate")
    if stable == candidate:
        raise _fail("candidate", f"must differ from the stable version ({stable!r})")
    mode = _enum(Mode, data.get("mode", Mode.CANARY.value), "mode")
    weight = _number(data.get("weight", 0), "weight", 0, 100)
    if mode is Mode.BLUE_GREEN and weight not in (0.0, 100.0):
        raise _fail("weight", f"blue-green switches all traffic at once: 0 or 100 (got {weight:g})")
    reason = _text(data.get("reason", ""), "reason", required=False)
    if len(reason) > MAX_REASON_CHARS:
        raise _fail("reason", f"at most {MAX_REASON_CHARS} characters (got {len(reason)})")
    updated_at = data.get("updated_at", 0.0)
    if isinstance(updated_at, bool) or not isinstance(updated_at, (int, float)):
        raise _fail("updated_at", f"must be a UNIX time (got {updated_at!r})")
    return Rollout(
        model=name,
        stable=stable,
        candidate=candidate,
        weight=weight,
        mode=mode,
        mirror_percent=_number(data.get("mirror_percent", 0), "mirror_percent", 0, 100),
        state=_enum(Phase, data.get("state", Phase.RUNNING.value), "state"),
        reason=reason,
        gate=parse_gate(data.get("gate")),
        updated_at=float(updated_at),
    )


def load_rollout(raw: bytes | str, model: str | None = None) -> Rollout:
    """Parses a JSON document; raises RolloutError naming what is wrong."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RolloutError(f"rollout document is not valid JSON: {exc}") from None
    return parse_rollout(data, model)
