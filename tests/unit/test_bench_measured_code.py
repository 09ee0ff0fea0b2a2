"""Unit tests: the report's check of whether a result's commit ran the code checked out now.

A reformatted module (layout, comments, docstring wrapping) is the same code; any change in
what runs is not. Checked on the parsed form directly and through git in a scratch repository.
What a result measured is the shared code and its own benchmark's modules: a change to another
benchmark leaves it current.
"""

from __future__ import annotations

import subprocess

from bench.report import MEASURED_CODE, SHARED_CODE, _python_meaning, measured_code_changed_since, measured_paths

ORIGINAL = '''"""A module."""

def f(a, b):
    """Adds
    two numbers."""
    return a + b  # the sum
'''

REFORMATTED = '''"""A module."""


def f(
    a,
    b,
):
    """Adds two numbers."""
    return a + b
'''

CHANGED = ORIGINAL.replace("a + b", "a - b")


def test_layout_comments_and_docstring_wrapping_do_not_change_the_meaning():
    assert _python_meaning(ORIGINAL) == _python_meaning(REFORMATTED)


def test_a_change_in_what_runs_changes_the_meaning():
    assert _python_meaning(ORIGINAL) != _python_meaning(CHANGED)
    assert _python_meaning(ORIGINAL) != _python_meaning(ORIGINAL.replace("A module.", "Another module."))


def test_source_that_does_not_parse_has_no_meaning():
    assert _python_meaning("def f(:\n") is None


def _git(repo, *args):
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)


def _repo_with(tmp_path, source):
    (tmp_path / "services").mkdir()
    (tmp_path / "services" / "m.py").write_text(source)
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "measured")
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()


def test_through_git_a_reformat_leaves_a_result_current_and_a_code_change_does_not(tmp_path, monkeypatch):
    sha = _repo_with(tmp_path, ORIGINAL)
    monkeypatch.chdir(tmp_path)
    assert measured_code_changed_since(sha) is False
    (tmp_path / "services" / "m.py").write_text(REFORMATTED)
    assert measured_code_changed_since(sha) is False
    (tmp_path / "services" / "m.py").write_text(CHANGED)
    assert measured_code_changed_since(sha) is True
    (tmp_path / "services" / "m.py").write_text(ORIGINAL)
    (tmp_path / "services" / "schema.proto").write_text("syntax = 'proto3';\n")
    _git(tmp_path, "add", ".")
    assert measured_code_changed_since(sha) is True  # not Python: any change counts
    assert measured_code_changed_since("0" * 40) is None


def _bench_files(name: str) -> set[str]:
    return {path for path in measured_paths(name) if path not in SHARED_CODE}


def test_a_benchmark_measures_its_own_modules_and_what_they_import_or_start():
    assert _bench_files("overhead") == {"bench/overhead.py", "bench/bare_relay.py"}  # imported
    soak = _bench_files("soak")
    assert "bench/plain_server.py" in soak  # started by name: python -m bench.plain_server
    assert {"bench/soak/run.py", "bench/soak/cpu.py", "bench/soak/faults.py"} <= soak
    assert "bench/tiers.py" not in soak and "bench/overhead.py" not in soak


def test_a_result_written_under_another_name_belongs_to_its_benchmark():
    assert _bench_files("tiers_sim") == _bench_files("tiers")  # bench.all runs tiers --engine sim
    assert _bench_files("mesh_scale_128") == _bench_files("mesh_scale")  # mesh_scale --out
    assert _bench_files("soak_sim_2") == _bench_files("soak")


def test_a_result_of_no_known_benchmark_counts_every_bench_file():
    assert measured_paths("not_a_benchmark") == MEASURED_CODE


def test_through_git_a_change_to_another_benchmark_leaves_a_result_current(tmp_path, monkeypatch):
    _repo_with(tmp_path, ORIGINAL)
    (tmp_path / "bench").mkdir()
    for name in ("a.py", "b.py"):
        (tmp_path / "bench" / name).write_text(ORIGINAL)
    _git(tmp_path, "add", ".")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "benchmarks")
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    monkeypatch.chdir(tmp_path)
    measured_by_a = ("services", "bench/a.py")
    (tmp_path / "bench" / "b.py").write_text(CHANGED)
    assert measured_code_changed_since(sha, measured_by_a) is False
    assert measured_code_changed_since(sha) is True  # every bench file: b's change counts
    (tmp_path / "bench" / "a.py").write_text(CHANGED)
    assert measured_code_changed_since(sha, measured_by_a) is True
