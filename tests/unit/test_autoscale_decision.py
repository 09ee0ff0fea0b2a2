"""Autoscaler decision logic, driven by a simulated clock and synthetic metric series."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, time, timezone
from typing import Callable

import pytest
import yaml

from services.common.config import ConfigError
from services.router.autoscale import (
    Action,
    Autoscaler,
    AutoscalerConfig,
    PolicyError,
    PoolAutoscaler,
    PoolPolicy,
    PrewarmWindow,
    Replicas,
    ScaleDecision,
)
from services.router.autoscale.signals import LatencyWindow, RateTracker, TrendWindow


def utc(*args: int) -> float:
    return datetime(*args, tzinfo=timezone.utc).timestamp()


# Monday 2 March 2026, 06:00 UTC (07:00 in Berlin, before daylight saving time starts).
T0 = utc(2026, 3, 2, 6, 0)


@dataclass
class Sim:
    """A simulated clock plus a pool whose decisions are applied as the executor would."""

    pool: PoolAutoscaler
    now: float = T0
    current: Replicas = field(default_factory=lambda: Replicas(1))
    decisions: list[ScaleDecision] = field(default_factory=list)

    def run(
        self,
        seconds: float,
        rps: float | Callable[[float, Replicas], float] = 0.0,
        ttft_ms: float | Callable[[float, Replicas], float] | None = None,
        queue_wait_ms: Callable[[float], float] | None = None,
        tick_s: float = 10.0,
    ) -> list[ScaleDecision]:
        """Feeds one second of traffic at a time and decides every `tick_s` seconds."""
        made = []
        end = self.now + seconds
        carry = 0.0
        while self.now < end - 1e-9:
            rate = rps(self.now, self.current) if callable(rps) else rps
            carry += rate
            arrivals = int(carry)
            carry -= arrivals
            for i in range(arrivals):
                latency = ttft_ms(self.now, self.current) if callable(ttft_ms) else ttft_ms
                # A deterministic spread around the series' value, so p99 sits at its top.
                jitter = 1.0 + 0.02 * ((i % 5) - 2)
                self.pool.observe_request(
                    self.now,
                    ttft_ms=None if latency is None else latency * jitter,
                    queue_wait_ms=None if queue_wait_ms is None else queue_wait_ms(self.now),
                )
            self.now += 1.0
            if round(self.now - T0) % round(tick_s) == 0:
                decision = self.pool.decide(self.now, self.current)
                self.current = Replicas(decision.serving, decision.standby)
                made.append(decision)
        self.decisions += made
        return made


def sim(policy: PoolPolicy | None = None, prewarm: tuple[PrewarmWindow, ...] = (), **kwargs) -> Sim:
    return Sim(PoolAutoscaler("primary", policy or PoolPolicy(), prewarm), **kwargs)


def actions(decisions: list[ScaleDecision]) -> list[Action]:
    return [d.action for d in decisions if d.action is not Action.HOLD]


# ---------------------------------------------------------------------------------------------
# Policy


def test_defaults_follow_the_design():
    policy = PoolPolicy()
    assert policy.target_p99_ttft_ms == 800
    assert policy.scale_out_at == 0.9
    assert policy.calm_p99_ttft_ms == 500
    assert policy.calm_for_s == 600
    assert policy.surge_factor == 3


@pytest.mark.parametrize(
    "values, field_name",
    [
        ({"min_replicas": -1}, "min_replicas"),
        ({"min_replicas": 5, "max_replicas": 4}, "max_replicas"),
        ({"max_replicas": True}, "max_replicas"),
        ({"min_replicas": 1.5}, "min_replicas"),
        ({"target_p99_ttft_ms": 0}, "target_p99_ttft_ms"),
        ({"target_p99_e2e_ms": -1.0}, "target_p99_e2e_ms"),
        ({"scale_out_at": 1.2}, "scale_out_at"),
        ({"calm_p99_ttft_ms": 720}, "calm_p99_ttft_ms"),
        ({"scale_out_cooldown_s": -1}, "scale_out_cooldown_s"),
        ({"min_samples": 0}, "min_samples"),
        ({"min_samples": 50, "max_samples": 10}, "max_samples"),
        ({"min_queue_samples": 2}, "min_queue_samples"),
        ({"standby_replicas": 8}, "standby_replicas"),
        ({"surge_factor": 1.0}, "surge_factor"),
        ({"surge_window_s": 7}, "surge_window_s"),
        ({"baseline_min_s": 4000}, "baseline_min_s"),
        ({"latency_window_s": float("nan")}, "latency_window_s"),
    ],
)
def test_bad_policy_values_name_the_field(values, field_name):
    with pytest.raises(PolicyError, match=rf"'{field_name}'") as caught:
        PoolPolicy(**values)
    assert isinstance(caught.value, ConfigError)
    assert caught.value.field == field_name


def test_config_from_yaml_names_full_paths():
    text = """
pools:
  support:
    min_replicas: 1
    max_replicas: 6
    target_p99_ttft_ms: 800
prewarm:
  - "pool support: warm 2 replicas 09:45\u201312:00 Europe/Berlin mon-fri"
  - {pool: support, start: "13:00", end: 14:30, replicas: 1, timezone: UTC, weekdays: sat-sun}
"""
    config = AutoscalerConfig.from_dict(yaml.safe_load(text))
    assert config.pools["support"].max_replicas == 6
    first, second = config.prewarm
    assert (first.start, first.end, first.replicas, first.timezone) == (time(9, 45), time(12), 2, "Europe/Berlin")
    assert first.weekdays == frozenset({0, 1, 2, 3, 4})
    # PyYAML reads an unquoted 14:30 as the base-60 integer 870; it is still 14:30.
    assert (second.start, second.end, second.weekdays) == (time(13), time(14, 30), frozenset({5, 6}))

    cases = [
        ({"pools": {"p": {"min_replicas": -1}}}, "autoscale.pools.p.min_replicas"),
        ({"pools": {"p": {"max_replica": 3}}}, "autoscale.pools.p.max_replica"),
        ({"pools": {}}, "autoscale.pools"),
        ({"pools": {"p": {}}, "extra": 1}, "autoscale.extra"),
        ({"pools": {"p": {}}, "prewarm": ["p: warm 2 at nine"]}, "autoscale.prewarm.0"),
        ({"pools": {"p": {}}, "prewarm": ["q: warm 1 replica 09:00-10:00 UTC"]}, "autoscale.prewarm.0.pool"),
        (
            {"pools": {"p": {}}, "prewarm": ["p: warm 1 replica 09:00-10:00 Mars/Olympus"]},
            "autoscale.prewarm.0.timezone",
        ),
        ({"pools": {"p": {}}, "prewarm": ["p: warm 1 replica 25:00-10:00 UTC"]}, "autoscale.prewarm.0.start"),
        (
            {"pools": {"p": {"max_replicas": 2}}, "prewarm": ["p: warm 2 replicas 09:00-10:00 UTC"]},
            "autoscale.prewarm.0.replicas",
        ),
        ({"pools": {"p": {}}, "prewarm": [{"pool": "p", "start": "09:00", "end": "10:00"}]}, "autoscale.prewarm.0"),
    ]
    for data, path in cases:
        with pytest.raises(PolicyError) as caught:
            AutoscalerConfig.from_dict(data)
        assert caught.value.field == path, (data, str(caught.value))


@pytest.mark.parametrize(
    "text, expected",
    [
        ("support: warm 2 replicas 09:45-12:00 UTC", ("support", time(9, 45), time(12), 2, "UTC", set(range(7)))),
        (
            "pool support: warm 2 replicas 09:45\u201312:00 Asia/Shanghai",
            ("support", time(9, 45), time(12), 2, "Asia/Shanghai", set(range(7))),
        ),
        (
            "light: warm 1 replica 22:00 - 02:00 America/New_York fri-mon",
            ("light", time(22), time(2), 1, "America/New_York", {4, 5, 6, 0}),
        ),
        (
            "primary: warm 3 replicas 8:00-9:30 Europe/Berlin mon,wed-thu",
            ("primary", time(8), time(9, 30), 3, "Europe/Berlin", {0, 2, 3}),
        ),
    ],
)
def test_prewarm_notation(text, expected):
    window = PrewarmWindow.parse(text)
    assert (window.pool, window.start, window.end, window.replicas, window.timezone, set(window.weekdays)) == expected


def test_prewarm_window_follows_local_time_and_daylight_saving():
    window = PrewarmWindow.parse("support: warm 2 replicas 09:45-12:00 Europe/Berlin mon-fri")
    # Winter: Berlin is UTC+1.
    assert not window.active_at(utc(2026, 1, 12, 8, 44))  # 09:44 in Berlin
    assert window.active_at(utc(2026, 1, 12, 8, 45))
    assert window.active_at(utc(2026, 1, 12, 10, 59))
    assert not window.active_at(utc(2026, 1, 12, 11, 0))  # 12:00: the end is exclusive
    # Summer: UTC+2, so the same local window starts an hour earlier in UTC.
    assert window.active_at(utc(2026, 7, 13, 7, 45))
    assert not window.active_at(utc(2026, 7, 13, 10, 0))
    # Saturday is not mon-fri.
    assert not window.active_at(utc(2026, 1, 17, 9, 0))


def test_prewarm_window_across_midnight_belongs_to_its_start_day():
    window = PrewarmWindow.parse("night: warm 1 replica 22:00-02:00 UTC fri")
    assert window.active_at(utc(2026, 3, 6, 23, 0))  # Friday night
    assert window.active_at(utc(2026, 3, 7, 1, 30))  # early Saturday: Friday's window
    assert not window.active_at(utc(2026, 3, 7, 23, 0))  # Saturday night
    assert not window.active_at(utc(2026, 3, 6, 1, 30))  # early Friday: Thursday's window


# ---------------------------------------------------------------------------------------------
# Signals


def test_latency_window_percentile_expiry_and_bound():
    window = LatencyWindow(window_s=60, max_samples=100)
    for i in range(100):
        window.add(T0 + i * 0.5, float(i + 1))
    assert window.percentile(T0 + 50, 0.99) == 99.0  # nearest rank of 1..100
    assert window.percentile(T0 + 50, 0.5) == 50.0
    assert window.percentile(T0 + 50, 0.99, min_samples=101) is None
    # Samples at or before now - 60 s leave the window.
    assert window.count(T0 + 60 + 10) == 79
    assert window.count(T0 + 200) == 0
    for i in range(1000):
        window.add(T0 + 300, 1.0)
    assert window.count(T0 + 300) == 100 and window.overflowed == 900
    # A late report is taken as arriving at the newest time seen.
    window.add(T0, 5000.0)
    assert window.percentile(T0 + 301, 1.0) == 5000.0


def test_trend_window_fits_slope_and_level():
    trend = TrendWindow(window_s=60, max_samples=1000)
    for second in range(30):
        trend.add(T0 + second, 100.0 + 10.0 * second)  # +10 ms per second
    slope, level = trend.fit(T0 + 29, min_samples=10)
    assert slope == pytest.approx(10.0)
    assert level == pytest.approx(390.0)
    assert trend.fit(T0 + 29, min_samples=31) is None
    flat = TrendWindow(window_s=60, max_samples=1000)
    for _ in range(20):
        flat.add(T0, 500.0)
    assert flat.fit(T0, min_samples=3) is None  # no spread in time: no trend


def test_rate_tracker_uses_completed_buckets_and_a_bounded_history():
    rates = RateTracker(bucket_s=5, horizon_buckets=12)
    rates.mark(T0)
    for second in range(60):
        rates.add(T0 + second, 2)  # 2 req/s
    for second in range(60, 70):
        rates.add(T0 + second, 10)  # 10 req/s
    now = T0 + 70
    assert rates.rate(now, buckets=2) == pytest.approx(10.0)
    assert rates.baseline(now, skip_buckets=2, buckets=10, min_s=30) == pytest.approx(2.0)
    assert rates.baseline(now, skip_buckets=2, buckets=10, min_s=120) is None
    # The current, half-filled bucket is not counted.
    rates.add(now + 1, 1000)
    assert rates.rate(now + 2, buckets=2) == pytest.approx(10.0)
    assert len(rates._buckets) <= 13


# ---------------------------------------------------------------------------------------------
# Scaling out


def test_scales_out_at_ninety_percent_of_the_target():
    below = sim(current=Replicas(4))
    decisions = below.run(30, rps=5, ttft_ms=690)  # p99 with the +-4 % spread: 718 ms < 720 ms
    assert actions(decisions) == []

    near = sim(current=Replicas(4))
    decisions = near.run(30, rps=5, ttft_ms=710)  # p99 738 ms >= 720 ms
    out = [d for d in decisions if d.action is Action.SCALE_OUT]
    assert len(out) == 1
    assert (out[0].current.serving, out[0].serving) == (4, 5)  # max(1, ceil(4 x 0.25))
    assert "p99 TTFT" in out[0].reason and "800 ms" in out[0].reason
    assert out[0].signals.p99_ttft_ms >= 720


def test_needs_enough_samples_for_a_p99():
    quiet = sim(current=Replicas(2))
    decisions = quiet.run(60, rps=0.25, ttft_ms=3000)  # 15 requests a minute < min_samples
    assert actions(decisions) == []
    assert decisions[-1].signals.p99_ttft_ms is None


def test_scale_out_cooldown_and_max_replicas():
    s = sim(PoolPolicy(max_replicas=4, scale_out_cooldown_s=120), current=Replicas(1))
    decisions = s.run(600, rps=5, ttft_ms=2000)  # hopelessly slow, however many replicas
    outs = [d for d in decisions if d.action is Action.SCALE_OUT]
    assert [d.serving for d in outs] == [2, 3, 4]
    gaps = [b.at - a.at for a, b in zip(outs, outs[1:])]
    assert all(gap >= 120 for gap in gaps)
    cooling = [d for d in decisions if "cooldown" in d.reason]
    assert cooling and all(d.action is Action.HOLD for d in cooling)
    assert decisions[-1].serving == 4 and "at max_replicas 4" in decisions[-1].reason


def test_growing_queue_wait_scales_out_before_latency_does():
    grows = sim(current=Replicas(2))
    decisions = grows.run(60, rps=5, ttft_ms=300, queue_wait_ms=lambda t: 20 + 5.0 * (t - T0))  # +300 ms/min
    out = [d for d in decisions if d.action is Action.SCALE_OUT]
    assert out and "queue wait growing" in out[0].reason
    assert out[0].signals.p99_ttft_ms < 720

    flat_high = sim(current=Replicas(2))
    assert actions(flat_high.run(60, rps=5, ttft_ms=300, queue_wait_ms=lambda t: 400.0)) == []

    tiny = sim(current=Replicas(2))  # rising fast, but from 1 ms to 10 ms: below the floor
    assert actions(tiny.run(30, rps=5, ttft_ms=300, queue_wait_ms=lambda t: 1 + 0.3 * (t - T0))) == []


def test_end_to_end_target_is_optional():
    without = sim(current=Replicas(2))
    assert actions(without.run(30, rps=5, ttft_ms=300)) == []
    with_target = sim(PoolPolicy(target_p99_e2e_ms=4000), current=Replicas(2))
    for second in range(30):
        for _ in range(5):
            with_target.pool.observe_request(T0 + second, ttft_ms=300, e2e_ms=3900)
    decision = with_target.pool.decide(T0 + 30, Replicas(2))
    assert decision.action is Action.SCALE_OUT and "p99 e2e" in decision.reason


# ---------------------------------------------------------------------------------------------
# Scaling in


def test_scales_in_only_after_ten_calm_minutes():
    s = sim(current=Replicas(4))
    early = s.run(590, rps=5, ttft_ms=300)
    assert actions(early) == []
    later = s.run(20, rps=5, ttft_ms=300)
    assert actions(later) == [Action.SCALE_IN]
    scale_in = next(d for d in later if d.action is Action.SCALE_IN)
    assert (scale_in.current.serving, scale_in.serving) == (4, 3)
    assert scale_in.at - T0 >= 600


def test_one_slow_spell_restarts_the_calm():
    s = sim(current=Replicas(4))
    s.run(300, rps=5, ttft_ms=300)
    s.run(60, rps=5, ttft_ms=600)  # not calm (>= 500) but not pressing (< 720) either
    assert actions(s.decisions) == []
    spell_end = s.now
    s.run(700, rps=5, ttft_ms=300)
    scale_ins = [d for d in s.decisions if d.action is Action.SCALE_IN]
    # The 60 s latency window keeps the slow samples for a minute after the spell.
    assert len(scale_ins) == 1 and scale_ins[0].at >= spell_end + 600


def test_between_calm_and_pressure_nothing_moves():
    s = sim(current=Replicas(3))
    assert actions(s.run(1800, rps=5, ttft_ms=600)) == []


def test_each_scale_in_must_prove_calm_again():
    s = sim(PoolPolicy(min_replicas=1), current=Replicas(4))
    s.run(3600, rps=5, ttft_ms=300)
    scale_ins = [d for d in s.decisions if d.action is Action.SCALE_IN]
    assert [d.serving for d in scale_ins] == [3, 2, 1]
    assert all(b.at - a.at >= 600 for a, b in zip(scale_ins, scale_ins[1:]))
    assert s.current.serving == 1  # never below min_replicas


def test_scale_in_waits_out_its_cooldown_after_a_scale_out():
    s = sim(PoolPolicy(calm_for_s=60, scale_in_cooldown_s=300), current=Replicas(2))
    s.run(30, rps=5, ttft_ms=2000)
    assert actions(s.decisions) == [Action.SCALE_OUT]
    scaled_at = next(d.at for d in s.decisions if d.action is Action.SCALE_OUT)
    s.run(400, rps=5, ttft_ms=300)
    held = [d for d in s.decisions if "scale-in cooldown" in d.reason]
    assert held
    first_in = next(d for d in s.decisions if d.action is Action.SCALE_IN)
    assert first_in.at - scaled_at >= 300


def test_an_idle_pool_shrinks_to_its_minimum():
    s = sim(PoolPolicy(min_replicas=1), current=Replicas(3))
    s.run(1300, rps=0)
    assert [d.serving for d in s.decisions if d.action is Action.SCALE_IN] == [2, 1]


def test_bounds_are_corrected_at_once():
    pool = PoolAutoscaler("primary", PoolPolicy(min_replicas=2, max_replicas=5))
    up = pool.decide(T0, Replicas(0))
    assert (up.action, up.serving) == (Action.SCALE_OUT, 2) and "min_replicas" in up.reason
    down = pool.decide(T0 + 10, Replicas(9))
    assert (down.action, down.serving) == (Action.SCALE_IN, 5) and "max_replicas" in down.reason


# ---------------------------------------------------------------------------------------------
# Prewarm and surges


def test_prewarm_window_holds_warm_standbys_within_max():
    window = PrewarmWindow.parse("primary: warm 2 replicas 09:45-12:00 Europe/Berlin")

    def decide(at: float, current: Replicas) -> ScaleDecision:
        return PoolAutoscaler("primary", PoolPolicy(max_replicas=4), [window]).decide(at, current)

    before = decide(utc(2026, 3, 2, 8, 40), Replicas(1))  # 09:40 in Berlin
    assert before.standby == 0 and before.total == 1
    during = decide(utc(2026, 3, 2, 8, 50), Replicas(1))
    assert (during.serving, during.standby, during.total) == (1, 2, 3)
    assert during.changed and "prewarm primary: warm 2 09:45-12:00 Europe/Berlin" in during.reason
    crowded = decide(utc(2026, 3, 2, 9, 0), Replicas(3, 2))  # only one slot left under max
    assert (crowded.serving, crowded.standby) == (3, 1)
    after = decide(utc(2026, 3, 2, 11, 0), Replicas(3, 1))  # 12:00 in Berlin
    assert after.standby == 0 and after.action is Action.HOLD and after.changed


def test_windows_of_other_pools_are_ignored():
    window = PrewarmWindow.parse("light: warm 2 replicas 00:00-23:59 UTC")
    assert PoolAutoscaler("primary", PoolPolicy(), [window]).decide(T0, Replicas(1)).standby == 0


def _steady_then_surge(s: Sim, base_rps: float, surge_rps: float, base_s: float = 1800):
    s.run(base_s, rps=base_rps, ttft_ms=300)
    return s.run(120, rps=surge_rps, ttft_ms=300)  # latency still fine: the surge alone acts


def test_surge_promotes_warm_standbys_before_latency_suffers():
    s = sim(PoolPolicy(min_replicas=2, max_replicas=8, standby_replicas=2), current=Replicas(2, 2))
    surge = _steady_then_surge(s, base_rps=2, surge_rps=8)
    promoted = [d for d in surge if d.action is Action.PROMOTE_STANDBY]
    assert len(promoted) == 1, [d.reason for d in surge]
    decision = promoted[0]
    # Detected within one surge window plus a bucket of the rate jump.
    assert decision.at - (T0 + 1800) <= 60 + 5
    # Rate x4 would want 2 x 3 = 6 more replicas; there are 2 standbys to promote.
    assert (decision.promote, decision.serving) == (2, 4)
    assert decision.standby == 2  # the standby level is refilled, within max_replicas
    assert "surge" in decision.reason and decision.signals.request_rate >= 3 * decision.signals.baseline_rate
    # No second promotion while the surge cooldown runs.
    assert sum(d.action is Action.PROMOTE_STANDBY for d in s.decisions) == 1


def test_surge_without_standbys_scales_out():
    s = sim(PoolPolicy(min_replicas=2, max_replicas=8), current=Replicas(2))
    surge = _steady_then_surge(s, base_rps=2, surge_rps=8)
    outs = [d for d in surge if d.action is not Action.HOLD]
    assert outs and outs[0].action is Action.SCALE_OUT and "surge" in outs[0].reason


def test_no_surge_without_a_baseline_or_below_the_minimum_rate():
    cold = sim(PoolPolicy(standby_replicas=1), current=Replicas(1, 1))
    cold.run(120, rps=0.5, ttft_ms=300)
    assert actions(cold.run(120, rps=8, ttft_ms=300)) == []  # 4 min of history < baseline_min_s

    trickle = sim(PoolPolicy(standby_replicas=1), current=Replicas(1, 1))
    assert actions(_steady_then_surge(trickle, base_rps=0.1, surge_rps=0.6)) == []  # x6, but < 1 req/s


def test_a_day_of_traffic_keeps_the_invariants():
    # Each replica serves 4 req/s; TTFT grows as it fills up (an M/M/1-like curve).
    def ttft(now: float, current: Replicas) -> float:
        load = rate(now, current) / (4.0 * max(current.serving, 1))
        return 4000.0 if load >= 0.95 else 200.0 / (1.0 - load)

    def rate(now: float, current: Replicas) -> float:
        minute = (now - T0) / 60
        if minute < 30:
            return 2.0
        if minute < 60:
            return 2.0 + 8.0 * (minute - 30) / 30  # ramp to 10 req/s
        if minute < 120:
            return 10.0
        return 2.0

    policy = PoolPolicy(min_replicas=1, max_replicas=8)
    s = sim(policy, current=Replicas(1))
    s.run(6 * 3600, rps=rate, ttft_ms=ttft)
    outs = [d for d in s.decisions if d.action is Action.SCALE_OUT]
    ins = [d for d in s.decisions if d.action is Action.SCALE_IN]
    assert all(policy.min_replicas <= d.serving and d.total <= policy.max_replicas for d in s.decisions)
    assert all(b.at - a.at >= policy.scale_out_cooldown_s for a, b in zip(outs, outs[1:]))
    assert all(b.at - a.at >= policy.calm_for_s for a, b in zip(ins, ins[1:]))
    # No flapping: nothing is removed within the calm period after something was added.
    assert all(i.at - o.at >= policy.calm_for_s for o in outs for i in ins if i.at > o.at)
    peak = max(d.serving for d in s.decisions)
    assert 4 <= peak <= 6  # 10 req/s needs 4 replicas to stay under 720 ms
    assert s.current.serving == 1  # the evening brings it back down


# ---------------------------------------------------------------------------------------------
# Several pools


def test_autoscaler_decides_every_pool_independently():
    config = AutoscalerConfig(pools={"primary": PoolPolicy(), "light": PoolPolicy(min_replicas=2)})
    scaler = Autoscaler(config)
    for second in range(30):
        for _ in range(5):
            scaler.pool("primary").observe_request(T0 + second, ttft_ms=2000)
    decisions = scaler.decide(T0 + 30, {"primary": Replicas(2), "light": Replicas(2)})
    assert decisions["primary"].action is Action.SCALE_OUT
    assert decisions["light"].action is Action.HOLD
    with pytest.raises(ValueError, match="light"):
        scaler.decide(T0 + 40, {"primary": Replicas(3)})
    with pytest.raises(KeyError, match="unknown pool"):
        scaler.pool("heavy")
    with pytest.raises(ValueError):
        Replicas(-1)
    assert math.isclose(decisions["primary"].at, T0 + 30)
