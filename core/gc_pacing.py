"""When the coordinator lets Python's cyclic garbage collector look at its state.

Contract:
- `settle()` is called by the coordinator once per committed step (and once per
  generation formed): it moves every object alive at that moment out of the
  collector's generations (`gc.freeze`, O(1)). Why: at R = 16,384 one step
  allocates ~100k containers (votes, ledgers, messages), which triggers full
  collections, and without freezing each of them rescans the whole run's state
  (every replica's vote, quota, speed): measured by `recover bench coordinator`,
  that was most of a commit's cost. With it a collection scans only what was
  allocated since the last step, so the collector's work stays O(R) per step.
- Frozen objects are still freed by reference counting as soon as nothing holds
  them (the votes of a committed step are, the moment the next step starts);
  only reference cycles that were already garbage (not yet collected) when a
  freeze came are kept. A run lasts millions of steps, so every `SWEEP_EVERY`
  settles the frozen objects are handed back (`gc.unfreeze`) and one full
  collection frees such cycles: a leak is bounded by what one sweep interval
  leaves, and the full scan's cost is paid once per SWEEP_EVERY steps, not per step.
- Pure bookkeeping: no I/O, no clocks; the state machine (core/protocol.py) does
  not call it, its drivers do (core/membership.py, and the benchmark as they do).
"""
from __future__ import annotations

import gc


SWEEP_EVERY = 1024

_settles = 0


def settle() -> None:
    """Exempt what is alive now from later collections (it survived a whole step)."""
    global _settles
    _settles += 1
    if _settles % SWEEP_EVERY == 0:
        gc.unfreeze()
        gc.collect()
    gc.freeze()
