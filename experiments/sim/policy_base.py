"""The policy base class: a system's semantics over the shared event loop (loop.py).

Contract:
- The loop owns health (which replicas are alive) and replacement; a `Policy` owns a
  system's semantics: what a failure costs (`on_failure`), what a replacement does
  (`on_join`), what an iteration contains (`microbatches_per_iteration`), when it
  checkpoints (`after_commit`, `checkpoint_due`). Subclasses, one per system, are in
  system_policies.py and fill in the hooks marked below.
- State: the system is either *stalled* until `resume_at` (startup, restart,
  checkpoint save, membership change) or *running* the iteration [cur_start,
  cur_end). `advance(t)` commits every iteration that ends by t in closed form: an
  iteration with the same members always takes iteration_seconds(), so whole runs
  of identical iterations commit at once and a run costs per event, not per
  iteration.
- `predict_iteration(step)` says when iteration `step` would run if nothing else
  happened, so that (step, phase) faults fire where the harness would fire them.
- `settings` are the system's BaselineConfig fields that the variant sets
  (experiments.labels), e.g. elastic's elastic_batch.
"""
from __future__ import annotations

import math
from typing import Any

from .costs import Costs, save_stall_seconds
from .model import JobModel
from .record import RunRecord

INF = float("inf")


class Policy:
    """A system's semantics over the shared loop (see the module docstring)."""

    name = "?"
    admits_at_commit = False  # replacements join at the next commit (else: at the next restart)

    def __init__(self, job: JobModel, costs: Costs, run: RunRecord, checkpoint_every: int = 0,
                 max_iterations: int | None = None, replacement_delay: float | None = None,
                 wait_for_replacement: bool = False, mtbf_seconds: float = INF,
                 settings: dict[str, Any] | None = None):
        self.job, self.costs, self.run = job, costs, run
        self.settings = dict(settings or {})  # the variant's BaselineConfig fields
        self.mtbf_seconds = mtbf_seconds  # expected seconds between failures (for restart-or-not choices)
        self.K = checkpoint_every  # iterations between checkpoints (0 = none)
        self.max_iterations = max_iterations
        self.replacement_delay = replacement_delay  # None: failed replicas never come back
        self.wait_for_replacement = wait_for_replacement  # a restart waits for the replacement
        self.members: set[int] = set(range(job.replicas))  # replicas in the system's working set
        self.pending: set[int] = set()  # replacements ready, waiting to be admitted
        self.resume_at: float | None = costs.startup_seconds  # stalled until (None = running)
        self.launched = False  # the first launch (startup_seconds) is over
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
                self.launched = True
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

    def save_stall(self) -> float:
        """What one checkpoint stalls training: a blocking save, or with the setting ckpt_async the
        async save's snapshot (costs.save_stall_seconds)."""
        return save_stall_seconds(self.costs, bool(self.settings.get("ckpt_async", False)))

    def checkpoint_due(self, t: float) -> bool:
        """Start a blocking save at t if K iterations have passed since the last checkpoint."""
        if self.K and self.run.since_checkpoint >= self.K:
            self.saving = True
            self.stall(t + self.save_stall())
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
                t += self.save_stall()
                since = 0
            start, end = t, t + T
            j += 1
            if j - i > 100_000:
                return None
        return start, end

    def on_resume_is_noop(self) -> bool:
        return not self.pending
