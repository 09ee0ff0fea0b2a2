"""Goals judged in code, on the median of repeated runs.

A benchmark states each goal as a `Goal` (the result key it reads, the target, and whether
lower or higher is better) and hands `judge` the measured values: a plain number for a
metric measured once (counts, exactness), or every repetition's value for a metric that is
noisy on a shared machine (tail latencies, throughput). A repeated metric is judged on its
median; its range is reported beside it. The judged goals go into the result file (`goals`,
and `met` when every one is met) and the report (`bench.report`) shows them as they are.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

LOWER = "lower"
HIGHER = "higher"


@dataclass(frozen=True)
class Goal:
    name: str  # what a reader sees: "added TTFT p99 through the router"
    metric: str  # the result key holding the value
    target: float
    better: str  # LOWER: value <= target; HIGHER: value >= target
    unit: str = ""

    def __post_init__(self) -> None:
        if self.better not in (LOWER, HIGHER):
            raise ValueError(f"goal {self.name!r}: better must be {LOWER!r} or {HIGHER!r}")


def summary(values: Sequence[float]) -> dict:
    """Median and range of repeated measurements."""
    finite = [v for v in values if not math.isnan(v)]
    if not finite:
        return {"median": math.nan, "min": math.nan, "max": math.nan, "runs": len(values)}
    return {"median": statistics.median(finite), "min": min(finite), "max": max(finite), "runs": len(values)}


def judge_one(goal: Goal, measured: float | Sequence[float]) -> dict:
    values = [float(v) for v in measured] if isinstance(measured, (list, tuple)) else [float(measured)]
    stats = summary(values)
    value = stats["median"]
    if math.isnan(value):
        met, margin = False, math.nan
    elif goal.better == LOWER:
        met, margin = value <= goal.target, goal.target - value
    else:
        met, margin = value >= goal.target, value - goal.target
    return {
        "name": goal.name,
        "metric": goal.metric,
        "value": value,
        "min": stats["min"],
        "max": stats["max"],
        "runs": stats["runs"],
        "target": goal.target,
        "better": goal.better,
        "unit": goal.unit,
        # margin > 0: met with room to spare; < 0: missed by that much.
        "met": bool(met),
        "margin": margin,
    }


def judge(goals: Iterable[Goal], measured: Mapping[str, float | Sequence[float]]) -> dict:
    """{"goals": [...], "met": every goal met}; a goal whose metric was not measured is missed."""
    judged = [judge_one(goal, measured.get(goal.metric, math.nan)) for goal in goals]
    return {"goals": judged, "met": all(g["met"] for g in judged)}


def print_goals(judged: dict) -> None:
    for goal in judged["goals"]:
        spread = f" (range {goal['min']:.4g}..{goal['max']:.4g} over {goal['runs']} runs)" if goal["runs"] > 1 else ""
        sign = "<=" if goal["better"] == LOWER else ">="
        print(
            f"goal {goal['name']}: {goal['value']:.4g}{goal['unit']}{spread}, target {sign} "
            f"{goal['target']:.4g}{goal['unit']}: {'met' if goal['met'] else 'MISSED'}"
        )
    print("all goals met" if judged["met"] else "a goal was MISSED")
