"""The chaos soak's plan: seeded traffic and the fault schedule, the same for both phases."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.soak.faults import (
    Victims,
    KAFKA_DOWN,
    MESH_FAULTS,
    ROUTER_KILL,
    WORKER_FAULTS,
    WORKER_KILL,
    WORKER_STALL,
    Throttle,
    fault_schedule,
    process_tree,
    settled_at,
    surge_window,
)
from bench.soak.table import RequestSample
from bench.soak.traffic import (
    CONTEXT_TURNS,
    JSON_SHARE,
    NO_SURGE,
    ONLY_S,
    SCHEMAS,
    TURNS,
    Conversation,
    Surge,
    arrivals,
    plan_sessions,
)


def test_the_same_seed_gives_the_same_sessions_and_another_seed_others():
    surge = surge_window(300)
    first, again = plan_sessions(3, 300, 0.5, surge), plan_sessions(3, 300, 0.5, surge)
    assert first == again
    assert first != plan_sessions(4, 300, 0.5, surge)


def test_sessions_have_six_to_twelve_turns_with_the_tier_and_json_mix():
    sessions = plan_sessions(11, 2000, 1.0, NO_SURGE)
    turns = [t for s in sessions for t in s.turns]
    assert all(TURNS[0] <= len(s.turns) <= TURNS[1] for s in sessions)
    shares = {tier: sum(t.tier == tier for t in turns) / len(turns) for tier in "SAB"}
    assert shares["S"] == pytest.approx(0.10, abs=0.02)
    assert shares["A"] == pytest.approx(0.30, abs=0.03)
    assert shares["B"] == pytest.approx(0.60, abs=0.03)
    json_turns = [t for t in turns if t.schema is not None]
    assert len(json_turns) / len(turns) == pytest.approx(JSON_SHARE, abs=0.02)
    assert {t.schema_name for t in json_turns} == set(SCHEMAS)
    assert all(t.think_s == 0 for s in sessions for t in s.turns[:1])
    assert all(t.think_s > 0 for s in sessions for t in s.turns[1:])


def test_only_s_sessions_for_the_unloaded_measurement():
    sessions = plan_sessions(5, 60, 2.0, NO_SURGE, mix=ONLY_S)
    assert sessions and all(t.tier == "S" for s in sessions for t in s.turns)


def test_the_surge_triples_the_arrival_rate_inside_its_window_only():
    surge = Surge(1000, 2000, 3.0)
    times = arrivals(random.Random(1), 3000, 2.0, surge)
    inside = sum(surge.start_s <= t < surge.end_s for t in times)
    outside = len(times) - inside
    # 2000 s outside at 2/s, 1000 s inside at 6/s.
    assert outside == pytest.approx(4000, rel=0.06)
    assert inside == pytest.approx(6000, rel=0.06)
    assert times == sorted(times) and 0 <= times[0] and times[-1] < 3000


def test_the_conversation_grows_then_slides():
    session = plan_sessions(2, 600, 1.0, NO_SURGE)[0]
    conversation = Conversation()
    sizes = []
    for turn in session.turns:
        messages = conversation.messages_for(turn)
        assert messages[-1] == {"role": "user", "content": turn.text}
        sizes.append(len(messages))
        conversation.record(turn, f"answer {turn.index}")
    assert sizes[:4] == [1, 3, 5, 7]
    assert max(sizes) == 2 * CONTEXT_TURNS + 1
    last = conversation.messages_for(session.turns[-1])
    assert last[-2] == {"role": "assistant", "content": f"answer {session.turns[-1].index}"}


def test_both_phases_share_the_times_of_their_common_faults():
    baseline = fault_schedule(7, 600, WORKER_FAULTS)
    ballast = fault_schedule(7, 600, WORKER_FAULTS + MESH_FAULTS)
    assert {f.kind for f in baseline} == set(WORKER_FAULTS)
    assert {f.kind for f in ballast} == set(WORKER_FAULTS + MESH_FAULTS)
    assert [f for f in ballast if f.kind in WORKER_FAULTS] == baseline
    assert sum(f.kind == WORKER_KILL for f in baseline) == 3
    assert all(0 < f.at_s < 600 for f in ballast)
    assert [f.at_s for f in ballast] == sorted(f.at_s for f in ballast)
    # One kill lands inside the surge.
    surge = surge_window(600)
    assert any(f.kind == WORKER_KILL and surge.start_s <= f.at_s < surge.end_s for f in baseline)
    assert fault_schedule(8, 600, WORKER_FAULTS) != baseline


def test_holds_scale_with_the_soak_within_their_bounds():
    long = {f.kind: f for f in fault_schedule(1, 600, WORKER_FAULTS + MESH_FAULTS)}
    short = {f.kind: f for f in fault_schedule(1, 60, WORKER_FAULTS + MESH_FAULTS)}
    # Past the B tier's 15 s stall timeout on a full soak, past A's 5 s on a short one.
    assert long[WORKER_STALL].hold_s == 20.0 and short[WORKER_STALL].hold_s == 6.0
    assert long[KAFKA_DOWN].hold_s == 30.0 and short[KAFKA_DOWN].hold_s == 5.0
    assert long[ROUTER_KILL].hold_s == 0.0


def _sample(start, ttft=0.05, ok=True, end=None):
    return RequestSample(session="s", turn=0, tier="B", start=start, end=end or start + 0.2, ok=ok, ttft=ttft)


def test_settled_after_the_first_clean_window_within_the_tolerance():
    samples = [_sample(t / 2, ttft=2.0) for t in range(0, 40)]  # slow up to 20 s
    samples += [_sample(20 + t / 2, ttft=0.05) for t in range(0, 40)]  # fast after
    assert settled_at(samples, after=10, reference_ms=50) == pytest.approx(25.0)
    samples.append(_sample(21, ok=False))  # a failure at 21 s keeps 20-25 from counting
    assert settled_at(samples, after=10, reference_ms=50) == pytest.approx(27.0)
    assert settled_at([_sample(t, ttft=2.0) for t in range(30)], after=0, reference_ms=50) is None


def test_process_tree_lists_children_and_the_throttle_leaves_them_running():
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time; "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); "
            "time.sleep(30)",
        ]
    )
    try:
        deadline = time.monotonic() + 10
        while len(process_tree(parent.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        tree = process_tree(parent.pid)
        assert tree[0] == parent.pid and len(tree) == 2
        throttle = Throttle(parent.pid, duty=0.5, period_s=0.05).start()
        time.sleep(0.3)
        throttle.stop()
        for pid in tree:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            assert state != "T", f"process {pid} left stopped"
    finally:
        for pid in reversed(process_tree(parent.pid)):
            os.kill(pid, signal.SIGKILL)
        parent.wait()


ORPHAN_SCRIPT = """
import os, subprocess, sys, time
from bench.soak.faults import adopt_orphans, end_leftovers, process_tree
adopt_orphans()
# A child that starts a grandchild and exits at once: the grandchild is orphaned.
subprocess.run([sys.executable, "-c",
                "import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])"])
deadline = time.monotonic() + 10
while len(process_tree(os.getpid())) < 2 and time.monotonic() < deadline:
    time.sleep(0.05)
orphans = process_tree(os.getpid())[1:]
left = end_leftovers(grace_s=5)
print(len(orphans), left == orphans, len(process_tree(os.getpid())[1:]))
"""


def test_an_orphan_a_child_left_behind_is_found_and_stopped():
    run = subprocess.run(
        [sys.executable, "-c", ORPHAN_SCRIPT],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["1", "True", "0"]


def test_a_fault_strikes_the_busiest_serving_worker_not_one_still_starting():
    """A worker its keeper is starting again (its metrics do not answer) is never the victim
    while another serves, however idle; two overlapping faults strike two workers."""
    loads = {"w1": None, "w2": 0.0, "w3": 3.0}
    victims = Victims(wait_s=0.0)
    with victims.busiest(lambda: list(loads), str, loads.get) as first:
        assert first == "w3"
        with victims.busiest(lambda: list(loads), str, loads.get) as second:
            assert second == "w2"
    with victims.busiest(lambda: ["w1"], str, loads.get) as only:
        assert only == "w1"  # nothing serves, and no wait: any of them


class FakeTime:
    """A clock that moves only when slept on, calling `on_sleep` each time."""

    def __init__(self, on_sleep) -> None:
        self.now = 0.0
        self.on_sleep = on_sleep

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.on_sleep(self.now)


def test_a_fault_waits_for_a_worker_that_serves_free_of_other_faults_then_strikes_any():
    """While every worker is starting again or under another fault, the fault waits for one
    that serves (a worker coming back, one whose fault ended), up to its wait; then any."""
    loads: dict[str, float | None] = {"w1": None, "w2": 2.0}

    def back(now: float) -> None:
        if now >= 3.0:
            loads["w1"] = 0.0  # w1 serves again after three seconds

    time_ = FakeTime(back)
    victims = Victims(wait_s=10.0, poll_s=0.5, clock=time_.clock, sleep=time_.sleep)
    with victims.busiest(lambda: list(loads), str, loads.get) as first:
        assert first == "w2" and time_.now == 0.0
        with victims.busiest(lambda: list(loads), str, loads.get) as second:
            assert second == "w1" and time_.now == 3.0  # waited until it served
            with victims.busiest(lambda: list(loads), str, loads.get) as third:
                # Both under a fault for the whole wait: it strikes one of them at its end.
                assert third in ("w1", "w2") and time_.now == 13.0


def test_a_fault_with_no_worker_alive_at_the_end_of_its_wait_says_so():
    time_ = FakeTime(lambda now: None)
    victims = Victims(wait_s=2.0, poll_s=0.5, clock=time_.clock, sleep=time_.sleep)
    with pytest.raises(LookupError):
        with victims.busiest(lambda: [], str, lambda name: 1.0):
            pass
    assert time_.now == 2.0
