"""Unit tests: the report's check of whether a result's commit ran the code checked out now.

A reformatted module (layout, comments, docstring wrapping) is the same code; any change in
what runs is not. Checked on the parsed form directly and through git in a scratch repository.
"""

from __future__ import annotations

import subprocess

from bench.report import _python_meaning, measured_code_changed_since

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
