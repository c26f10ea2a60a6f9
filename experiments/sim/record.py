"""What one simulated run accounts for: the same record for every system.

Contract: `RunRecord` is written to only by a policy (commit, checkpoint_done,
rollback, set_working) and read by the reports; it holds no policy logic. Definitions:
- an iteration is *committed* when its update is applied; a checkpointing system
  that rolls back removes the iterations since its checkpoint (they count as lost);
- *tokens*: tokens of all committed iterations still kept at the end;
- *effective tokens*: tokens of kept iterations that processed exactly M
  microbatches: the iterations whose gradient is the failure-free run's (ids t*M ..
  t*M+M-1). A system that shrinks the global batch (elastic-keep-per-replica,
  torchft) commits off-trajectory iterations while replicas are missing; they add
  tokens but no effective tokens;
- *exact tokens*: effective tokens committed before the first off-trajectory
  iteration: after it the weights differ from the failure-free run's for good;
- *wall seconds*: the horizon, or the time of the last commit when the run stops at
  max_iterations. A run whose last replica dies still counts the whole horizon;
- *GPU-hours*: the integral of the GPUs of the replicas a system holds (working,
  restarting or idle in a stall, not yet dead) over wall time;
- *ETTR* (effective training time ratio): the failure-free duration of every kept
  effective iteration, with the replica count it committed with, over wall seconds;
- the two throughput metrics, goodput (kept tokens, whatever the trajectory) and
  trajectory-equivalent throughput (effective tokens), per wall second and per GPU-hour,
  are defined once in experiments/throughput.py for every reader; `summary()` takes
  its numbers and names from there.
The series (s_*) get one point per state change, so a figure can draw tokens
against time or GPU-hours without re-running the simulation.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from recover.experiments.throughput import METRICS, columns, rates

from .model import JobModel


THROUGHPUT_METRICS = METRICS
"""The two throughput metrics in words (experiments/throughput.py; summary.json carries this text)."""


@dataclass
class Snapshot:
    """The counters at the last complete checkpoint (what a rollback restores)."""

    iterations: int = 0
    tokens: float = 0.0
    effective_tokens: float = 0.0
    exact_tokens: float = 0.0
    effective_iterations: int = 0
    productive_seconds: float = 0.0
    exact: bool = True


@dataclass
class RunRecord:
    """Everything one simulated run accounts for (definitions in the module docstring)."""

    job: JobModel  # the job's model
    system: str = ""  # the system's name
    iterations: int = 0  # committed iterations still kept
    tokens: float = 0.0  # tokens of kept iterations
    effective_tokens: float = 0.0  # tokens of kept iterations with exactly M microbatches
    exact_tokens: float = 0.0  # effective tokens before the first off-trajectory iteration
    effective_iterations: int = 0  # kept iterations with exactly M microbatches
    productive_seconds: float = 0.0  # failure-free duration of the kept effective iterations
    exact: bool = True  # no off-trajectory iteration kept so far
    lost_iterations: int = 0  # iterations committed and then rolled back
    failures: int = 0  # failures that hit a replica the system held
    restarts: int = 0  # rollbacks to a checkpoint
    checkpoints: int = 0  # checkpoints completed
    working: int = 0  # replicas the system holds now
    min_working: int = 0  # fewest replicas held at any time
    gpu_seconds: float = 0.0  # integral of held GPUs until t_clock
    t_clock: float = 0.0  # time up to which gpu_seconds is integrated
    snapshot: Snapshot = field(default_factory=Snapshot)  # counters at the last checkpoint
    finished_at: float | None = None  # time of the commit that reached max_iterations
    dead_at: float | None = None  # time the last replica died (no replacement to wait for)
    first_commit_at: float | None = None  # time of the first commit
    step0_at: float | None = None  # time iteration 0 was committed for good (as metrics.jsonl's step 0)
    last_commit_at: float | None = None  # time of the latest commit
    end_seconds: float = 0.0  # the run's end (horizon, or finished_at)
    # time series, one point per state change (commit batch, stall, rollback, membership)
    s_t: list = field(default_factory=list)
    s_gpuh: list = field(default_factory=list)
    s_tokens: list = field(default_factory=list)
    s_eff: list = field(default_factory=list)
    s_rep: list = field(default_factory=list)

    # ---- GPU-hours -----------------------------------------------------------------
    def gpu_hours_at(self, t: float) -> float:
        return (self.gpu_seconds + self.working * self.job.gpus_per_replica * max(0.0, t - self.t_clock)) / 3600.0

    def set_working(self, t: float, n: int) -> None:
        """The system now holds n replicas (from time t on)."""
        if t > self.t_clock:
            self.gpu_seconds += self.working * self.job.gpus_per_replica * (t - self.t_clock)
            self.t_clock = t
        self.working = n
        self.min_working = min(self.min_working, n)
        self.point(t)

    def point(self, t: float) -> None:
        if self.s_t and t < self.s_t[-1]:
            return  # the series only moves forward (GPU-hours are integrated forward)
        self.s_t.append(t)
        self.s_gpuh.append(self.gpu_hours_at(t))
        self.s_tokens.append(self.tokens)
        self.s_eff.append(self.effective_tokens)
        self.s_rep.append(self.working)

    # ---- commits, checkpoints, rollbacks -------------------------------------------
    def commit(self, n: int, t_start: float, t_end: float, microbatches: float, clean_seconds: float) -> None:
        """n iterations of `microbatches` each, the first starting at t_start, the last ending at t_end."""
        if n <= 0:
            return
        self.point(t_start)
        tok = n * microbatches * self.job.tokens_per_microbatch
        self.iterations += n
        self.tokens += tok
        on_trajectory = abs(microbatches - self.job.microbatches) < 1e-9
        if on_trajectory:
            self.effective_tokens += tok
            self.effective_iterations += n
            self.productive_seconds += n * clean_seconds
            if self.exact:
                self.exact_tokens += tok
        else:
            self.exact = False
        if self.first_commit_at is None:
            self.first_commit_at = t_start + (t_end - t_start) / n
        if self.iterations == n:  # this batch holds iteration 0
            self.step0_at = t_start + (t_end - t_start) / n
        self.last_commit_at = t_end
        self.point(t_end)

    def checkpoint_done(self, t: float) -> None:
        self.checkpoints += 1
        self.snapshot = Snapshot(self.iterations, self.tokens, self.effective_tokens, self.exact_tokens,
                                 self.effective_iterations, self.productive_seconds, self.exact)

    @property
    def since_checkpoint(self) -> int:
        return self.iterations - self.snapshot.iterations

    def rollback(self, t: float) -> int:
        """Back to the last complete checkpoint; returns the iterations lost."""
        s = self.snapshot
        lost = self.iterations - s.iterations
        self.lost_iterations += lost
        self.restarts += 1
        self.iterations, self.tokens, self.effective_tokens = s.iterations, s.tokens, s.effective_tokens
        self.exact_tokens, self.effective_iterations = s.exact_tokens, s.effective_iterations
        self.productive_seconds, self.exact = s.productive_seconds, s.exact
        if s.iterations == 0:
            self.step0_at = None
        self.point(t)
        return lost

    # ---- derived ---------------------------------------------------------------------
    @property
    def wall_seconds(self) -> float:
        return self.end_seconds

    @property
    def gpu_hours(self) -> float:
        return self.gpu_seconds / 3600.0

    @property
    def effective_throughput(self) -> float:
        """Effective tokens per wall second (trajectory-equivalent throughput)."""
        return rates(self.tokens, self.effective_tokens, self.end_seconds, None).trajectory_per_s or 0.0

    @property
    def goodput(self) -> float:
        """Kept tokens per wall second, whatever the trajectory (goodput)."""
        return rates(self.tokens, self.effective_tokens, self.end_seconds, None).goodput_per_s or 0.0

    @property
    def ettr(self) -> float:
        return self.productive_seconds / self.end_seconds if self.end_seconds > 0 else 0.0

    def series(self) -> dict[str, np.ndarray]:
        return {"t": np.asarray(self.s_t), "gpu_hours": np.asarray(self.s_gpuh), "tokens": np.asarray(self.s_tokens),
                "effective_tokens": np.asarray(self.s_eff), "replicas": np.asarray(self.s_rep)}

    def effective_tokens_at(self, t: float) -> float:
        """Effective tokens at time t, read off the series (linear within a commit batch)."""
        return float(interp_last(np.asarray(self.s_t), np.asarray(self.s_eff), t))

    def summary(self) -> dict:
        """The per-system numbers summary.json reports."""
        gh = self.gpu_hours
        return {
            "tokens": self.tokens,
            "effective_tokens": self.effective_tokens,
            "exact_tokens": self.exact_tokens,
            "iterations": self.iterations,
            "effective_iterations": self.effective_iterations,
            "wall_seconds": self.end_seconds,
            "gpu_hours": gh,
            **{k: (v if v is not None else 0.0)
               for k, v in columns(rates(self.tokens, self.effective_tokens, self.end_seconds, gh), "simulator").items()},
            "ettr": self.ettr,
            "failures": self.failures,
            "lost_iterations": self.lost_iterations,
            "restarts": self.restarts,
            "checkpoints": self.checkpoints,
            "final_replicas": self.working,
            "min_replicas": self.min_working,
            "ended": "max_iterations" if self.finished_at is not None
            else ("no replicas left" if self.dead_at is not None else "horizon"),
        }


def interp_last(x: np.ndarray, y: np.ndarray, at: float) -> float:
    """y at x=at, linear between points; where x repeats (a drop), the later value wins."""
    if len(x) == 0:
        return 0.0
    i = int(np.searchsorted(x, at, side="right"))
    if i == 0:
        return float(y[0]) if at >= x[0] else 0.0
    if i >= len(x):
        return float(y[-1])
    x0, x1, y0, y1 = x[i - 1], x[i], y[i - 1], y[i]
    if x1 <= x0:
        return float(y1)
    return float(y0 + (y1 - y0) * (at - x0) / (x1 - x0))
