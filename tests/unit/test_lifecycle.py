"""Process start-up helpers: what a service leaves to the garbage collector once it serves."""

from __future__ import annotations

import gc

from services.common.lifecycle import settle_startup_garbage


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
