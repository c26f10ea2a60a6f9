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
This is the order core.hooks promises every trainer keeps, so the plain, resilient
and baseline trainers and the fault drill's stand-ins all get the same faults at
the same points. A hook may raise or never return (a fault): the loop stops there.
Importing this module imports no torch.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Iterable

from .hooks import WorkerHooks

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
