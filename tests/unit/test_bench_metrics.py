"""The benchmarks' reading of a Prometheus text page: samples summed by name and labels."""

from bench.common import metric_total

PAGE = """# TYPE ballast_backfill_replays_total counter
ballast_backfill_replays_total{result="ok"} 3
ballast_backfill_replays_total{result="busy"} 2
ballast_backfill_replays_total_created{result="ok"} 1.7e9
ballast_other 9
"""


def test_samples_of_a_name_are_summed_over_matching_labels():
    assert metric_total(PAGE, "ballast_backfill_replays_total") == 5
    assert metric_total(PAGE, "ballast_backfill_replays_total", result="busy") == 2


def test_a_name_that_only_prefixes_another_is_not_counted():
    assert metric_total(PAGE, "ballast_backfill_replays") == 0
    assert metric_total(PAGE, "ballast_other", result="ok") == 0
