"""Generated fault plans: a seed and a failure model in, a FaultPlan out.

Contract:
- `sample_plan(...)` is a pure function of its arguments: the same seed and
  settings always give the same plan (all randomness comes from one
  `numpy.random.default_rng(seed)`, drawn in a fixed order), and the plan carries
  its settings in `generator`, so a result can always be traced back to them.
- Models (times from `sampling.py`):
    exponential / weibull  independent per-GPU failures with a mean time between
                           failures per GPU (`mtbf_hours`); the run spans `hours`
                           of simulated time, mapped linearly onto its steps;
    spread                 "lose K of N replicas spread over the run" (the paper's
                           schedule; K defaults to half the replicas).
- Mapping onto a local run: GPU g belongs to replica g // gpus_per_replica, and a
  replica is lost at its first GPU failure (no replacement, as in the paper), so
  each replica appears at most once. A failure at simulated time t lands at step
  floor(t / hours * steps), at a phase drawn from `phases`. Faults are sorted by
  (step, replica).
- Kinds: those with a `sample` rule in the kinds table (`SAMPLE_KINDS`:
  crash, hang, replica_loss); the rule gives a drawn fault's parameters (a
  hang's `seconds` is `hang_seconds`).
- Every generated plan passes `validate_plan(plan, replicas, steps)`.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .kinds import KINDS, SAMPLE_KINDS
from .plan import Fault, FaultPlan
from .sampling import exponential_failure_times, spread_losses, weibull_failure_times

MODELS = ("exponential", "weibull", "spread")
# The points every trainer reaches on every replica in every step (a replica may
# fold a single microbatch, so between_microbatches is not among them, and only
# checkpointing systems reach checkpoint_save).
DEFAULT_PHASES = ("forward", "backward", "allreduce", "commit", "optimizer_step")


def sample_plan(
    model: str,
    replicas: int,
    steps: int,
    seed: int,
    *,
    mtbf_hours: float = 1000.0,
    shape: float = 1.0,
    hours: float = 24.0,
    gpus_per_replica: int = 1,
    lose: int | None = None,
    kind: str = "crash",
    hang_seconds: float | None = None,
    phases: Sequence[str] = DEFAULT_PHASES,
) -> FaultPlan:
    """Draw a plan for a run of `replicas` x `steps` (see the module docstring)."""
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; one of {', '.join(MODELS)}")
    if kind not in SAMPLE_KINDS:
        raise ValueError(f"unknown kind {kind!r}; one of {', '.join(SAMPLE_KINDS)}")
    if replicas < 1 or steps < 1 or gpus_per_replica < 1:
        raise ValueError("replicas, steps and gpus_per_replica must be >= 1")
    if not phases:
        raise ValueError("phases must not be empty")
    if not hours > 0:
        raise ValueError(f"hours must be > 0, got {hours}")
    rng = np.random.default_rng(seed)
    generator: dict = {"model": model, "seed": seed, "replicas": replicas, "steps": steps, "kind": kind,
                       "phases": list(phases)}
    if model == "spread":
        k = replicas // 2 if lose is None else lose
        losses = [(t * hours, u) for t, u in spread_losses(k, replicas, 1.0, rng)]
        generator.update(lose=k)
    else:
        n_gpus = replicas * gpus_per_replica
        if model == "exponential":
            failures = exponential_failure_times(rng, n_gpus, mtbf_hours, hours)
        else:
            failures = weibull_failure_times(rng, n_gpus, mtbf_hours, shape, hours)
            generator.update(shape=shape)
        generator.update(mtbf_hours=mtbf_hours, hours=hours, gpus_per_replica=gpus_per_replica)
        losses, lost = [], set()
        for t, gpu in failures:  # sorted by time: the first failure of a replica takes it out
            r = gpu // gpus_per_replica
            if r not in lost:
                lost.add(r)
                losses.append((t, r))
    picked = rng.integers(0, len(phases), size=len(losses))  # drawn after the times, always
    params = KINDS[kind].sample(hang_seconds=hang_seconds)
    faults = []
    for (t, r), p in zip(losses, picked):
        step = min(steps - 1, int(t / hours * steps))
        faults.append(Fault(kind=kind, replica=int(r), step=step, phase=str(phases[int(p)]), **params))
    order = sorted(range(len(faults)), key=lambda i: (faults[i].step, faults[i].replica))
    generator["times_hours"] = [losses[i][0] for i in order]
    return FaultPlan(tuple(faults[i] for i in order), generator)
