"""The soak's chart: latency over time in both phases, with the faults marked, drawn from
bench/results/soak.json alone (so it can be drawn again from any result).

    python -m bench.soak.chart [bench/results/soak.json]

One panel per phase, on the same time and latency axes: the end-to-end p99 of the requests
started in each 5 s (all tiers, and S alone), failures per 5 s as crosses at the top, the
surge shaded and every fault a vertical line named at the top. Written beside the result as
`soak_latency.png` (`soak.png` is the report's chart of the goals).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path


def chart_path(result_path: Path) -> Path:
    return result_path.with_name(result_path.stem + "_latency.png")


def _finite(points):
    return [(t, v) for t, v in points if v is not None and not math.isnan(v)]


def draw(result: dict, out: Path) -> Path | None:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = (("baseline", f"plain {result['engine']} servers"), ("ballast", "Ballast"))
    values = [b["p99_ms"] for key, _ in phases for b in result["timeline"][key]]
    top = max([v for v in values if not math.isnan(v)] or [1.0]) * 1.5
    figure, axes = plt.subplots(2, 1, figsize=(12, 7), sharex=True, sharey=True)
    for axis, (key, title) in zip(axes, phases):
        buckets = result["timeline"][key]
        for field, label, colour in (("p99_ms", "p99, all tiers", "black"), ("s_p99_ms", "p99, S tier", "tab:red")):
            line = _finite([(b["t"] + 2.5, b[field]) for b in buckets])
            if line:
                axis.plot(*zip(*line), color=colour, linewidth=1, label=label)
        failed = [b["t"] + 2.5 for b in buckets if b["errors"]]
        if failed:
            axis.scatter(failed, [top * 0.8] * len(failed), marker="x", color="black", s=16, label="failures")
        surge = result["surge"]
        axis.axvspan(surge["start_s"], surge["end_s"], color="gold", alpha=0.15, label="3x surge")
        for fault in result["fault_log"][key]:
            if fault["kind"] == "surge":
                continue
            axis.axvline(fault["injected_at"], color="purple", linewidth=0.8, linestyle="--")
            axis.text(
                fault["injected_at"],
                top * 0.6,
                fault["kind"].replace("_", " "),
                rotation=90,
                fontsize=7,
                va="top",
                ha="right",
                color="purple",
            )
        row = result[key]
        axis.set_title(
            f"{title}: p99 {row['p99_ms']:.0f} ms, errors {row['error_rate'] * 100:.2f} %, "
            f"sessions interrupted {row['session_interruption_rate'] * 100:.1f} %",
            fontsize=10,
        )
        axis.set_ylabel("end to end, ms (per 5 s)")
        axis.set_yscale("log")
        axis.set_ylim(top=top)
    axes[0].legend(loc="lower left", fontsize=7, ncol=4)
    axes[1].set_xlabel("seconds into the soak")
    figure.suptitle(
        f"Chaos soak, {result['engine']} engine, {result['workers']} workers, commit {result['commit']['sha'][:10]}",
        fontsize=11,
    )
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out


def main(argv: list[str] | None = None) -> int:
    path = Path((argv or sys.argv[1:] or ["bench/results/soak.json"])[0])
    print(f"wrote {draw(json.loads(path.read_text()), chart_path(path))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
