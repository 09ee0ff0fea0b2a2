"""The soak's CPU accounting: which part a process is, and CPU seconds over a window counted
from real /proc readings of processes this test starts."""

from __future__ import annotations

import os
import subprocess
import sys

from bench.soak.cpu import CLIENTS, OTHER, CpuMeter, machine_busy_s, part_of


def test_processes_are_sorted_into_parts_by_their_command_line():
    assert part_of("VLLM::EngineCore python -m services.worker") == "engine"
    assert part_of("VLLM::Worker VLLM::Worker") == "engine"  # the model runner, renamed by vLLM
    assert part_of("VLLM::APIServer VLLM::APIServer") == "server front"
    assert part_of("python python -m vllm.entrypoints.openai.api_server --model m") == "server front"
    assert part_of("python python -m bench.plain_server --engine torch") == "server front"
    assert part_of("python python -m services.worker") == "worker front"
    assert part_of("python python -m services.router") == "router"
    assert part_of("python python -m services.cache") == "cache"
    assert part_of("python python -m services.backfill") == "backfill"
    assert part_of("etcd etcd --data-dir x") == "etcd"
    assert part_of("valkey-server valkey-server *:7000") == "redis"
    assert part_of("tansu tansu broker") == "kafka"
    assert part_of("sleep sleep 5") == OTHER


BURN = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass\n"


def test_a_child_born_in_the_window_counts_whole_and_the_meter_itself_is_the_clients():
    meter = CpuMeter()
    meter.start()
    child = subprocess.Popen([sys.executable, "-c", BURN + "import time; time.sleep(30)"])
    try:
        # Sampled while it lives (after its busy part), then it dies: the last sample stays.
        for _ in range(200):
            meter.sample()
            seen = meter._seen.get(child.pid)
            if seen is not None and seen.last_s >= 0.6:
                break
            subprocess.run([sys.executable, "-c", "import time; time.sleep(0.05)"])
    finally:
        child.kill()
        child.wait()
    meter.sample()
    parts = meter.by_part()
    # The child ran python -c, which no part names; it burnt at least its 0.6 s in the window.
    assert parts[OTHER] >= 0.6
    assert CLIENTS in parts
    # Busy time is counted in clock ticks on each core: over a window this short a machine busy
    # throughout can read up to a tick per core at each end more than its wall time.
    window_s = meter._wall_end - meter._wall_start
    tick_s = 1 / os.sysconf("SC_CLK_TCK")
    assert 0 < meter.machine_busy_share() <= 1.0 + 2 * tick_s / window_s


def test_a_process_named_after_it_was_first_seen_counts_under_its_name():
    # As vLLM's model runner: started as plain Python, renamed VLLM::Worker once it loads.
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time, ctypes\n"
            "sys.stdin.readline()\n" + BURN +
            # The name in two pieces: the command line must not hold it.
            "ctypes.CDLL(None).prctl(15, b'VLLM::' + b'Worker', 0, 0, 0)\n"
            "print('named', flush=True)\ntime.sleep(30)\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        meter = CpuMeter()
        meter.start()
        assert meter._seen[child.pid].part == OTHER
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "named"
        meter.sample()
        assert meter._seen[child.pid].part == "engine"
        assert meter.by_part()["engine"] >= 0.5
    finally:
        child.kill()
        child.wait()


def test_a_process_older_than_the_window_counts_only_what_it_used_in_it():
    child = subprocess.Popen([sys.executable, "-c", BURN + "import time; time.sleep(30)"])
    try:
        # Let it burn before the window opens.
        for _ in range(200):
            probe = CpuMeter()
            probe.start()
            if probe._seen.get(child.pid) and probe._seen[child.pid].last_s >= 0.6:
                break
            subprocess.run([sys.executable, "-c", "import time; time.sleep(0.05)"])
        meter = CpuMeter()
        meter.start()
        meter.sample()
        assert meter.by_part().get(OTHER, 0.0) < 0.6  # its earlier 0.6 s is not the window's
    finally:
        child.kill()
        child.wait()


def test_machine_busy_time_only_grows():
    first = machine_busy_s()
    assert machine_busy_s() >= first > 0
