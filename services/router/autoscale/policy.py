"""Autoscaler policy: per-pool latency targets, bounds, cooldowns, surge detection and prewarm
windows, as frozen dataclasses validated on construction.

A bad value raises `ConfigError` naming the field, like the service config does;
`AutoscalerConfig.from_dict` names it with its full path (`autoscale.pools.primary.min_replicas`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields
from datetime import datetime, time
from typing import Any, Mapping
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from services.common.config import ConfigError

WEEKDAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")


class PolicyError(ConfigError):
    """An invalid autoscaler setting; `field` is its path relative to the object that holds it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"config field '{field}': {message}")
        self.field = field
        self.reason = message

    def under(self, prefix: str) -> "PolicyError":
        return PolicyError(f"{prefix}.{self.field}", self.reason)


def _number(name: str, value: Any, *, integer: bool = False) -> None:
    # bool is an int in Python; a `true` in YAML must not become one replica.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise PolicyError(name, f"must be {'an integer' if integer else 'a number'}, got {value!r}")
    if not math.isfinite(value):
        raise PolicyError(name, "must be finite")


@dataclass(frozen=True)
class PoolPolicy:
    """How one worker pool scales. Defaults follow the design: an 800 ms p99 TTFT target,
    scale out at 90 % of it, scale in only after ten calm minutes under 500 ms."""

    min_replicas: int = 1
    """Serving replicas never go below this."""
    max_replicas: int = 8
    """Serving plus warm standby replicas never go above this: each holds a GPU."""
    target_p99_ttft_ms: float = 800.0
    """The pool's p99 time-to-first-token target."""
    target_p99_e2e_ms: float | None = None
    """Optional p99 end-to-end target; None leaves end-to-end latency out of the decision."""
    scale_out_at: float = 0.9
    """Scale out once a p99 reaches this fraction of its target."""
    calm_p99_ttft_ms: float = 500.0
    """A p99 TTFT below this (with the queue wait not growing) counts as calm."""
    calm_for_s: float = 600.0
    """Scale in only after the pool has been calm this long without a break."""
    scale_out_cooldown_s: float = 120.0
    """After adding replicas, wait this long before adding more: new ones need time to load."""
    scale_in_cooldown_s: float = 300.0
    """After any change of serving replicas, wait this long before removing one."""
    scale_out_step_ratio: float = 0.25
    """A scale-out adds max(1, ceil(serving x this)) replicas."""
    latency_window_s: float = 60.0
    """Sliding window of the latency samples behind each p99."""
    min_samples: int = 20
    """Fewer samples than this in the window give no p99: too few requests to be busy."""
    max_samples: int = 10_000
    """Samples kept per window (newest win), bounding memory under any load."""
    queue_window_s: float = 60.0
    """Sliding window of the queue-wait samples behind the trend."""
    min_queue_samples: int = 10
    """Fewer queue-wait samples than this give no trend."""
    queue_growth_ms_per_min: float = 100.0
    """Queue wait rising at least this fast (least-squares slope) counts as pressure..."""
    queue_wait_floor_ms: float = 50.0
    """...once the fitted queue wait is at least this: a climb from 1 ms to 3 ms is noise."""
    standby_replicas: int = 0
    """Warm standby replicas (model loaded, asleep) kept outside prewarm windows."""
    surge_factor: float = 3.0
    """A request rate at least this multiple of its baseline is a surge."""
    surge_window_s: float = 60.0
    """The recent window whose request rate is compared with the baseline."""
    baseline_window_s: float = 1800.0
    """The window before the recent one that makes the baseline rate."""
    baseline_min_s: float = 300.0
    """History needed before a baseline exists (no surge is called on a cold start)."""
    surge_min_rate_per_s: float = 1.0
    """A recent rate below this is never a surge, whatever the baseline."""
    surge_cooldown_s: float = 120.0
    """After acting on a surge, ignore surges this long: the baseline has to catch up."""
    rate_bucket_s: float = 5.0
    """Request arrivals are counted in buckets of this width (also the surge detection lag)."""

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if item.name == "target_p99_e2e_ms" and value is None:
                continue
            _number(item.name, value, integer=item.type in ("int", int))
        if self.min_replicas < 0:
            raise PolicyError("min_replicas", "must be >= 0")
        if self.max_replicas < max(1, self.min_replicas):
            raise PolicyError("max_replicas", f"must be >= 1 and >= min_replicas ({self.min_replicas})")
        for name in (
            "target_p99_ttft_ms",
            "calm_p99_ttft_ms",
            "scale_out_step_ratio",
            "latency_window_s",
            "queue_window_s",
            "queue_growth_ms_per_min",
            "rate_bucket_s",
        ):
            if getattr(self, name) <= 0:
                raise PolicyError(name, "must be > 0")
        if self.target_p99_e2e_ms is not None and self.target_p99_e2e_ms <= 0:
            raise PolicyError("target_p99_e2e_ms", "must be > 0 (or null)")
        if not 0 < self.scale_out_at <= 1:
            raise PolicyError("scale_out_at", "must be in (0, 1]")
        if self.calm_p99_ttft_ms >= self.scale_out_at * self.target_p99_ttft_ms:
            # Otherwise one p99 could be calm and pressing at once, and the pool would flap.
            raise PolicyError(
                "calm_p99_ttft_ms",
                f"must be below scale_out_at x target_p99_ttft_ms ({self.scale_out_at * self.target_p99_ttft_ms:g} ms)",
            )
        for name in (
            "calm_for_s",
            "scale_out_cooldown_s",
            "scale_in_cooldown_s",
            "queue_wait_floor_ms",
            "surge_min_rate_per_s",
            "surge_cooldown_s",
            "standby_replicas",
        ):
            if getattr(self, name) < 0:
                raise PolicyError(name, "must be >= 0")
        if self.min_samples < 1:
            raise PolicyError("min_samples", "must be >= 1")
        if self.max_samples < self.min_samples:
            raise PolicyError("max_samples", f"must be >= min_samples ({self.min_samples})")
        if self.min_queue_samples < 3:
            raise PolicyError("min_queue_samples", "must be >= 3 (a trend needs three points)")
        if self.min_replicas + self.standby_replicas > self.max_replicas:
            raise PolicyError("standby_replicas", "min_replicas + standby_replicas must not exceed max_replicas")
        if self.surge_factor <= 1:
            raise PolicyError("surge_factor", "must be > 1")
        for name in ("surge_window_s", "baseline_window_s"):
            buckets = getattr(self, name) / self.rate_bucket_s
            if buckets < 1 or abs(buckets - round(buckets)) > 1e-9:
                raise PolicyError(name, f"must be a positive multiple of rate_bucket_s ({self.rate_bucket_s:g})")
        if not 0 < self.baseline_min_s <= self.baseline_window_s:
            raise PolicyError("baseline_min_s", "must be in (0, baseline_window_s]")

    @property
    def surge_buckets(self) -> int:
        return round(self.surge_window_s / self.rate_bucket_s)

    @property
    def baseline_buckets(self) -> int:
        return round(self.baseline_window_s / self.rate_bucket_s)


_WINDOW = re.compile(
    r"""^\s*(?:pool\s+)?(?P<pool>[\w.-]+)\s*:\s*
        warm\s+(?P<replicas>\d+)\s+replicas?\s+
        (?P<start>\d{1,2}:\d{2})\s*[-\u2013\u2014]\s*(?P<end>\d{1,2}:\d{2})\s+
        (?P<timezone>[A-Za-z][\w+/-]*)
        (?:\s+(?P<days>[a-z,\s-]+?))?\s*$""",
    re.VERBOSE,
)


def _clock_time(name: str, value: Any) -> time:
    if isinstance(value, time):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        # YAML 1.1 (PyYAML) reads an unquoted 12:00 as the base-60 integer 720.
        value = f"{value // 60}:{value % 60:02d}"
    text = str(value)
    hours, _, minutes = text.partition(":")
    try:
        return time(int(hours), int(minutes))
    except ValueError:
        raise PolicyError(name, f"{text!r} is not a time of day (HH:MM)") from None


def _weekdays(text: str) -> frozenset[int]:
    days: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, _, last = part.partition("-")
        try:
            start = WEEKDAYS.index(first.strip()[:3])
            end = WEEKDAYS.index(last.strip()[:3]) if last else start
        except ValueError:
            raise PolicyError("weekdays", f"{part!r} is not a day or range like mon-fri") from None
        day = start
        days.add(day)
        while day != end:  # ranges may wrap: fri-mon is fri, sat, sun, mon
            day = (day + 1) % 7
            days.add(day)
    return frozenset(days)


@dataclass(frozen=True)
class PrewarmWindow:
    """Keep `replicas` warm standbys for `pool` between `start` and `end` (local wall-clock
    time in `timezone`), on `weekdays` (0 = Monday). A window whose end is before its start
    runs past midnight and belongs to the day it starts."""

    pool: str
    """The pool to prewarm."""
    start: time
    """Local start time (inclusive)."""
    end: time
    """Local end time (exclusive)."""
    replicas: int
    """Warm standby replicas to hold during the window."""
    timezone: str = "UTC"
    """IANA time zone of start and end, e.g. Europe/Berlin."""
    weekdays: frozenset[int] = field(default_factory=lambda: frozenset(range(7)))
    """Days the window starts on, 0 = Monday."""

    def __post_init__(self) -> None:
        if not self.pool:
            raise PolicyError("pool", "must not be empty")
        _number("replicas", self.replicas, integer=True)
        if self.replicas < 1:
            raise PolicyError("replicas", "must be >= 1")
        if self.start == self.end:
            raise PolicyError("end", "must differ from start")
        if not self.weekdays or not set(self.weekdays) <= set(range(7)):
            raise PolicyError("weekdays", "must be a non-empty set of 0..6 (0 = Monday)")
        try:
            ZoneInfo(self.timezone)
        except (ZoneInfoNotFoundError, ValueError):
            raise PolicyError("timezone", f"unknown time zone {self.timezone!r}") from None

    @classmethod
    def parse(cls, text: str) -> "PrewarmWindow":
        """Reads the operator's notation: 'support: warm 2 replicas 09:45-12:00 Europe/Berlin mon-fri'
        (a leading 'pool', an en dash and the days are optional; the time zone is not)."""
        match = _WINDOW.match(text)
        if match is None:
            raise PolicyError(
                "prewarm", f"{text!r} does not read like 'POOL: warm N replicas HH:MM-HH:MM TIMEZONE [mon-fri]'"
            )
        days = match.group("days")
        return cls(
            pool=match.group("pool"),
            start=_clock_time("start", match.group("start")),
            end=_clock_time("end", match.group("end")),
            replicas=int(match.group("replicas")),
            timezone=match.group("timezone"),
            weekdays=_weekdays(days) if days else frozenset(range(7)),
        )

    def active_at(self, now: float) -> bool:
        """Whether the window holds at `now` (seconds since the Unix epoch)."""
        local = datetime.fromtimestamp(now, ZoneInfo(self.timezone))
        clock, day = local.time().replace(tzinfo=None), local.weekday()
        if self.start < self.end:
            return day in self.weekdays and self.start <= clock < self.end
        if clock >= self.start:
            return day in self.weekdays
        return clock < self.end and (day - 1) % 7 in self.weekdays

    def describe(self) -> str:
        return f"{self.pool}: warm {self.replicas} {self.start:%H:%M}-{self.end:%H:%M} {self.timezone}"


@dataclass(frozen=True)
class AutoscalerConfig:
    """Policies of every pool the autoscaler manages, and the prewarm schedule."""

    pools: Mapping[str, PoolPolicy]
    """Pool name -> its policy."""
    prewarm: tuple[PrewarmWindow, ...] = ()
    """Scheduled warm standbys, e.g. ahead of a daily peak."""

    def __post_init__(self) -> None:
        if not self.pools:
            raise PolicyError("pools", "must name at least one pool")
        object.__setattr__(self, "pools", dict(self.pools))
        object.__setattr__(self, "prewarm", tuple(self.prewarm))
        for index, window in enumerate(self.prewarm):
            policy = self.pools.get(window.pool)
            if policy is None:
                raise PolicyError(f"prewarm.{index}.pool", f"unknown pool {window.pool!r}")
            if policy.min_replicas + window.replicas > policy.max_replicas:
                raise PolicyError(
                    f"prewarm.{index}.replicas",
                    f"{window.replicas} warm + min_replicas {policy.min_replicas} exceed "
                    f"max_replicas {policy.max_replicas} of pool {window.pool!r}",
                )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], prefix: str = "autoscale") -> "AutoscalerConfig":
        """Builds the config from parsed YAML/JSON: {pools: {name: {field: value}}, prewarm: [...]},
        where a prewarm entry is the one-line notation or a mapping of PrewarmWindow fields."""
        unknown = set(data) - {"pools", "prewarm"}
        if unknown:
            raise PolicyError(f"{prefix}.{sorted(unknown)[0]}", "unknown field")
        pools: dict[str, PoolPolicy] = {}
        for name, values in (data.get("pools") or {}).items():
            pools[name] = _build(PoolPolicy, values or {}, f"{prefix}.pools.{name}")
        windows = []
        for index, entry in enumerate(data.get("prewarm") or []):
            where = f"{prefix}.prewarm.{index}"
            try:
                if isinstance(entry, str):
                    windows.append(PrewarmWindow.parse(entry))
                    continue
                values = dict(entry)
                for name in ("start", "end"):
                    if name in values:
                        values[name] = _clock_time(name, values[name])
                if isinstance(values.get("weekdays"), str):
                    values["weekdays"] = _weekdays(values["weekdays"])
                elif "weekdays" in values:
                    values["weekdays"] = frozenset(values["weekdays"])
            except PolicyError as error:
                # A notation that does not parse is the entry's fault as a whole.
                raise (PolicyError(where, error.reason) if error.field == "prewarm" else error.under(where)) from None
            windows.append(_build(PrewarmWindow, values, where))
        try:
            return cls(pools=pools, prewarm=tuple(windows))
        except PolicyError as error:
            raise error.under(prefix) from None


def _build(kind: type, values: Mapping[str, Any], where: str) -> Any:
    known = {item.name for item in fields(kind)}
    unknown = set(values) - known
    if unknown:
        raise PolicyError(f"{where}.{sorted(unknown)[0]}", "unknown field")
    try:
        return kind(**values)
    except PolicyError as error:
        raise error.under(where) from None
    except TypeError as error:  # a required field is missing
        raise PolicyError(where, str(error)) from None
