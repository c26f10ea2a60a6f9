"""Where a simulated run's failures come from: the fault-injection harness's samplers, or a plan.

Contract:
- `FailureEvents` is everything the engine needs about one run's failures: timed
  failures (seconds since the start, the replica hit, crash or hang) sorted by time,
  and step-triggered faults (fired when the simulated system first reaches that
  iteration and phase, as the real harness fires a plan's (step, phase) faults).
- `FailureModel.sample(job, horizon, rng)` draws them with the harness's own samplers
  (recover.fault_injection.sampling), never a copy: per-GPU exponential or Weibull
  lifetimes mapped to replicas (GPU g belongs to replica g // gpus_per_replica; a
  GPU outside every replica is idle and its failure ignored), or "lose K of N
  replicas spread over the run".
- A replica that is already down when one of its GPUs fails is not hit again: the
  engine ignores failures of replicas that are not alive.
- Fault kinds map to what a system sees through their `sim_effect` in the
  harness's kinds table (recover.fault_injection.kinds): "crash" takes the replica
  out at once (crash, replica_loss, collective_error, broken_link), "hang" takes it out after a
  deadline (hang, timed or not), "none" is not modelled (slow: a straggler changes
  speed, not membership) and is reported as skipped, as is a kind the table lacks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from recover.core.config.fields import doc_field as _f
from recover.fault_injection import sampling
from recover.fault_injection.kinds import KINDS

from .model import JobModel

CRASH, HANG = 0, 1
EFFECT_CODE = {"crash": CRASH, "hang": HANG}  # the kinds table's sim_effect -> the engine's code ("none": skipped)


@dataclass(frozen=True)
class StepFault:
    """A fault fired when the system first reaches iteration `step` at `phase`."""

    step: int  # iteration, from 0 (metrics.jsonl's step)
    phase: str  # one of core.launch.hooks.PHASES
    replica: int  # target replica
    kind: int  # CRASH or HANG
    microbatch: int | None = None  # k-th microbatch of the target's quota (None = first)


@dataclass(frozen=True)
class FailureEvents:
    """One run's failures, in the form the engine consumes."""

    times: np.ndarray  # float64 seconds since the run started, sorted ascending
    replicas: np.ndarray  # int64 replica hit by each timed failure
    kinds: np.ndarray  # int8 CRASH or HANG per timed failure
    step_faults: tuple[StepFault, ...] = ()  # (step, phase) faults, fired in step order
    skipped: tuple[str, ...] = ()  # faults of a plan the simulator does not model, and why

    def __post_init__(self) -> None:
        if len(self.times) > 1 and np.any(np.diff(self.times) < 0):
            raise ValueError("failure times must be sorted")

    def __len__(self) -> int:
        return len(self.times) + len(self.step_faults)

    @classmethod
    def none(cls) -> "FailureEvents":
        """No failure at all."""
        return cls(np.zeros(0), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int8))

    @classmethod
    def from_pairs(cls, pairs: Iterable[tuple[float, int]], kind: int = CRASH) -> "FailureEvents":
        """From (seconds, replica) pairs (any order)."""
        pairs = sorted(pairs)
        t = np.array([p[0] for p in pairs], dtype=np.float64)
        r = np.array([p[1] for p in pairs], dtype=np.int64)
        return cls(t, r, np.full(len(pairs), kind, dtype=np.int8))

    @classmethod
    def single(cls, seconds: float, replica: int, kind: int = CRASH) -> "FailureEvents":
        """One failure of `replica` at `seconds`."""
        return cls.from_pairs([(seconds, replica)], kind)

    def first(self, n: int) -> "FailureEvents":
        """Only the first n timed failures (for 'more failures' comparisons)."""
        return FailureEvents(self.times[:n], self.replicas[:n], self.kinds[:n], self.step_faults, self.skipped)


@dataclass(frozen=True)
class FailureModel:
    """How a scenario's failures are generated."""

    kind: str = _f("none", "none | exponential | weibull | spread | plan")
    mtbf_hours: float = _f(0.0, "exponential/weibull: mean time between failures of one GPU")
    weibull_shape: float = _f(1.0, "weibull: shape (<1 infant mortality, >1 wear-out)")
    k_lost: int = _f(0, "spread: replicas lost, evenly spread over the horizon")
    plan: tuple[dict[str, Any], ...] = _f((), "plan: fault dicts in the harness's plan format")
    seed: int = _f(0, "seed of the numpy Generator the samplers draw from")

    def job_mtbf_seconds(self, job: JobModel, horizon: float) -> float:
        """Expected seconds between replica losses at the start (what Young/Daly is given)."""
        if self.kind in ("exponential", "weibull"):
            return self.mtbf_hours * 3600.0 / job.gpus_used
        if self.kind == "spread" and self.k_lost > 0:
            return horizon / (self.k_lost + 1)
        if self.kind == "plan" and self.plan and np.isfinite(horizon):
            return horizon / (len(self.plan) + 1)
        return float("inf")

    def sample(self, job: JobModel, horizon: float, renewal: bool = False) -> FailureEvents:
        """Draw this model's failures for `job` over `horizon` seconds (renewal: failed GPUs come back)."""
        rng = np.random.default_rng(self.seed)
        if self.kind == "none":
            return FailureEvents.none()
        if self.kind in ("exponential", "weibull"):
            hours = horizon / 3600.0
            if self.kind == "exponential":
                pairs = sampling.exponential_failure_times(rng, job.gpus_used, self.mtbf_hours, hours, renewal=renewal)
            else:
                pairs = sampling.weibull_failure_times(rng, job.gpus_used, self.mtbf_hours, self.weibull_shape, hours,
                                                       renewal=renewal)
            if not pairs:
                return FailureEvents.none()
            arr = np.asarray(pairs, dtype=np.float64)
            return FailureEvents(arr[:, 0] * 3600.0, arr[:, 1].astype(np.int64) // job.gpus_per_replica,
                                 np.full(len(arr), CRASH, dtype=np.int8))
        if self.kind == "spread":
            pairs = sampling.spread_losses(self.k_lost, job.replicas, horizon, rng=rng)
            return FailureEvents.from_pairs(pairs)
        if self.kind == "plan":
            return events_from_plan({"faults": list(self.plan)})
        raise ValueError(f"unknown failure model {self.kind!r}")


def events_from_plan(plan: dict[str, Any]) -> FailureEvents:
    """A harness fault plan ({"faults": [...]}, fault_injection/plan.py's JSON form) as simulator events."""
    timed: list[tuple[float, int, int]] = []
    steps: list[StepFault] = []
    skipped: list[str] = []
    for i, f in enumerate(plan.get("faults", [])):
        kind = f.get("kind")
        spec = KINDS.get(kind) if isinstance(kind, str) else None
        if spec is None or spec.sim_effect not in EFFECT_CODE:
            why = spec.sim_why if spec is not None else "it changes speed, not membership"
            skipped.append(f"fault {i}: kind {kind!r} is not modelled ({why})")
            continue
        k = EFFECT_CODE[spec.sim_effect]
        if f.get("at_seconds") is not None:
            timed.append((float(f["at_seconds"]), int(f["replica"]), k))
        else:
            steps.append(StepFault(int(f["step"]), str(f["phase"]), int(f["replica"]), k, f.get("microbatch")))
    timed.sort()
    steps.sort(key=lambda s: (s.step, s.replica))
    return FailureEvents(
        np.array([t for t, _, _ in timed], dtype=np.float64),
        np.array([r for _, r, _ in timed], dtype=np.int64),
        np.array([k for _, _, k in timed], dtype=np.int8),
        tuple(steps), tuple(skipped),
    )
