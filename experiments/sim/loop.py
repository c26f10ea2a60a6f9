"""The discrete-event loop shared by every simulated system.

Contract:
- `simulate(policy, events, horizon)` runs one job, already set up in `policy`
  (its job, costs, RunRecord, checkpoint interval, max_iterations and replacement
  delay), against the failure `events` from t=0 until the horizon, until
  `policy.max_iterations` iterations are committed, or until no replica is left, and
  returns the policy's RunRecord with its end time and GPU-hours closed.
- Only failures, replacements and the policy's own stalls and checkpoints are
  events; between them the policy advances whole iterations in closed form, so the
  cost of a run grows with its number of events, not with its number of iterations.
- The loop owns health: a replica is ALIVE, DEAD, or JOINING (a replacement on its
  way); a failure of a replica that is not alive is ignored, and a replacement is
  scheduled `replacement_delay` after a failure (never, if None), then ready after
  the policy's `join_delay`.
- (step, phase) faults of a plan fire where the harness would fire them
  (`phase_offset` inside the iteration the policy predicts); a fault whose target is
  gone is dropped, as the harness would.
- Deterministic: the same inputs give the same record (no randomness in here; the
  failure events are drawn beforehand from a seeded Generator).
"""
from __future__ import annotations

import heapq

import numpy as np

from .failures import FailureEvents, StepFault
from .model import JobModel
from .policy_base import INF, Policy
from .record import RunRecord

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
                                policy.save_stall())
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
