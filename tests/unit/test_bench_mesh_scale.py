"""bench/mesh_scale.py's arithmetic: one row from a point loaded several times."""

from bench.mesh_scale import median_row


def run(cpu: float, p50: float, p99: float, tokens_per_s: float) -> dict:
    return {
        "workers": 4,
        "streams": 100,
        "routers": 1,
        "router_cpu_s_per_1k_tokens": cpu,
        "added_ttft_p50_ms": p50,
        "added_ttft_p99_ms": p99,
        "tokens_per_s": tokens_per_s,
        "cpu_busy": 0.9,
    }


def test_each_judged_number_is_its_own_median_and_the_rest_is_the_median_runs():
    runs = [run(0.40, 5.0, 90.0, 3000), run(0.25, 9.0, 30.0, 3600), run(0.30, 1.0, 60.0, 3300)]
    row = median_row(runs)
    assert row["router_cpu_s_per_1k_tokens"] == 0.30
    assert row["added_ttft_p50_ms"] == 5.0
    assert row["added_ttft_p99_ms"] == 60.0
    assert row["tokens_per_s"] == 3300  # from the run whose CPU per token is the median
    assert [r["router_cpu_s_per_1k_tokens"] for r in row["runs"]] == [0.40, 0.25, 0.30]
    assert runs[2]["added_ttft_p50_ms"] == 1.0  # the runs themselves are left as measured


def test_a_point_measured_once_is_its_run():
    only = run(0.3, 2.0, 4.0, 3000)
    assert median_row([only]) == only
    assert "runs" not in median_row([only])
