"""The soak's chart: end-to-end latency over time in both phases, with the faults marked.

One panel per phase, on the same time and latency axes: each request as a dot at its start
(S-tier requests in their own colour, failures as crosses at the top), the p99 per 5 s as a
line, the surge shaded and every fault a vertical line named at the top.
"""

from __future__ import annotations

from pathlib import Path

from bench.soak_table import RequestSample

COLOURS = {"S": "tab:red", "A": "tab:orange", "B": "tab:blue"}


def draw(result: dict, baseline: list[RequestSample], ballast: list[RequestSample], out: Path) -> Path | None:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = (("baseline", "plain " + result["engine"] + " servers", baseline), ("ballast", "Ballast", ballast))
    top = max([s.e2e_ms for _, _, samples in phases for s in samples if s.ok] or [1.0]) * 1.15
    figure, axes = plt.subplots(2, 1, figsize=(12, 7), sharex=True, sharey=True)
    for axis, (key, title, samples) in zip(axes, phases):
        for tier, colour in COLOURS.items():
            points = [(s.start, s.e2e_ms) for s in samples if s.ok and s.tier == tier]
            if points:
                axis.scatter(*zip(*points), s=3, alpha=0.35, color=colour, label=f"{tier} request")
        failed = [s.start for s in samples if not s.ok]
        if failed:
            axis.scatter(failed, [top * 0.97] * len(failed), marker="x", color="black", s=14, label="failed")
        line = [(b["t"] + 2.5, b["p99_ms"]) for b in result["timeline"][key] if b["p99_ms"] == b["p99_ms"]]
        if line:
            axis.plot(*zip(*line), color="black", linewidth=1, label="p99 per 5 s")
        surge = result["surge"]
        axis.axvspan(surge["start_s"], surge["end_s"], color="gold", alpha=0.15, label="3x surge")
        for fault in result["fault_log"][key]:
            if fault["kind"] == "surge":
                continue
            axis.axvline(fault["injected_at"], color="purple", linewidth=0.8, linestyle="--")
            axis.text(fault["injected_at"], top * 0.9, fault["kind"].replace("_", " "), rotation=90, fontsize=7,
                      va="top", ha="right", color="purple")
        row = result[key]
        axis.set_title(f"{title}: p99 {row['p99_ms']:.0f} ms, errors {row['error_rate'] * 100:.2f} %, "
                       f"sessions interrupted {row['session_interruption_rate'] * 100:.1f} %", fontsize=10)
        axis.set_ylabel("end to end, ms")
        axis.set_yscale("log")
        axis.set_ylim(top=top)
    axes[0].legend(loc="upper left", fontsize=7, ncol=4)
    axes[1].set_xlabel("seconds into the soak")
    figure.suptitle(f"Chaos soak, {result['engine']} engine, {result['workers']} workers, "
                    f"commit {result['commit']['sha'][:10]}", fontsize=11)
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out
