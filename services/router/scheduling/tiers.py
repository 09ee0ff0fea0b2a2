"""Tier policy: latency budgets, queue bounds, preemption limit and A/B sharing, validated.

One `TierPolicy` configures every `PoolScheduler` of a router. Invalid values fail at
construction with a ValueError naming the field, so a bad config never reaches traffic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, Literal, Mapping

from services.common.tier import TIER_ORDER, Tier

# The scheduled tiers, the most urgent first.
TIERS: tuple[Tier, ...] = TIER_ORDER
Mode = Literal["tiered", "fifo"]


def _positive(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0 (got {value!r})")


def _count(name: str, value: int, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum} (got {value!r})")


def _fraction(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < 1:
        raise ValueError(f"{name} must be strictly between 0 and 1 (got {value!r})")


@dataclass(frozen=True)
class TierSpec:
    """Limits of one tier in one pool."""

    # Time from arrival to the first token that the tier promises.
    budget_s: float
    # Requests of this tier allowed to wait in one pool's queue.
    max_queue: int
    # Longest a request may wait for a slot before it leaves the queue refused; for B this
    # is the delay-queue bound. Defaults to the budget.
    max_wait_s: float | None = None

    @property
    def wait_limit_s(self) -> float:
        return self.budget_s if self.max_wait_s is None else self.max_wait_s

    def validate(self, prefix: str) -> None:
        _positive(f"{prefix}.budget_s", self.budget_s)
        _count(f"{prefix}.max_queue", self.max_queue, 1)
        if self.max_wait_s is not None:
            _positive(f"{prefix}.max_wait_s", self.max_wait_s)


@dataclass(frozen=True)
class AdaptiveShares:
    """How A and B split the slots S leaves: A's share rises linearly with pool load.

    Load is demand over capacity: (requests running + queued) / total worker slots. Below
    `load_low` A gets `a_share_low`; above `load_high` it gets `a_share_high`. B always keeps
    the rest, so its delay bound can hold even under an A flood.
    """

    a_share_low: float = 0.6
    a_share_high: float = 0.9
    load_low: float = 0.75
    load_high: float = 2.0

    def validate(self, prefix: str) -> None:
        _fraction(f"{prefix}.a_share_low", self.a_share_low)
        _fraction(f"{prefix}.a_share_high", self.a_share_high)
        if self.a_share_high < self.a_share_low:
            raise ValueError(f"{prefix}.a_share_high must be >= a_share_low")
        if not isinstance(self.load_low, (int, float)) or self.load_low < 0:
            raise ValueError(f"{prefix}.load_low must be >= 0 (got {self.load_low!r})")
        _positive(f"{prefix}.load_high", self.load_high)
        if self.load_high <= self.load_low:
            raise ValueError(f"{prefix}.load_high must be > load_low")

    def a_share(self, load: float) -> float:
        if load <= self.load_low:
            return self.a_share_low
        if load >= self.load_high:
            return self.a_share_high
        position = (load - self.load_low) / (self.load_high - self.load_low)
        return self.a_share_low + position * (self.a_share_high - self.a_share_low)


def _default_tiers() -> dict[Tier, TierSpec]:
    return {
        Tier.S: TierSpec(budget_s=0.8, max_queue=64),
        Tier.A: TierSpec(budget_s=2.0, max_queue=256),
        Tier.B: TierSpec(budget_s=15.0, max_queue=512, max_wait_s=15.0),
    }


@dataclass(frozen=True)
class TierPolicy:
    """Everything a pool scheduler needs to know; shared by all pools of a router."""

    # "fifo" turns scheduling off (one FIFO queue, no preemption, only the queue bound):
    # the baseline the benchmark compares against.
    mode: Mode = "tiered"
    tiers: Mapping[Tier, TierSpec] = field(default_factory=_default_tiers)
    shares: AdaptiveShares = field(default_factory=AdaptiveShares)
    # Times one request may be preempted; after that it runs to the end.
    max_preemptions: int = 2
    # Queue bound of the fifo mode (all tiers together).
    fifo_max_queue: int = 512
    # Prior for the slot hold time and dispatch-to-first-token time until measured.
    initial_hold_s: float = 2.0
    initial_first_token_s: float = 0.2
    # Weight of the newest sample in the moving averages of measured service times.
    ewma_alpha: float = 0.2
    # Bounds of the retry hint sent with a refusal.
    min_retry_after_s: float = 0.1
    max_retry_after_s: float = 30.0
    # Slow start: a worker that joined (or restarted) while the router ran gets a share of
    # new work that ramps from a tenth to all of its free slots over this many seconds, so
    # a fresh process is not handed every new and resumed stream at once for being the
    # least loaded. 0 turns it off.
    slow_start_s: float = 5.0

    def __post_init__(self) -> None:
        if self.mode not in ("tiered", "fifo"):
            raise ValueError(f"mode must be 'tiered' or 'fifo' (got {self.mode!r})")
        missing = [tier.value for tier in TIERS if tier not in self.tiers]
        unknown = [tier for tier in self.tiers if tier not in TIERS]
        if missing or unknown:
            raise ValueError(f"tiers must name exactly S, A and B (missing {missing}, unknown {unknown})")
        # A read-only copy, keyed by Tier: a policy shared by every pool must not change under them.
        object.__setattr__(self, "tiers", MappingProxyType({Tier(tier): spec for tier, spec in self.tiers.items()}))
        for tier in TIERS:
            self.tiers[tier].validate(f"tiers.{tier}")
        self.shares.validate("shares")
        _count("max_preemptions", self.max_preemptions, 0)
        _count("fifo_max_queue", self.fifo_max_queue, 1)
        _positive("initial_hold_s", self.initial_hold_s)
        _positive("initial_first_token_s", self.initial_first_token_s)
        _fraction("ewma_alpha", self.ewma_alpha)
        _positive("min_retry_after_s", self.min_retry_after_s)
        _positive("max_retry_after_s", self.max_retry_after_s)
        if self.slow_start_s < 0:
            raise ValueError(f"slow_start_s must be >= 0 (got {self.slow_start_s})")
        if self.max_retry_after_s < self.min_retry_after_s:
            raise ValueError("max_retry_after_s must be >= min_retry_after_s")

    def spec(self, tier: Tier) -> TierSpec:
        try:
            return self.tiers[tier]
        except KeyError:
            raise ValueError(f"unknown tier {str(tier)!r}; expected one of {', '.join(TIERS)}") from None

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> "TierPolicy":
        """Builds a policy from plain data (a config section's dump); unknown keys are errors.

        `tiers` may name only the tiers and fields it changes; the rest keep their defaults.
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown tier policy field(s): {', '.join(unknown)}")
        values = dict(data)
        if "tiers" in values:
            tiers = _default_tiers()
            raw_tiers = values["tiers"]
            if not isinstance(raw_tiers, Mapping):
                raise ValueError("tiers must be a mapping of tier name to settings")
            for name, raw in raw_tiers.items():
                if name not in TIERS:
                    raise ValueError(f"tiers.{name}: unknown tier; expected one of {', '.join(TIERS)}")
                tier = Tier(name)
                tiers[tier] = _build(TierSpec, raw, f"tiers.{name}", base=tiers[tier])
            values["tiers"] = tiers
        if "shares" in values:
            values["shares"] = _build(AdaptiveShares, values["shares"], "shares", base=AdaptiveShares())
        return cls(**values)


def _build(kind: type, raw: Any, prefix: str, base: Any) -> Any:
    if isinstance(raw, kind):
        return raw
    if not isinstance(raw, Mapping):
        raise ValueError(f"{prefix} must be a mapping")
    known = {f.name for f in fields(kind)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{prefix}: unknown field(s) {', '.join(unknown)}")
    merged = {f.name: getattr(base, f.name) for f in fields(kind)}
    merged.update(raw)
    return kind(**merged)
