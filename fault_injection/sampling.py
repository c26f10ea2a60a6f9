"""Seeded failure-time samplers: the fault model shared by generated plans and the simulator.

Contract:
- Every function is pure: its answer depends only on its arguments, and all
  randomness comes from the `numpy.random.Generator` the caller passes (seeded by
  the caller). The same generator state always gives the same answer.
- Every function returns a list of `(time, unit)` tuples sorted by time, then by
  unit, with `0 <= time < horizon`: `unit` is a GPU index (the per-GPU models) or
  a replica/unit index (`spread_losses`). Times are in the horizon's unit (hours
  for the per-GPU models).
- Failure model (no replacement, as in the paper): a GPU that fails is gone, so
  each GPU fails at most once; its failure time is one draw from the lifetime
  distribution, and only draws inside the horizon are failures. With
  `renewal=True` a failed GPU is replaced at once by a fresh one (an ordinary
  renewal process): the same GPU index may then fail again, after a fresh
  lifetime drawn from the same distribution.
- The lifetime distributions are parameterised by their mean, `mtbf_hours` (mean
  time between failures of one GPU): exponential with that mean (memoryless, a
  constant failure rate), or Weibull with the given shape and the scale that
  makes the mean equal `mtbf_hours` (shape < 1: infant mortality, > 1: wear-out,
  == 1: exponential).
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

FailureTimes = list[tuple[float, int]]
"""Sorted (time, unit) pairs."""


def _check(n_gpus: int, mtbf_hours: float, horizon_hours: float) -> None:
    if n_gpus < 0:
        raise ValueError(f"n_gpus must be >= 0, got {n_gpus}")
    if not mtbf_hours > 0:
        raise ValueError(f"mtbf_hours must be > 0, got {mtbf_hours}")
    if not horizon_hours >= 0:
        raise ValueError(f"horizon_hours must be >= 0, got {horizon_hours}")


def _collect(draw: Callable[[int], np.ndarray], n_gpus: int, horizon: float, renewal: bool) -> FailureTimes:
    """Failures within the horizon from `draw(k)` -> k iid lifetimes.

    Vectorised over GPUs so that 100k GPUs cost a few array operations: the first
    lifetime of every GPU is drawn at once; with renewal, only the GPUs whose
    last failure is still inside the horizon draw again, round after round.
    """
    clock = draw(n_gpus).astype(np.float64)
    units = np.arange(n_gpus)
    times_out: list[np.ndarray] = []
    units_out: list[np.ndarray] = []
    while clock.size:
        inside = clock < horizon
        times_out.append(clock[inside])
        units_out.append(units[inside])
        if not renewal:
            break
        clock, units = clock[inside], units[inside]
        clock = clock + draw(clock.size)
    if not times_out:
        return []
    times = np.concatenate(times_out)
    who = np.concatenate(units_out)
    order = np.lexsort((who, times))  # by time, ties by unit
    return [(float(times[i]), int(who[i])) for i in order]


def exponential_failure_times(
    rng: np.random.Generator, n_gpus: int, mtbf_hours: float, horizon_hours: float, renewal: bool = False
) -> FailureTimes:
    """Failures of `n_gpus` independent GPUs with exponential lifetimes of mean `mtbf_hours`."""
    _check(n_gpus, mtbf_hours, horizon_hours)
    return _collect(lambda k: rng.exponential(mtbf_hours, size=k), n_gpus, horizon_hours, renewal)


def weibull_scale(mtbf_hours: float, shape: float) -> float:
    """The Weibull scale whose mean is `mtbf_hours`: mean = scale * Gamma(1 + 1/shape)."""
    return mtbf_hours / math.gamma(1.0 + 1.0 / shape)


def weibull_failure_times(
    rng: np.random.Generator, n_gpus: int, mtbf_hours: float, shape: float, horizon_hours: float,
    renewal: bool = False,
) -> FailureTimes:
    """Failures of `n_gpus` independent GPUs with Weibull(shape) lifetimes of mean `mtbf_hours`."""
    _check(n_gpus, mtbf_hours, horizon_hours)
    if not shape > 0:
        raise ValueError(f"shape must be > 0, got {shape}")
    scale = weibull_scale(mtbf_hours, shape)
    return _collect(lambda k: scale * rng.weibull(shape, size=k), n_gpus, horizon_hours, renewal)


def spread_losses(k: int, n: int, horizon: float, rng: np.random.Generator | None = None) -> FailureTimes:
    """Lose `k` of `n` units, one at a time, evenly spread over (0, horizon).

    The i-th loss (i = 0..k-1) happens at horizon * (i + 1) / (k + 1): strictly
    inside the run, never at its start or its end, equal gaps between losses (the
    paper's schedule: half the GPUs lost across the run). Which units: a random
    k-subset in random order when `rng` is given; otherwise deterministic, the
    highest-numbered unit first (n-1, n-2, ...), so unit 0 is lost last.
    """
    if not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    if not horizon > 0:
        raise ValueError(f"horizon must be > 0, got {horizon}")
    if rng is None:
        units = [n - 1 - i for i in range(k)]
    else:
        units = [int(u) for u in rng.permutation(n)[:k]]
    return [(horizon * (i + 1) / (k + 1), units[i]) for i in range(k)]
