"""Parsing a sim worker's fault knobs: what etcd or the config may hold, and what is refused."""

from __future__ import annotations

import pytest

from services.worker.sim.faults import SimFaults, SimFaultsError, faults_key


def test_json_round_trip_keeps_only_what_was_set():
    faults = SimFaults.from_json(b'{"fail_after_tokens": 12, "temperature_c": 91.5, "slowdown": 2}')
    assert faults == SimFaults(fail_after_tokens=12, temperature_c=91.5, slowdown=2)
    assert SimFaults.from_json(faults.to_json()) == faults
    assert SimFaults.from_json(None) == SimFaults() == SimFaults.from_json(b"")
    assert SimFaults().to_json() == "{}"


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b"[1, 2]",
        b'{"explode": true}',
        b'{"fail_after_tokens": -1}',
        b'{"fail_after_tokens": 2.5}',
        b'{"slowdown": 0}',
        b'{"slowdown": "fast"}',
        b'{"hang": "yes"}',
        b'{"ready_delay_s": -3}',
    ],
)
def test_bad_settings_are_refused_with_a_typed_error(raw):
    with pytest.raises(SimFaultsError):
        SimFaults.from_json(raw)


def test_the_key_names_the_worker_under_the_prefix():
    assert faults_key("/ballast/", "worker-3") == "/ballast/sim/faults/worker-3"


def test_the_crash_marker_parses_and_refuses_what_is_not_a_short_text():
    faults = SimFaults.from_json(b'{"crash_on_marker": "QUERY-OF-DEATH"}')
    assert faults.crash_on_marker == "QUERY-OF-DEATH"
    assert SimFaults.from_json(faults.to_json()) == faults
    assert SimFaults().crash_on_marker is None
    for raw in (b'{"crash_on_marker": ""}', b'{"crash_on_marker": 7}', b'{"crash_on_marker": "%s"}' % (b"x" * 257)):
        with pytest.raises(SimFaultsError):
            SimFaults.from_json(raw)
