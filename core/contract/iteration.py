"""The invariant, in one place: iteration t owns the microbatch ids t*M .. t*M+M-1.

Contract: every process computes an iteration's ids from (step, M) alone, with these
functions: the coordinator (which ids a step must fold, what is left to redo), the
workers (their data and randomness are functions of the id), the trainers and the
checks of the results. Torch-free.
"""
from __future__ import annotations


def iteration_range(step: int, microbatches: int) -> tuple[int, int]:
    """[lo, hi): the ids iteration `step` owns, as a half-open range."""
    return step * microbatches, (step + 1) * microbatches


def iteration_ids(step: int, microbatches: int) -> list[int]:
    """The global microbatch ids that iteration `step` owns, in order."""
    lo, hi = iteration_range(step, microbatches)
    return list(range(lo, hi))
