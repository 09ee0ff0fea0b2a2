"""The autoscaler's run-time logic without a network: router reports and their merge, role
plans, and the leader's loop over several routers' windows on a simulated clock."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from services.common.membership import WorkerRecord
from services.router.autoscale.decision import Action, PoolAutoscaler, PoolSignals, Replicas, ScaleDecision
from services.router.autoscale.executor import PoolMembers, RoleExecutor, RolePlan, plan_roles
from services.common.config import EtcdConfig
from services.router.autoscale.observer import RouterObservations, pool_of_model
from services.router.autoscale.policy import AutoscalerConfig, PoolPolicy
from services.router.autoscale.report import (
    PoolReport,
    RouterReport,
    bucket_of,
    bucket_value,
    histogram,
    merge,
    merged_percentile,
)
from services.router.metrics import RouterMetrics, SchedulerMetrics

T0 = 1_772_431_200.0  # Monday 2 March 2026, 06:00 UTC


def nearest_rank(values: list[float], quantile: float) -> float:
    ordered = sorted(values)
    return ordered[max(1, math.ceil(quantile * len(ordered))) - 1]


# -- histograms and reports ----------------------------------------------------------------


@pytest.mark.parametrize("ms", [0.5, 3.2, 47.0, 719.0, 721.0, 800.0, 12_345.0])
def test_a_bucket_reads_back_within_two_percent(ms):
    assert bucket_value(bucket_of(ms)) == pytest.approx(ms, rel=0.021)


def test_the_merged_p99_of_two_routers_is_the_p99_of_all_their_requests():
    rng = random.Random(7)
    calm = [rng.uniform(50, 300) for _ in range(900)]
    # One router sees the slow tail (its share of a struggling pool): it must show in the pool's p99.
    tail = [rng.uniform(50, 300) for _ in range(80)] + [rng.uniform(900, 1500) for _ in range(20)]
    merged = merged_percentile([histogram(calm), histogram(tail)], 0.99, min_samples=20)
    assert merged == pytest.approx(nearest_rank(calm + tail, 0.99), rel=0.021)
    assert merged > 720  # the pool breaches 90 % of 800 ms although one router alone looks calm
    assert merged_percentile([histogram(calm)], 0.99, 20) < 400


def test_too_few_samples_give_no_p99():
    assert merged_percentile([histogram([100.0] * 5), histogram([900.0] * 5)], 0.99, min_samples=20) is None


def test_rates_add_up_and_a_router_without_baseline_is_left_out_of_the_surge_comparison():
    old_a = PoolReport(request_rate=4.0, baseline_rate=2.0)
    old_b = PoolReport(request_rate=3.0, baseline_rate=1.0)
    new = PoolReport(request_rate=30.0, baseline_rate=None)
    signals = merge([old_a, old_b, new], min_samples=20)
    assert signals.request_rate == 7.0 and signals.baseline_rate == 3.0
    only_new = merge([new], min_samples=20)
    assert only_new.request_rate == 30.0 and only_new.baseline_rate is None


def test_the_worst_queue_wait_among_routers_stands_for_the_pool():
    signals = merge(
        [
            PoolReport(queue_wait_ms=20.0, queue_wait_slope_ms_per_min=5.0),
            PoolReport(queue_wait_ms=400.0, queue_wait_slope_ms_per_min=600.0),
            PoolReport(),
        ],
        min_samples=1,
    )
    assert (signals.queue_wait_ms, signals.queue_wait_slope_ms_per_min) == (400.0, 600.0)


def test_a_router_report_survives_json():
    report = RouterReport(
        "router-a",
        T0,
        {
            "primary": PoolReport(
                ttft=histogram([120.0, 130.0, 900.0]),
                e2e=histogram([400.0]),
                queue_wait_ms=12.5,
                queue_wait_slope_ms_per_min=None,
                request_rate=3.5,
                baseline_rate=1.0,
            )
        },
    )
    assert RouterReport.from_json(report.to_json()) == report


# -- observations ----------------------------------------------------------------------------


def worker(
    worker_id: str,
    pool: str = "primary",
    model: str = "tiny",
    started_at: float = 0.0,
    standby: bool = False,
    draining: bool = False,
) -> WorkerRecord:
    return WorkerRecord(
        id=worker_id,
        address="127.0.0.1:1",
        model=model,
        model_version="v1",
        pool=pool,
        started_at=started_at,
        standby=standby,
        draining=draining,
        healthy=not standby,
    )


def test_a_models_pool_comes_from_its_workers():
    workers = {w.id: w for w in (worker("a"), worker("b"), worker("c", pool="light", model="tiny-light"))}
    assert pool_of_model(workers, "tiny") == "primary"
    assert pool_of_model(workers, "tiny-light") == "light"
    assert pool_of_model(workers, "unknown") is None


def test_requests_of_an_unmanaged_or_unserved_model_are_not_counted():
    now = [T0]
    config = AutoscalerConfig({"primary": PoolPolicy(min_samples=1)})
    observations = RouterObservations(config, {"tiny": "primary", "other": "light"}.get, clock=lambda: now[0])
    for model in ("tiny", "other", "nobody"):
        observations.ttft(model, 100.0)
    report = observations.report("r1")
    assert list(report.pools) == ["primary"]
    assert sum(report.pools["primary"].ttft.values()) == 1


def test_queue_waits_reach_a_listener_and_the_histogram_alike():
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("test")
    telemetry = SimpleNamespace(meter=meter, latency_histogram=lambda name, _description: meter.create_histogram(name))
    metrics = RouterMetrics(telemetry)
    heard: list[tuple[str, float]] = []
    metrics.add_queue_wait_listener(lambda pool, ms: heard.append((pool, ms)))
    SchedulerMetrics(metrics).queue_wait("tiny", "A", 0.25)
    assert heard == [("tiny", 250.0)]
    (point,) = [
        point
        for resource in reader.get_metrics_data().resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
        if metric.name == "ballast_router_queue_wait"
        for point in metric.data.data_points
        if point.attributes == {"pool": "tiny", "tier": "A"}
    ]
    assert point.sum == 250.0


# -- role plans --------------------------------------------------------------------------------

SIGNALS = PoolSignals(None, None, 0, None, None, 0.0, None)


def decision(serving: int, standby: int = 0) -> ScaleDecision:
    return ScaleDecision("primary", T0, Action.HOLD, serving, standby, 0, Replicas(0), "test", SIGNALS)


def members(serving: int, standby: int = 0, starting_serving: int = 0, starting_standby: int = 0) -> PoolMembers:
    return PoolMembers(
        "primary",
        serving=[worker(f"s{i}", started_at=i) for i in range(serving)],
        standby=[worker(f"w{i}", started_at=i, standby=True) for i in range(standby)],
        starting_serving=starting_serving,
        starting_standby=starting_standby,
    )


@pytest.mark.parametrize(
    "want, have, plan",
    [
        # Serving replicas missing: warm standbys first, a cold start for the rest.
        (decision(3), members(1, standby=1), RolePlan(promote=("w0",), start_serving=1)),
        # The standby it promotes is replaced when standbys are wanted too.
        (decision(2, standby=1), members(1, standby=1), RolePlan(promote=("w0",), start_standby=1)),
        # A replica already starting counts: nothing more to start.
        (decision(2), members(1, starting_serving=1), RolePlan()),
        # Too many serving and a standby wanted: the newest serving one is demoted, not stopped.
        (decision(1, standby=1), members(3), RolePlan(demote=("s2",), stop_serving=1)),
        # Too many standbys: stop the extra.
        (decision(1, standby=0), members(1, standby=2), RolePlan(stop_standby=2)),
        # Prewarm: hold warm capacity next to the serving replicas.
        (decision(2, standby=2), members(2), RolePlan(start_standby=2)),
        (decision(2, standby=1), members(2, standby=1), RolePlan()),
    ],
)
def test_role_plans(want, have, plan):
    assert plan_roles(want, have) == plan


def test_a_requested_role_counts_until_the_record_agrees_or_it_is_too_old():
    clock = [100.0]
    executor = RoleExecutor(EtcdConfig(), clock=lambda: clock[0])
    standby = worker("w1", standby=True)
    executor._requested["w1"] = ("serving", clock[0])
    assert [w.id for w in executor.registered("primary", {"w1": standby}).serving] == ["w1"]
    clock[0] += 30.0  # the worker never switched: believe its record again
    assert [w.id for w in executor.registered("primary", {"w1": standby}).standby] == ["w1"]
    assert "w1" not in executor._requested
    draining = worker("w2", draining=True)
    other_pool = worker("w3", pool="light")
    assert executor.registered("primary", {"w2": draining, "w3": other_pool}).replicas() == Replicas(0)


# -- the leader's loop over two routers, on a simulated clock ---------------------------------------


@dataclass
class Cluster:
    """Two routers' windows, a leader merging their reports every tick, and a pool whose
    replicas follow the decisions (as an executor would make them)."""

    now: float = T0
    replicas: Replicas = Replicas(1)

    def __post_init__(self) -> None:
        policy = PoolPolicy(min_replicas=1, max_replicas=4, scale_out_cooldown_s=60, scale_in_cooldown_s=120)
        config = AutoscalerConfig({"primary": policy})
        self.routers = [RouterObservations(config, lambda _model: "primary", clock=lambda: self.now) for _ in range(2)]
        self.leader = PoolAutoscaler("primary", policy)
        self.decisions: list[ScaleDecision] = []

    def run(self, seconds: int, ttft_ms, rps: int = 10, tick_s: int = 5) -> None:
        rng = random.Random(int(self.now))
        for second in range(seconds):
            self.now += 1.0
            for i in range(rps):
                router = self.routers[i % 2]
                router.arrival("tiny")
                router.ttft("tiny", ttft_ms(self.replicas) * rng.uniform(0.8, 1.0))
            if second % tick_s == tick_s - 1:
                reports = [r.report(f"r{n}").pools["primary"] for n, r in enumerate(self.routers)]
                decision = self.leader.decide(self.now, self.replicas, merge(reports, self.leader.policy.min_samples))
                self.decisions.append(decision)
                self.replicas = Replicas(decision.serving, decision.standby)


def test_a_breach_seen_across_routers_scales_out_and_only_a_long_calm_scales_in():
    cluster = Cluster()
    # 900 ms p99 on one replica, well under the target on two.
    load = lambda replicas: 900.0 if replicas.serving < 2 else 300.0  # noqa: E731
    cluster.run(60, load)
    outs = [d for d in cluster.decisions if d.action is Action.SCALE_OUT]
    assert len(outs) == 1 and cluster.replicas.serving == 2
    assert outs[0].signals.p99_ttft_ms >= 720

    # Calm at 300 ms: nothing happens for ten minutes.
    calm_start = cluster.now
    cluster.run(590, lambda replicas: 300.0)
    assert cluster.replicas.serving == 2
    assert not [d for d in cluster.decisions if d.action is Action.SCALE_IN]
    cluster.run(120, lambda replicas: 300.0)
    scale_in = [d for d in cluster.decisions if d.action is Action.SCALE_IN]
    assert len(scale_in) == 1 and cluster.replicas.serving == 1
    assert scale_in[0].at - calm_start >= 600
