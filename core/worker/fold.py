"""The fold loop: one replica folds its quota of one iteration, calling the fault hooks on the way.

Contract: for the k-th microbatch `mb` of `quota` (k counts this replica's
microbatches of the step from `first`, the number it already folded in this step
before a recovery handed it more), in this order:
    hooks.at(step, "between_microbatches", k)       only for k >= 1
    before(mb)                                       if given (e.g. a work log)
    fold(mb, at)                                     forward + backward; it calls
                                                     at("forward", k) and at("backward", k),
                                                     at(phase, i) = hooks.at(step, phase, i)
    hooks.microbatch_done(step, k, seconds of fold)
    after(mb, fold's result)                         if given (e.g. the ledger entry)
This is the order core.launch.hooks promises every trainer keeps, so the plain, resilient
and baseline trainers and the fault drill's stand-ins all get the same faults at
the same points. A hook may raise or never return (a fault): the loop stops there.
Importing this module imports no torch.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Iterable

from recover.core.launch.hooks import WorkerHooks

PhaseHook = Callable[[str, int], None]
"""at(phase, k): the hook a fold calls at 'forward' and 'backward' of its k-th microbatch."""


def fold_quota(
    step: int,
    quota: Iterable[int],
    fold: Callable[[int, PhaseHook], Any],
    hooks: WorkerHooks,
    first: int = 0,
    before: Callable[[int], None] | None = None,
    after: Callable[[int, Any], None] | None = None,
) -> None:
    """Fold every microbatch id of `quota` in iteration `step` (see the module docstring)."""

    def at(phase: str, i: int) -> None:
        hooks.at(step, phase, i)

    for k, mb in enumerate(quota, start=first):
        if k:
            hooks.at(step, "between_microbatches", k)
        if before is not None:
            before(mb)
        start = time.perf_counter()
        result = fold(mb, at)
        hooks.microbatch_done(step, k, time.perf_counter() - start)
        if after is not None:
            after(mb, result)


def fold_pipelined(
    step: int,
    quota: Iterable[int],
    run: Callable[[list[int], PhaseHook], list[Any]],
    hooks: WorkerHooks,
    first: int = 0,
    after: Callable[[int, Any], None] | None = None,
    progress: Callable[[], None] | None = None,
) -> None:
    """Pipeline parallelism: collect the ids of `quota`, run them through one schedule, then fold each.

    The schedule is one unit (core/parallel/pp.py): `run(ids, at)` does every
    forward and backward and returns each id's result, calling at(phase, i) for
    its i-th microbatch ("between_microbatches" then "forward" before each
    forward, "backward" when its backward starts). The hooks see k = first + i, as
    in `fold_quota`, and "between_microbatches" only for k >= 1. Then, for each id
    in order, microbatch_done(step, k, the run's seconds / its ids) and after(mb,
    result). `quota` stopping early (an abort) leaves the ids it gave: they run,
    all of them, and are folded; ids never given are never run. `progress()`, if
    given, is called at each of those points: one schedule can outlast every bound
    of the coordinator, its microbatches cannot (core/worker/progress.py).
    """
    ids = list(quota)
    if not ids:
        return

    def at(phase: str, i: int) -> None:
        k = first + i
        if progress is not None:
            progress()
        if phase == "between_microbatches" and k == 0:
            return
        hooks.at(step, phase, k)

    start = time.perf_counter()
    results = run(ids, at)
    seconds = (time.perf_counter() - start) / len(ids)
    for k, (mb, result) in enumerate(zip(ids, results), start=first):
        hooks.microbatch_done(step, k, seconds)
        if after is not None:
            after(mb, result)
