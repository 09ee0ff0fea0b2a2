"""Process start-up helpers: what a service leaves to the garbage collector once it serves, and
the stop signals it catches from before it says it is ready."""

from __future__ import annotations

import asyncio
import gc
import os
import signal

from services.common.lifecycle import catch_stop_signals, settle_startup_garbage


def test_startup_objects_are_frozen_and_garbage_is_gone():
    class Cycle:
        pass

    gc.unfreeze()
    before = gc.get_freeze_count()
    loaded = [Cycle() for _ in range(100)]  # stands in for modules and models loaded at start
    garbage = Cycle()
    garbage.self = garbage  # unreachable after `del`: collected, not frozen
    del garbage
    try:
        settle_startup_garbage()
        assert gc.get_freeze_count() >= before + len(loaded)
        assert not any(isinstance(obj, Cycle) and getattr(obj, "self", None) is obj for obj in gc.get_objects())
        # Frozen objects are out of the collector's generations: a full collection skips them.
        assert all(not gc.is_tracked(obj) or obj not in gc.get_objects(generation=2) for obj in loaded[:3])
    finally:
        gc.unfreeze()


def test_a_stop_signal_sent_as_soon_as_it_is_caught_stops_instead_of_killing():
    async def main() -> str:
        stop = catch_stop_signals()
        # What a launcher does on the READY line: signal before the loop ran even once more.
        os.kill(os.getpid(), signal.SIGTERM)
        return await asyncio.wait_for(stop, 5)

    assert asyncio.run(main()) == "SIGTERM"
    # The handlers went with the loop's future: the signal is the process's own default again.
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
