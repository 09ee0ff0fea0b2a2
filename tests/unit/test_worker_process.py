"""Settings a worker process applies to itself at start."""

import sys

import pytest


def test_a_worker_process_takes_its_gil_switch_interval_from_config():
    from services.config import BallastConfig
    from services.worker.__main__ import tune_process

    before = sys.getswitchinterval()
    try:
        tune_process(BallastConfig.model_validate({"worker": {"gil_switch_ms": 2.0}}))
        assert sys.getswitchinterval() == pytest.approx(0.002)
    finally:
        sys.setswitchinterval(before)
