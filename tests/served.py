"""What "the request was served" means in a test: the stream finished, and with the model's
answer, not one from the degradation ladder (which also finishes, and is on by default)."""

from __future__ import annotations


def assert_served(result) -> None:
    assert result.finished is not None, "the stream never finished"
    assert not result.finished.degradation, f"a degraded answer ({result.finished.degradation})"
