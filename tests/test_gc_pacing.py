"""core/coordinator/gc_pacing.py: garbage cycles are freed by the periodic sweep, and at once where the
coordinator took the collector over."""
import gc
import weakref

from recover.core.coordinator import gc_pacing


class _Node:
    pass


def test_a_cycle_frozen_before_it_was_collected_is_freed_by_the_next_sweep(monkeypatch):
    monkeypatch.setattr(gc_pacing, "_settles", 0)
    try:
        a, b = _Node(), _Node()
        a.other, b.other = b, a  # a cycle: reference counting alone never frees it
        alive = weakref.ref(a)
        del a, b
        for _ in range(gc_pacing.SWEEP_EVERY - 1):
            gc_pacing.settle()
        gc.collect()  # frozen objects are out of the collector's reach
        assert alive() is not None
        gc_pacing.settle()  # the sweep
        assert alive() is None
    finally:
        gc.unfreeze()


def _cycle() -> weakref.ref:
    a, b = _Node(), _Node()
    a.other, b.other = b, a  # a cycle: reference counting alone never frees it
    return weakref.ref(a)


def test_a_taken_over_collector_frees_a_cycle_at_the_next_settle_and_runs_nowhere_else(monkeypatch):
    monkeypatch.setattr(gc_pacing, "_settles", 1)  # far from a sweep
    monkeypatch.setattr(gc_pacing, "_owned", False)
    was_enabled = gc.isenabled()
    try:
        gc_pacing.take_over()
        assert not gc.isenabled()  # no automatic collection in the middle of a step
        alive = _cycle()
        for _ in range(3):  # allocations that would trigger collections: none runs
            [[] for _ in range(5000)]
        assert alive() is not None
        gc_pacing.settle()  # after a commit: what the step left is collected, then frozen
        assert alive() is None
    finally:
        gc.unfreeze()
        if was_enabled:
            gc.enable()


def test_pace_settles_only_when_no_settle_came_for_its_interval(monkeypatch):
    monkeypatch.setattr(gc_pacing, "_settles", 1)
    monkeypatch.setattr(gc_pacing, "_seen", -1)
    monkeypatch.setattr(gc_pacing, "_owned", False)
    was_enabled = gc.isenabled()
    try:
        gc_pacing.pace(0.0)
        gc_pacing.pace(100.0)
        assert gc_pacing._settles == 1  # not taken over: the automatic collector runs, pace does nothing
        gc_pacing.take_over()
        gc_pacing.pace(10.0)  # the first look starts the clock
        gc_pacing.pace(10.0 + gc_pacing.PACE_SECONDS / 2)
        assert gc_pacing._settles == 1
        gc_pacing.settle()  # a commit's settle restarts the clock
        gc_pacing.pace(10.0 + gc_pacing.PACE_SECONDS)
        assert gc_pacing._settles == 2
        alive = _cycle()
        gc_pacing.pace(10.0 + 2 * gc_pacing.PACE_SECONDS + 0.01)  # a whole interval with none: pace settles
        assert gc_pacing._settles == 3 and alive() is None
    finally:
        gc.unfreeze()
        if was_enabled:
            gc.enable()
