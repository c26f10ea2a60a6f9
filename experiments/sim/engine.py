"""The discrete-event loop shared by every simulated system, and what a run records.

Contract:
- `simulate(policy, job, costs, events, horizon, ...)` runs one job from t=0 until the
  horizon, until `max_iterations` iterations are committed, or until no replica is
  left. Only failures, replacements and the policy's own stalls and checkpoints are
  events; between them the policy advances whole iterations in closed form (an
  iteration with r replicas always takes job.iteration_seconds(r)), so the cost of a
  run grows with its number of events, not with its number of iterations.
- The loop owns health (which replicas are alive) and replacement; a `Policy` owns
  a system's semantics: what a failure costs, what an iteration contains, when it
  checkpoints. Policies are in policies.py, one small class per system.
- `RunRecord` is the accounting, the same for every system. Definitions:
  * an iteration is *committed* when its update is applied; a checkpointing system
    that rolls back removes the iterations since its checkpoint (they count as lost);
  * *tokens*: tokens of all committed iterations still kept at the end;
  * *effective tokens*: tokens of kept iterations that processed exactly M
    microbatches: the iterations whose gradient is the failure-free run's (ids t*M ..
    t*M+M-1, issue 4). A system that shrinks the global batch (elastic-shrink,
    torchft) commits off-trajectory iterations while replicas are missing; they add
    tokens but no effective tokens;
  * *exact tokens*: effective tokens committed before the first off-trajectory
    iteration: after it the weights differ from the failure-free run's for good;
  * *wall seconds*: the horizon, or the time of the last commit when the run stops at
    max_iterations. A run whose last replica dies still counts the whole horizon;
  * *GPU-hours*: the integral of the GPUs of the replicas a system holds (working,
    restarting or idle in a stall, not yet dead) over wall time;
  * *ETTR* (effective training time ratio): the failure-free duration of every kept
    effective iteration, with the replica count it committed with, over wall seconds;
  * *effective throughput*: effective tokens per wall second, and per GPU-hour.
- Deterministic: the same inputs give the same record (no randomness in here; the
  failure events are drawn beforehand from a seeded Generator).
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .failures import FailureEvents, StepFault
from .model import JobModel

if TYPE_CHECKING:
    from .calibration import Costs

INF = float("inf")


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
        """Effective tokens per wall second."""
        return self.effective_tokens / self.end_seconds if self.end_seconds > 0 else 0.0

    @property
    def ettr(self) -> float:
        return self.productive_seconds / self.end_seconds if self.end_seconds > 0 else 0.0

    def series(self) -> dict[str, np.ndarray]:
        return {"t": np.asarray(self.s_t), "gpu_hours": np.asarray(self.s_gpuh), "tokens": np.asarray(self.s_tokens),
                "effective_tokens": np.asarray(self.s_eff), "replicas": np.asarray(self.s_rep)}

    def effective_tokens_at(self, t: float) -> float:
        """Effective tokens at time t, read off the series (linear within a commit batch)."""
        return float(_interp_last(np.asarray(self.s_t), np.asarray(self.s_eff), t))

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
            "effective_throughput_tokens_per_s": self.effective_throughput,
            "effective_tokens_per_gpu_hour": self.effective_tokens / gh if gh > 0 else 0.0,
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


def _interp_last(x: np.ndarray, y: np.ndarray, at: float) -> float:
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


# ---- policies' common machinery -------------------------------------------------------
class Policy:
    """A system's semantics over the shared loop. Subclasses fill in the hooks marked below.

    State: the system is either *stalled* until `resume_at` (startup, restart, checkpoint
    save, membership change) or *running* the iteration [cur_start, cur_end). Advancing
    commits every iteration that ends by the target time, whole runs of identical
    iterations at once.
    """

    name = "?"
    admits_at_commit = False  # replacements join at the next commit (else: at the next restart)

    def __init__(self, job: JobModel, costs: "Costs", run: RunRecord, checkpoint_every: int = 0,
                 max_iterations: int | None = None, replacement_delay: float | None = None,
                 wait_for_replacement: bool = False, mtbf_seconds: float = INF):
        self.job, self.costs, self.run = job, costs, run
        self.mtbf_seconds = mtbf_seconds  # expected seconds between failures (for restart-or-not choices)
        self.K = checkpoint_every  # iterations between checkpoints (0 = none)
        self.max_iterations = max_iterations
        self.replacement_delay = replacement_delay  # None: failed replicas never come back
        self.wait_for_replacement = wait_for_replacement  # a restart waits for the replacement
        self.members: set[int] = set(range(job.replicas))  # replicas in the system's working set
        self.pending: set[int] = set()  # replacements ready, waiting to be admitted
        self.resume_at: float | None = costs.startup_seconds  # stalled until (None = running)
        self.saving = False  # the current stall is a checkpoint save
        self.just_saved = False  # the stall that just ended was a checkpoint save
        self.cur_start = self.cur_end = 0.0
        self.dead = False
        run.working = run.min_working = job.replicas
        run.point(0.0)

    # -- hooks -------------------------------------------------------------------------
    @property
    def join_delay(self) -> float:
        """Seconds from a replacement's arrival until it is ready to be admitted."""
        return 0.0

    def microbatches_per_iteration(self) -> float:
        """Microbatches of one fresh iteration with the current members."""
        return float(self.job.microbatches)

    def iteration_seconds(self) -> float:
        """Duration of one fresh iteration with the current members."""
        return self.job.iteration_seconds(len(self.members), self.microbatches_per_iteration())

    def on_failure(self, t: float, replica: int, kind: int) -> None:
        raise NotImplementedError

    def on_join(self, t: float, replica: int) -> None:
        raise NotImplementedError

    def on_resume(self, t: float) -> bool:
        """A stall ended at t; return True to stay stalled (a new resume_at was set)."""
        return False

    def after_commit(self, t: float) -> None:
        """Called after a commit batch ending at t (may start a stall)."""

    # -- shared ------------------------------------------------------------------------
    def start_iteration(self, t: float) -> None:
        self.cur_start = t
        self.cur_end = t + self.iteration_seconds()

    def batch_limit(self) -> int:
        """Most iterations that may commit before something must happen (checkpoint, stop)."""
        lim = 1 << 62
        if self.pending and self.admits_at_commit:
            return 1  # a replacement waits for the very next commit, not the end of a batch
        if self.max_iterations is not None:
            lim = self.max_iterations - self.run.iterations
        if self.K:
            lim = min(lim, self.K - self.run.since_checkpoint)
        return max(lim, 1)

    def stall(self, until: float) -> None:
        self.resume_at = until

    def advance(self, t: float) -> None:
        """Progress to time t in closed form (stop early at max_iterations)."""
        run = self.run
        while not self.dead and run.finished_at is None:
            if self.resume_at is not None:
                if self.resume_at > t:
                    return
                start, self.resume_at = self.resume_at, None
                self.just_saved = self.saving
                if self.saving:
                    self.saving = False
                    run.checkpoint_done(start)
                if self.on_resume(start):
                    continue
                self.start_iteration(start)
                continue
            if self.cur_end > t:
                return
            # The current iteration commits; so do the identical ones that fit before t.
            T = self.iteration_seconds()
            mb = self.microbatches_per_iteration()
            clean = T
            limit = self.batch_limit()
            extra = 0
            if limit > 1 and T > 0:
                fit = (t - self.cur_end) / T
                extra = limit - 1 if fit >= limit - 1 else int(math.floor(fit))
            run.commit(1, self.cur_start, self.cur_end, mb, clean)
            end = self.cur_end
            if extra > 0:
                run.commit(extra, end, end + extra * T, mb, clean)
                end = end + extra * T
            if self.max_iterations is not None and run.iterations >= self.max_iterations:
                run.finished_at = end
                return
            self.after_commit(end)
            if self.resume_at is None:
                self.start_iteration(end)

    def checkpoint_due(self, t: float) -> bool:
        """Start a blocking save at t if K iterations have passed since the last checkpoint."""
        if self.K and self.run.since_checkpoint >= self.K:
            self.saving = True
            self.stall(t + self.costs.checkpoint_save_seconds)
            return True
        return False

    def predict_iteration(self, step: int) -> tuple[float, float] | None:
        """(start, end) of iteration `step` if nothing else happens; None if already past.

        Used to fire (step, phase) faults: walks forward through commits and checkpoint saves.
        """
        i = self.run.iterations
        if step < i or self.dead:
            return None
        T = self.iteration_seconds()
        if self.resume_at is not None:
            if self.resume_at == INF or not self.on_resume_is_noop():
                return None  # a membership stall: predict again after it
            start, end = self.resume_at, self.resume_at + T
            since = 0 if self.saving else self.run.since_checkpoint
        else:
            start, end = self.cur_start, self.cur_end
            since = self.run.since_checkpoint
        j = i
        while j < step:
            if self.max_iterations is not None and j + 1 >= self.max_iterations:
                return None
            since += 1
            t = end
            if self.K and since >= self.K:
                t += self.costs.checkpoint_save_seconds
                since = 0
            start, end = t, t + T
            j += 1
            if j - i > 100_000:
                return None
        return start, end

    def on_resume_is_noop(self) -> bool:
        return not self.pending


# ---- the loop -------------------------------------------------------------------------
ALIVE, DEAD, JOINING = 0, 1, 2


def phase_offset(phase: str, microbatch: int | None, start: float, end: float, job: JobModel, r: int,
                 checkpoint_seconds: float) -> float:
    """When, inside iteration [start, end), a (phase, microbatch) fault point falls."""
    ar = job.allreduce_seconds(r)
    tmb = job.microbatch_time(r)
    compute_end = max(start, end - ar)
    k = microbatch if microbatch is not None else (1 if phase == "between_microbatches" else 0)
    if phase == "forward":
        return min(compute_end, start + k * tmb)
    if phase == "backward":  # after the forward pass: a third of a microbatch in
        return min(compute_end, start + (k + 1 / 3) * tmb)
    if phase == "between_microbatches":
        return min(compute_end, start + k * tmb)
    if phase == "allreduce":
        return compute_end + ar / 2
    if phase == "commit":  # voted, not yet committed: the iteration is still lost/redone
        return end - min(1e-6, (end - start) / 2)
    if phase == "optimizer_step":  # committed: the fault hits the next iteration's start
        return end
    if phase == "checkpoint_save":
        return end + checkpoint_seconds / 2
    raise ValueError(f"unknown phase {phase!r}")


def simulate(policy: Policy, events: FailureEvents, horizon: float) -> RunRecord:
    """Run `policy` against `events` until the horizon (seconds) and return its record."""
    run, job = policy.run, policy.job
    replacement_delay = policy.replacement_delay
    state = np.zeros(job.replicas, dtype=np.int8)
    incarnation = np.zeros(job.replicas, dtype=np.int64)
    heap: list[tuple[float, int, int, int, int]] = []  # (time, seq, kind, replica, incarnation)
    seq = 0
    ARRIVE, READY = 0, 1
    times, reps, kinds = events.times, events.replicas, events.kinds
    n_timed, fi = len(times), 0
    step_faults = list(events.step_faults)

    def next_step_fault() -> tuple[float, StepFault] | None:
        while step_faults:
            f = step_faults[0]
            if f.replica >= job.replicas or state[f.replica] != ALIVE or f.replica not in policy.members:
                step_faults.pop(0)  # its target is gone: the harness would not fire it
                continue
            span = policy.predict_iteration(f.step)
            if span is None:
                if f.step < run.iterations:
                    step_faults.pop(0)
                    continue
                return None
            when = phase_offset(f.phase, f.microbatch, span[0], span[1], job, len(policy.members),
                                policy.costs.checkpoint_save_seconds)
            return when, f
        return None

    def fail(t: float, replica: int, kind: int) -> None:
        nonlocal seq
        if replica >= job.replicas:
            return
        if state[replica] == ALIVE:
            state[replica] = DEAD
            run.failures += 1
            policy.on_failure(t, replica, kind)
        elif state[replica] == JOINING:
            state[replica] = DEAD
            incarnation[replica] += 1  # its pending READY is stale now
        else:
            return
        if replacement_delay is not None:
            heapq.heappush(heap, (t + replacement_delay, seq, ARRIVE, replica, int(incarnation[replica])))
            seq += 1

    while not policy.dead and run.finished_at is None:
        t_timed = times[fi] if fi < n_timed else INF
        t_heap = heap[0][0] if heap else INF
        sf = next_step_fault() if step_faults else None
        t_step = sf[0] if sf else INF
        t = min(t_timed, t_heap, t_step)
        if t >= horizon or t == INF:
            break
        policy.advance(t)
        if run.finished_at is not None or policy.dead:
            break
        if t_step <= t_timed and t_step <= t_heap and sf is not None:
            step_faults.pop(0)
            fail(t, sf[1].replica, sf[1].kind)
        elif t_timed <= t_heap:
            fail(t, int(reps[fi]), int(kinds[fi]))
            fi += 1
        else:
            _, _, what, replica, inc = heapq.heappop(heap)
            if inc != incarnation[replica] or state[replica] == ALIVE:
                continue
            if what == ARRIVE:
                state[replica] = JOINING
                heapq.heappush(heap, (t + policy.join_delay, seq, READY, replica, inc))
                seq += 1
            else:
                state[replica] = ALIVE
                policy.on_join(t, replica)
    if not policy.dead and run.finished_at is None:
        policy.advance(horizon)
    if policy.dead and run.dead_at is None:
        run.dead_at = run.t_clock
    end = run.finished_at if run.finished_at is not None else horizon
    if end == INF:  # no horizon and never finished: the run ended when it died
        end = run.last_commit_at or run.t_clock
    run.set_working(end, run.working)
    run.end_seconds = end
    return run
