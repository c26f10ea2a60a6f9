"""core/gc_pacing.py: a garbage cycle frozen by a step's settle() is still freed by the periodic sweep."""
import gc
import weakref

from recover.core import gc_pacing


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
