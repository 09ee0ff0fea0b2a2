"""The worker_front benchmark's CPU count by thread: pure bookkeeping over two snapshots."""

from __future__ import annotations

import os

import pytest

from bench.worker_front import _round_cpu, _thread_cpu_ns

PID = 100


def test_each_thread_counts_what_it_spent_between_the_snapshots_in_its_group() -> None:
    before = {
        PID: ("python", 5_000_000),
        101: ("event_engine", 1_000_000),
        102: ("ZMQbg/IO/0", 0),
        103: ("python", 2_000_000),
    }
    after = {
        PID: ("python", 9_000_000),
        101: ("event_engine", 1_500_000),
        102: ("ZMQbg/IO/0", 250_000),
        103: ("python", 2_000_000),
        # Started during the round: all its time is the round's.
        104: ("grpc_global_tim", 100_000),
    }

    groups = _round_cpu(PID, before, after)

    assert groups == pytest.approx(
        {
            "event loop (main thread)": 0.004,
            "gRPC core threads": 0.0006,
            "ZeroMQ threads": 0.00025,
            "other threads": 0.0,
        }
    )


def test_a_thread_named_like_grpc_is_not_the_main_thread_by_its_name() -> None:
    # The main thread is told by its id (the process id), whatever its name.
    groups = _round_cpu(PID, {PID: ("event_engine", 0)}, {PID: ("event_engine", 1_000_000)})

    assert groups == {"event loop (main thread)": pytest.approx(0.001)}


def test_snapshot_of_this_process_has_its_main_thread() -> None:
    threads = _thread_cpu_ns(os.getpid())

    assert os.getpid() in threads
    assert threads[os.getpid()][1] > 0
