"""A short seeded fuzz run against a live local mesh (bench.fuzz): every RPC gets malformed,
random and mutated frames plus one oversized frame; no service crashes or restarts, every
call ends with a defined status, and the canary tenant's session, KV and answers are intact.
The full run (10,000 cases per RPC) is `python -m bench.fuzz`."""

from __future__ import annotations

import json

import pytest

from bench.fuzz import run_benchmark

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def test_a_seeded_fuzz_run_crashes_nothing_and_leaves_the_canary_intact(tmp_path):
    out = tmp_path / "fuzz.json"
    assert run_benchmark(cases=150, concurrency=16, seed=20261201, out=out) == 0
    result = json.loads(out.read_text())
    assert result["crashes"] == 0 and result["undefined_statuses"] == 0
    assert result["canary_answers_equal"] and result["canary_blocks_after"] >= result["canary_blocks_before"] > 0
    assert len(result["rpcs"]) == 13 and all(r["cases"] == 151 for r in result["rpcs"].values())
    # The cases reached the handlers' own checks, not only the frame parser.
    codes = set().union(*(r["codes"] for r in result["rpcs"].values()))
    assert {"OK", "INVALID_ARGUMENT", "UNAUTHENTICATED", "RESOURCE_EXHAUSTED"} <= codes
