"""The autoscaler's decision, per pool: how many replicas should serve and how many should wait
warm, from latency, queue-wait trend, request-rate surges and the prewarm schedule.

Pure and synchronous: the caller feeds observations and asks for a decision with an explicit
`now` (seconds since the Unix epoch; prewarm windows read it as wall-clock time), so tests drive
it with a simulated clock. The elected leader calls `decide` once per tick and hands the result
to an executor (local processes or the Kubernetes scale API) and to the exported gauge
`ballast_desired_replicas{pool}`, which carries `ScaleDecision.total`.

Rules, in order of precedence:
1. Bounds: fewer serving replicas than min_replicas, or more than max_replicas, are corrected
   at once.
2. Surge (request rate >= surge_factor x its baseline): warm standbys are promoted to serving
   at once, without waiting for latency to suffer.
3. Pressure (a p99 at >= scale_out_at of its target, the queue wait growing, or a surge with no
   standby left): add replicas, at most once per scale_out_cooldown_s.
4. Calm (p99 TTFT under calm_p99_ttft_ms and the queue wait not growing, without a break for
   calm_for_s): remove one replica, at most once per scale_in_cooldown_s; the calm must then
   be proven again at the new size.
5. Otherwise hold.
Warm standbys follow the prewarm schedule (or the pool's standby_replicas), within max_replicas.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Iterable, Mapping

from services.router.autoscale.policy import AutoscalerConfig, PoolPolicy, PrewarmWindow
from services.router.autoscale.signals import LatencyWindow, RateTracker, TrendWindow


class Action(str, enum.Enum):
    HOLD = "hold"
    SCALE_OUT = "scale_out"
    SCALE_IN = "scale_in"
    PROMOTE_STANDBY = "promote_standby"


@dataclass(frozen=True)
class PoolSignals:
    """What a decision was based on (for logs, the etcd record and tests)."""

    p99_ttft_ms: float | None
    p99_e2e_ms: float | None
    latency_samples: int
    queue_wait_ms: float | None
    queue_wait_slope_ms_per_min: float | None
    request_rate: float
    baseline_rate: float | None


@dataclass(frozen=True)
class Replicas:
    """A pool's replica counts as the executor reports them."""

    serving: int
    standby: int = 0

    def __post_init__(self) -> None:
        if self.serving < 0 or self.standby < 0:
            raise ValueError(f"replica counts must be >= 0, got {self}")


@dataclass(frozen=True)
class ScaleDecision:
    pool: str
    at: float
    action: Action
    serving: int
    """Replicas that should serve traffic."""
    standby: int
    """Replicas that should hold the model loaded and sleep, ready to be promoted."""
    promote: int
    """Standbys to wake now (PROMOTE_STANDBY); already counted in `serving`."""
    current: Replicas
    reason: str
    signals: PoolSignals

    @property
    def total(self) -> int:
        """Pods the pool needs: what `ballast_desired_replicas{pool}` exports."""
        return self.serving + self.standby

    @property
    def changed(self) -> bool:
        return (self.serving, self.standby) != (self.current.serving, self.current.standby)


class PoolAutoscaler:
    """Observations and decision state of one pool."""

    def __init__(self, name: str, policy: PoolPolicy, prewarm: Iterable[PrewarmWindow] = ()) -> None:
        self.name = name
        self.policy = policy
        self.prewarm = tuple(w for w in prewarm if w.pool == name)
        self._ttft = LatencyWindow(policy.latency_window_s, policy.max_samples)
        self._e2e = LatencyWindow(policy.latency_window_s, policy.max_samples)
        self._queue_wait = TrendWindow(policy.queue_window_s, policy.max_samples)
        self._arrivals = RateTracker(policy.rate_bucket_s, policy.surge_buckets + policy.baseline_buckets)
        self._calm_since: float | None = None
        self._last_scale_out = -math.inf
        self._last_change = -math.inf
        self._last_surge = -math.inf
        self._started: float | None = None

    # -- observations ---------------------------------------------------------------------

    def observe_request(
        self,
        now: float,
        ttft_ms: float | None = None,
        e2e_ms: float | None = None,
        queue_wait_ms: float | None = None,
    ) -> None:
        """One request of this pool: its arrival and whichever latencies are known."""
        self._arrivals.add(now)
        if ttft_ms is not None:
            self._ttft.add(now, ttft_ms)
        if e2e_ms is not None:
            self._e2e.add(now, e2e_ms)
        if queue_wait_ms is not None:
            self._queue_wait.add(now, queue_wait_ms)

    def observe_ttft(self, now: float, ttft_ms: float) -> None:
        self._ttft.add(now, ttft_ms)

    def observe_e2e(self, now: float, e2e_ms: float) -> None:
        self._e2e.add(now, e2e_ms)

    def observe_queue_wait(self, now: float, wait_ms: float) -> None:
        self._queue_wait.add(now, wait_ms)

    def observe_arrivals(self, now: float, count: int = 1) -> None:
        self._arrivals.add(now, count)

    # -- signals --------------------------------------------------------------------------

    def signals(self, now: float) -> PoolSignals:
        policy = self.policy
        fit = self._queue_wait.fit(now, policy.min_queue_samples)
        return PoolSignals(
            p99_ttft_ms=self._ttft.percentile(now, 0.99, policy.min_samples),
            p99_e2e_ms=self._e2e.percentile(now, 0.99, policy.min_samples),
            latency_samples=self._ttft.count(now),
            queue_wait_ms=None if fit is None else fit[1],
            queue_wait_slope_ms_per_min=None if fit is None else fit[0] * 60.0,
            request_rate=self._arrivals.rate(now, policy.surge_buckets),
            baseline_rate=self._arrivals.baseline(
                now, policy.surge_buckets, policy.baseline_buckets, policy.baseline_min_s
            ),
        )

    def latency_values(self, now: float) -> tuple[list[float], list[float]]:
        """The TTFT and end-to-end samples in the window, for a router's report to the leader."""
        return self._ttft.values(now), self._e2e.values(now)

    def _queue_growing(self, signals: PoolSignals) -> bool:
        policy = self.policy
        return (
            signals.queue_wait_slope_ms_per_min is not None
            and signals.queue_wait_slope_ms_per_min >= policy.queue_growth_ms_per_min
            and signals.queue_wait_ms is not None
            and signals.queue_wait_ms >= policy.queue_wait_floor_ms
        )

    def _pressure(self, signals: PoolSignals) -> list[str]:
        policy = self.policy
        reasons = []
        limit = policy.scale_out_at * policy.target_p99_ttft_ms
        if signals.p99_ttft_ms is not None and signals.p99_ttft_ms >= limit:
            reasons.append(
                f"p99 TTFT {signals.p99_ttft_ms:.0f} ms >= {limit:.0f} ms "
                f"({policy.scale_out_at:.0%} of {policy.target_p99_ttft_ms:.0f} ms)"
            )
        if policy.target_p99_e2e_ms is not None and signals.p99_e2e_ms is not None:
            limit = policy.scale_out_at * policy.target_p99_e2e_ms
            if signals.p99_e2e_ms >= limit:
                reasons.append(f"p99 e2e {signals.p99_e2e_ms:.0f} ms >= {limit:.0f} ms")
        if self._queue_growing(signals):
            reasons.append(
                f"queue wait growing {signals.queue_wait_slope_ms_per_min:.0f} ms/min "
                f"(now {signals.queue_wait_ms:.0f} ms)"
            )
        return reasons

    def _surge_ratio(self, now: float, signals: PoolSignals) -> float | None:
        """recent rate / baseline when this is a surge worth acting on, else None."""
        policy = self.policy
        if signals.baseline_rate is None or now - self._last_surge < policy.surge_cooldown_s:
            return None
        if signals.request_rate < policy.surge_min_rate_per_s:
            return None
        if signals.request_rate < policy.surge_factor * signals.baseline_rate:
            return None
        return math.inf if signals.baseline_rate == 0 else signals.request_rate / signals.baseline_rate

    def _calm(self, signals: PoolSignals) -> bool:
        # Too few requests for a p99 means the pool is not busy: that counts as calm.
        latency_calm = signals.p99_ttft_ms is None or signals.p99_ttft_ms < self.policy.calm_p99_ttft_ms
        return latency_calm and not self._queue_growing(signals)

    def standby_target(self, now: float) -> tuple[int, str]:
        active = [w for w in self.prewarm if w.active_at(now)]
        if not active:
            return self.policy.standby_replicas, ""
        window = max(active, key=lambda w: w.replicas)
        return max(window.replicas, self.policy.standby_replicas), f"prewarm {window.describe()}"

    # -- decision -------------------------------------------------------------------------

    def decide(self, now: float, current: Replicas, signals: PoolSignals | None = None) -> ScaleDecision:
        """The decision at `now`; call once per tick (it advances cooldowns and the calm timer).
        `signals` replaces this pool's own windows: the elected leader passes what it merged
        from every router's report."""
        policy = self.policy
        if self._started is None:
            self._started = now
            self._arrivals.mark(now)
        if signals is None:
            signals = self.signals(now)
        pressure = self._pressure(signals)
        surge = self._surge_ratio(now, signals)
        if self._calm(signals) and not pressure:
            if self._calm_since is None:
                self._calm_since = now
        else:
            self._calm_since = None
        standby_want, standby_reason = self.standby_target(now)

        def result(action: Action, serving: int, reason: str, promote: int = 0) -> ScaleDecision:
            standby = max(0, min(standby_want, policy.max_replicas - serving))
            if standby_reason and standby:
                reason = f"{reason}; {standby_reason}"
            return ScaleDecision(self.name, now, action, serving, standby, promote, current, reason, signals)

        serving = current.serving
        if serving < policy.min_replicas:
            self._changed(now, out=True)
            return result(Action.SCALE_OUT, policy.min_replicas, f"below min_replicas {policy.min_replicas}")
        if serving > policy.max_replicas:
            self._changed(now, out=False)
            return result(Action.SCALE_IN, policy.max_replicas, f"above max_replicas {policy.max_replicas}")

        surge_text = (
            ""
            if surge is None
            else (f"surge: {signals.request_rate:.1f} req/s vs baseline {signals.baseline_rate:.1f} req/s")
        )
        if surge is not None and current.standby > 0 and serving < policy.max_replicas:
            # Enough standbys to carry the extra traffic at the current per-replica load.
            wanted = current.standby if math.isinf(surge) else max(1, math.ceil(serving * (surge - 1)))
            promote = min(current.standby, wanted, policy.max_replicas - serving)
            self._last_surge = now
            self._changed(now, out=True)
            return result(
                Action.PROMOTE_STANDBY,
                serving + promote,
                f"{surge_text}; promote {promote} warm standby",
                promote=promote,
            )

        reasons = pressure + ([surge_text] if surge is not None else [])
        if reasons:
            text = "; ".join(reasons)
            if serving >= policy.max_replicas:
                return result(Action.HOLD, serving, f"{text}; at max_replicas {policy.max_replicas}")
            wait = self._last_scale_out + policy.scale_out_cooldown_s - now
            if wait > 0:
                return result(Action.HOLD, serving, f"{text}; scale-out cooldown, {wait:.0f}s left")
            step = max(1, math.ceil(serving * policy.scale_out_step_ratio))
            if surge is not None:
                self._last_surge = now
            self._changed(now, out=True)
            return result(Action.SCALE_OUT, min(policy.max_replicas, serving + step), text)

        if self._calm_since is not None and serving > policy.min_replicas:
            calm_for = now - self._calm_since
            if calm_for >= policy.calm_for_s:
                wait = self._last_change + policy.scale_in_cooldown_s - now
                if wait > 0:
                    return result(Action.HOLD, serving, f"calm; scale-in cooldown, {wait:.0f}s left")
                self._changed(now, out=False)
                # Calm at N replicas says little about N-1: prove it again at the new size.
                self._calm_since = now
                return result(Action.SCALE_IN, serving - 1, f"calm for {calm_for:.0f}s")
            return result(Action.HOLD, serving, f"calm for {calm_for:.0f}s of {policy.calm_for_s:.0f}s")
        return result(Action.HOLD, serving, "within target")

    def _changed(self, now: float, out: bool) -> None:
        self._last_change = now
        self._calm_since = None
        if out:
            self._last_scale_out = now


class Autoscaler:
    """Every pool of one `AutoscalerConfig`."""

    def __init__(self, config: AutoscalerConfig) -> None:
        self.config = config
        self.pools = {name: PoolAutoscaler(name, policy, config.prewarm) for name, policy in config.pools.items()}

    def pool(self, name: str) -> PoolAutoscaler:
        try:
            return self.pools[name]
        except KeyError:
            raise KeyError(f"unknown pool {name!r}; known: {sorted(self.pools)}") from None

    def decide(self, now: float, current: Mapping[str, Replicas]) -> dict[str, ScaleDecision]:
        """A decision for every pool; `current` must report every pool."""
        missing = set(self.pools) - set(current)
        if missing:
            raise ValueError(f"no replica counts for pools {sorted(missing)}")
        return {name: pool.decide(now, current[name]) for name, pool in self.pools.items()}
