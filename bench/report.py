"""bench/results/REPORT.md, generated from the result files (never typed by hand).

    python -m bench.report

One table of every goal: the benchmark, the goal, the value (the median where it was
repeated, with its range), the target, met or missed, and the commit the result ran on (with
"+dirty" when the code had uncommitted changes), so a stale or unjudged result shows as such.
Then, per benchmark, a chart of its goals (PNG beside the report, drawn with matplotlib where
it is installed): each goal's value and range against its target.
"""

from __future__ import annotations

import ast
import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable, Sequence

from bench.common import RESULTS_DIR, commit

# The code a benchmark measures (the paths bench.common.commit() judges a dirty tree by); results
# written since, and this report drawn from them, are not part of it. The check lives here rather
# than in bench/common.py because that module is itself measured code: changing it would mark every
# result as older.
MEASURED_CODE = ("services", "bench", "protos", ":!bench/results", ":!bench/report.py")
# What every benchmark runs besides its own modules: a result is older code when any of it, or
# any bench module the benchmark runs (`benchmark_code`), changed since its commit.
SHARED_CODE = (
    "services",
    "protos",
    "deploy/sim",  # the simulated engine's timing profiles
    "bench/__init__.py",
    "bench/common.py",
    "bench/goals.py",
    "bench/fixtures",
)
BENCH = Path(__file__).resolve().parent
# A bench module started by name (`python -m bench.plain_server`) rather than imported.
_STARTED_BY_NAME = re.compile(r"^bench(\.[A-Za-z_]\w*)+$")


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _python_meaning(source: str) -> str | None:
    """The parsed form of a Python module, docstrings with their whitespace collapsed: equal for
    two sources that differ only in layout, comments or docstring wrapping (what a formatter
    changes), different for any change in what runs. None where it does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                first.value.value = " ".join(first.value.value.split())
    return ast.dump(tree)


def _same_python(sha: str, top: str, path: str) -> bool:
    """Whether `path` (a .py file, relative to the work tree's top `top`) means the same at
    commit `sha` and in the checkout."""
    old = _git("show", f"{sha}:{path}")
    try:
        new = Path(top, path).read_text()
    except OSError:
        return False
    if old is None:
        return False
    old_meaning = _python_meaning(old)
    return old_meaning is not None and old_meaning == _python_meaning(new)


def _module_files(module: str, whole_package: bool = False) -> list[Path]:
    """The files of bench module `module` ("bench.soak.run"): a package's `__init__` and
    `__main__` (what importing or running it executes; what they import is followed apart),
    or with `whole_package` all of it; [] when there is no such module."""
    path = BENCH.parent.joinpath(*module.split("."))
    if path.is_dir():
        if whole_package:
            return sorted(path.rglob("*.py"))
        return [file for file in (path / "__init__.py", path / "__main__.py") if file.is_file()]
    file = path.with_suffix(".py")
    return [file] if file.is_file() else []


def _bench_modules_named_in(file: Path) -> set[str]:
    """The bench modules `file` imports (absolute or relative) or starts by name."""
    tree = ast.parse(file.read_text())
    package = ".".join(file.relative_to(BENCH.parent).with_suffix("").parts[:-1])
    named: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            named.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            named.add(base)
            # `from bench import overhead` names a module, `from bench.x import f` a function.
            named.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _STARTED_BY_NAME.match(node.value):
            named.add(node.value)
    # Importing bench.soak.run runs bench.soak's (and bench's) __init__ first.
    parents = {".".join(name.split(".")[:end]) for name in named for end in range(1, name.count(".") + 1)}
    return {name for name in named | parents if name == "bench" or name.startswith("bench.")}


def benchmark_code(module: str) -> list[str] | None:
    """The files under bench/ that benchmark module `module` ("overhead") runs: its own and,
    transitively, every bench module they import or start by name. None when one of them does
    not parse (then every bench file counts)."""
    todo = _module_files(f"bench.{module}", whole_package=True)
    seen: set[Path] = set()
    while todo:
        file = todo.pop()
        if file in seen:
            continue
        seen.add(file)
        try:
            named = _bench_modules_named_in(file)
        except (OSError, SyntaxError, ValueError):
            return None
        for name in named:
            todo.extend(_module_files(name))
    return sorted(str(file.relative_to(BENCH.parent)) for file in seen) or None


def measured_paths(name: str) -> Sequence[str]:
    """The code result `name` measured, as git paths: the shared code and the files of the
    benchmark that writes it (bench.all's table; else the bench module of that name, else the
    benchmark whose name starts it: mesh_scale_128 is mesh_scale's). Every bench file where
    the benchmark is not known."""
    from bench.all import BENCHMARKS

    modules = {benchmark.name: benchmark.module or benchmark.name for benchmark in BENCHMARKS}
    module = modules.get(name)
    if module is None and _module_files(f"bench.{name}"):
        module = name
    if module is None:
        prefixes = [known for known in modules if name.startswith(known + "_")]
        module = modules[max(prefixes, key=len)] if prefixes else None
    files = benchmark_code(module) if module is not None else None
    return MEASURED_CODE if files is None else (*SHARED_CODE, *files)


def measured_code_changed_since(sha: str, paths: Sequence[str] = MEASURED_CODE) -> bool | None:
    """Whether the checkout's measured code (`paths`) differs from commit `sha` (None: unknown).

    A later commit that only adds results or docs leaves a result current, and so does one that
    only reformats Python (same parsed code); one that changes what services/, protos/ or a
    benchmark runs makes it a result of older code."""
    if not sha or sha == "unknown":
        return None
    # An unknown commit makes git fail, which reads as unknown too.
    changed = _git("diff", "--name-only", sha, "--", *paths)
    if changed is None:
        return None
    # Paths from git are relative to the top of the work tree.
    top = _git("rev-parse", "--show-toplevel")
    return any(
        not (path.endswith(".py") and top is not None and _same_python(sha, top, path)) for path in changed.splitlines()
    )


REPORT = "REPORT.md"


def _load(results_dir: Path) -> dict[str, dict]:
    found = {}
    for path in sorted(results_dir.glob("*.json")):
        try:
            found[path.stem] = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            found[path.stem] = {"unreadable": str(exc)}
    return found


def _stamp(result: dict) -> str:
    stamp = result.get("commit")
    if not isinstance(stamp, dict):
        return "unknown"
    return stamp.get("sha", "unknown")[:10] + ("+dirty" if stamp.get("dirty") else "")


def _number(value: float, unit: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:.4g}{unit}"


ChangedSince = Callable[[str, Sequence[str]], bool | None]


def _code(name: str, result: dict, changed_since: ChangedSince) -> str:
    """Whether result `name` measured the code checked out now."""
    stamp = result.get("commit")
    if not isinstance(stamp, dict) or not stamp.get("sha"):
        return "unknown"
    if stamp.get("dirty"):
        return "uncommitted"
    changed = changed_since(stamp["sha"], measured_paths(name))
    return "unknown" if changed is None else ("**older code**" if changed else "current")


def _goal_row(name: str, result: dict, goal: dict, code: str) -> str:
    value = _number(goal["value"], goal.get("unit", ""))
    if goal.get("runs", 1) > 1:
        value += f" ({_number(goal['min'])}..{_number(goal['max'])}, {goal['runs']} runs)"
    sign = "<=" if goal["better"] == "lower" else ">="
    verdict = "met" if goal["met"] else "**missed**"
    return (
        f"| {name} | {goal['name']} | {value} | {sign} {_number(goal['target'], goal.get('unit', ''))} | "
        f"{verdict} | {_stamp(result)} | {code} | {result.get('written_at', 'unknown')} |"
    )


def _chart(name: str, goals: list[dict], out_dir: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    # Counts that must stay at zero say all they have to say in the table.
    shown = [g for g in goals if not math.isnan(g["value"]) and g["target"] != 0]
    if not shown:
        return None
    fig, axes = plt.subplots(len(shown), 1, figsize=(6, 1.1 * len(shown) + 0.6), squeeze=False)
    for ax, goal in zip(axes[:, 0], shown):
        low, high = goal["value"] - goal["min"], goal["max"] - goal["value"]
        ax.barh([0], [goal["value"]], xerr=[[low], [high]], color="tab:green" if goal["met"] else "tab:red")
        ax.axvline(goal["target"], color="black", linestyle="--", label="target")
        ax.set_yticks([])
        ax.set_title(
            f"{goal['name']}: {goal['value']:.4g}{goal.get('unit', '')} ({'met' if goal['met'] else 'missed'})",
            fontsize=8,
        )
        right = max(goal["max"], goal["target"]) * 1.15 if max(goal["max"], goal["target"]) > 0 else 1
        ax.set_xlim(min(0, goal["min"]), right)
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    path = out_dir / f"{name}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path.name


def _have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def render(results: dict[str, dict], out_dir: Path, changed_since: ChangedSince = measured_code_changed_since) -> str:
    head = commit()
    lines = [
        "# Benchmark report",
        "",
        "Generated by `python -m bench.report` from the JSON files in this folder; do not edit.",
        f"Checked-out code when generated: {head['sha'][:10]}{'+dirty' if head['dirty'] else ''}. "
        "The code column says whether a result measured the code checked out now (`current`: its "
        "commit differs from it at most in results, docs and the layout of its Python) or **older "
        "code** (services/, protos/, the shared bench modules or the benchmark's own changed since).",
        "",
        "| benchmark | goal | value | target | verdict | commit | code | written |",
        "|---|---|---|---|---|---|---|---|",
    ]
    unjudged = []
    for name, result in results.items():
        goals = result.get("goals")
        if not isinstance(goals, list) or not goals:
            unjudged.append(name)
            continue
        code = _code(name, result, changed_since)
        lines.extend(_goal_row(name, result, goal, code) for goal in goals)
    if unjudged:
        lines += [
            "",
            "Results without goals judged in code (older format, or a benchmark that "
            "measures without a goal): "
            + ", ".join(f"`{n}` ({_stamp(results[n])}, {_code(n, results[n], changed_since)})" for n in unjudged)
            + ".",
        ]
    charts = []
    for name, result in results.items():
        goals = result.get("goals")
        if isinstance(goals, list) and goals:
            chart = _chart(name, goals, out_dir)
            if chart:
                charts.append((name, chart))
    if charts:
        lines += [
            "",
            "## Charts",
            "",
            "Each bar is the value (the median of repeated runs, the whisker its "
            "range); the dashed line is the target.",
        ]
        for name, chart in charts:
            lines += ["", f"### {name}", "", f"![{name}]({chart})"]
    elif not _have_matplotlib():
        lines += ["", "No charts: matplotlib is not installed (it comes with the `dev` extra)."]
    return "\n".join(lines) + "\n"


def write_report(results_dir: Path = RESULTS_DIR) -> Path:
    path = results_dir / REPORT
    path.write_text(render(_load(results_dir), results_dir))
    return path


def main(argv: list[str] | None = None) -> int:
    del argv  # no options
    print(f"wrote {write_report()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
