"""When the coordinator lets Python's cyclic garbage collector look at its state.

Contract:
- `settle()` is called by the coordinator once per committed step: it moves every
  object alive at that moment out of the collector's generations (`gc.freeze`,
  O(1)). Why: at R = 16,384 one step allocates ~100k containers (votes, ledgers,
  messages), which triggers full collections, and without freezing each of them
  rescans the whole run's state (every replica's vote, quota, speed): measured by
  `recover bench coordinator`, that was most of a commit's cost. With it a
  collection scans only what was allocated since the last step, so the
  collector's work stays O(R) per step.
- `take_over()` is for the process that is the coordinator (core/coordinator/process.py,
  and the benchmark that measures it): the automatic collector is switched off,
  and `settle()` first collects what the step left (`gc.collect`, which never
  scans frozen objects: O(one step's live objects)). Why: even with freezing, the
  automatic collector ran several young and full collections inside every step, in
  the middle of the votes: at R = 16,384 that was a third of vote-to-commit (25 of
  ~75 ms, `recover bench coordinator` with and without `--no-gc`). A settle runs
  after the commit messages are out, so this collection is off that path.
  Between steps (start-up, a long recovery, a run waiting for newcomers) `pace(now)`,
  called by the service once per tick, settles when none came for `PACE_SECONDS`,
  so garbage cycles never wait longer than that, whatever the run does.
  Not for a process that merely hosts a service among other work (a test, a
  thread): there the automatic collector stays on.
- Frozen objects are still freed by reference counting as soon as nothing holds
  them (the votes of a committed step are, the moment the next step starts);
  only reference cycles that were already garbage (not yet collected) when a
  freeze came are kept. A run lasts millions of steps, so every `SWEEP_EVERY`
  settles the frozen objects are handed back (`gc.unfreeze`) and one full
  collection frees such cycles: a leak is bounded by what one sweep interval
  leaves, and the full scan's cost is paid once per SWEEP_EVERY steps, not per step.
- Pure bookkeeping: no I/O, no clock of its own (`pace` is handed the time); the
  state machine (core/coordinator/protocol.py) does not call it, its drivers do
  (core/coordinator/service.py, and the benchmark as they do).
"""
from __future__ import annotations

import gc


SWEEP_EVERY = 1024
PACE_SECONDS = 1.0  # with the collector taken over: the longest a garbage cycle waits for a collection

_settles = 0
_owned = False  # take_over() was called: automatic collection is off, settle() collects
_seen = -1  # _settles when pace() last looked
_since = 0.0  # the `now` at which pace() last saw a settle (or made one)


def take_over() -> None:
    """Collect only at settles (this process is the coordinator): the automatic collector is off."""
    global _owned
    _owned = True
    gc.disable()


def settle() -> None:
    """Exempt what is alive now from later collections (it survived a whole step)."""
    global _settles
    _settles += 1
    if _settles % SWEEP_EVERY == 0:
        gc.unfreeze()
        gc.collect()
    elif _owned:
        gc.collect()  # what this step left, not the frozen state: O(one step)
    gc.freeze()


def pace(now: float) -> None:
    """Settle if none (from any caller) came for PACE_SECONDS; called once per service tick."""
    global _seen, _since
    if not _owned:
        return  # the automatic collector runs: nothing waits on settles
    if _settles != _seen:  # a settle came since the last look: the clock restarts
        _seen, _since = _settles, now
    elif now - _since >= PACE_SECONDS:
        settle()
        _seen, _since = _settles, now
