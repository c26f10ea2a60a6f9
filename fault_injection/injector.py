"""The injector: makes a plan's faults really happen, inside the workers and from the launcher.

Contract:
- `worker_hooks(cfg, replica, rank)` is the factory core loads by name
  (`TrainConfig.hooks = WORKER_HOOKS`; core never imports this module). It reads
  the run's saved plan, DIR/fault_plan.json, and returns a `FaultInjector` armed
  with the faults that target this (replica, rank) and have not fired yet in this
  run (DIR/faults.jsonl): a restarted worker that replays steps does not fire a
  fault twice.
- A point fault fires at the first hook call matching its (step, phase[,
  microbatch]); one in a microbatch phase that this replica's step never reached
  (its quota was shorter) fires at the step's "commit" point instead (see
  fault_injection.plan). It is recorded in DIR/faults.jsonl (fsync'd) *before* it takes
  effect, and then it is real: the injector runs its kind's worker-side action
  from the kinds table (fault_injection.kinds), e.g.
    crash            SIGKILL of this process;
    hang             SIGSTOP of this process (the launcher-side hooks SIGCONT it
                     after `seconds`; without `seconds` it stays frozen);
    slow             from then on every microbatch takes `factor` times as long
                     (microbatch_done sleeps (factor-1) x the measured time);
    pace             from then on every microbatch lasts at least `seconds`
                     (microbatch_done sleeps out the rest);
    collective_error the all-reduce in flight fails: `at(step, "allreduce")`
                     raises `InjectedLinkError`, which core's Communicator turns
                     into a CollectiveError, as a broken link would;
    bitflip          one bit of one weight flips in place (the weights the trainer
                     attached with `attach_weights`): silent data corruption;
    broken_link      the same, and every later all-reduce of this worker fails
                     too, for `seconds` after it fired (absent: for good); it
                     is recorded once, when it first fires;
    replica_loss     SIGKILL of the replica's whole process group at once (the
                     launcher starts every replica in a group of its own);
    coordinator_crash / coordinator_hang
                     SIGKILL / SIGSTOP of the coordinator process (its PID from
                     DIR/pids.json), pulled by this worker at its step and phase.
  A restarted worker re-applies the kind's `on_restart` for faults that already
  fired (a straggler stays slow). The injector assumes nothing about the trainer beyond the hook calls, so the
  plain trainer, the resilient one (which repeats a step's points on recovery)
  and the baselines all get the same faults.
- `FaultLauncherHooks` (a core.launch.launcher.LauncherHooks) fires the wall-clock
  faults of every kind with a launcher-side action (crash/hang/replica_loss) by
  PID when their time comes, running that action, and ends every timed freeze
  (a kind that `freezes`: hang) - whoever froze it - by SIGCONT once `seconds`
  have passed since its record, and only once the process is really stopped (a SIGCONT that
  overtook the SIGSTOP would leave it frozen for good).
- `CoordinatorInjector` (the coordinator's hooks, `coordinator_hooks(cfg)` by the
  name COORDINATOR_HOOKS) fires the faults planned at a coordinator phase inside
  the coordinator: "commit_sent", right after the step's commit went to the
  named replica, so the others never hear it from this process (mid-commit).
- Nothing here imports torch: the injector lives in every worker and in the
  launcher, and costs them nothing when no plan is given.
"""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from recover.core.launch.hooks import COORDINATOR_PHASES, CoordinatorHooks, WorkerHooks
from recover.core.launch.launcher import ProcessExit
from recover.core.launch.startup import run_start_time

from .kinds import KINDS, InjectedLinkError, coordinator_pid, kill_own_replica, link_still_broken
from .plan import MICROBATCH_PHASES, Fault, FaultPlan, load_plan, validate_plan
from .record import PLAN_FILE, FAULTS_FILE, append_record, fault_record, fired_indices

__all__ = ["WORKER_HOOKS", "COORDINATOR_HOOKS", "CoordinatorInjector", "coordinator_hooks", "InjectedLinkError", "kill_own_replica", "process_state", "FaultInjector",
           "FaultLauncherHooks", "plan_of_run", "worker_hooks", "attach_plan", "launcher_hooks"]

WORKER_HOOKS = "recover.fault_injection.injector:worker_hooks"
COORDINATOR_HOOKS = "recover.fault_injection.injector:coordinator_hooks"


def process_state(pid: int) -> str | None:
    """The one-letter state in /proc/<pid>/stat (R, S, T, Z, ...), or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


# ---- inside a worker ----------------------------------------------------------------------
class FaultInjector(WorkerHooks):
    """WorkerHooks that fire the faults planned for one (replica, rank)."""

    def __init__(self, plan: FaultPlan, replica: int, rank: int, out_dir: str | os.PathLike, t0: float | None = None):
        self.out = Path(out_dir)
        self.replica = replica
        self.rank = rank
        self.t0 = run_start_time() if t0 is None else t0
        fired = fired_indices(self.out)
        mine = [
            (i, f) for i, f in enumerate(plan.faults)
            if f.replica == replica and f.rank == rank and not f.fired_by_launcher
            and f.phase not in COORDINATOR_PHASES  # the coordinator fires those itself (CoordinatorInjector)
        ]
        self.pending: list[tuple[int, Fault]] = [(i, f) for i, f in mine if i not in fired]
        self.slow_factor = 1.0
        self.pace_seconds = 0.0
        self.weights = None  # set by attach_weights: what a bitflip corrupts
        self.link_broken_until = 0.0
        self.spoil_vote = False  # set by a bad_vote fault: the next vote goes out without its loss_sum
        # A straggler stays one across a restart of its worker: the fault fired
        # once, but the slow device it stands for is still slow.
        for i, f in mine:
            if i in fired and f.spec.on_restart is not None:
                f.spec.on_restart(self, f)

    def _due(self, f: Fault, step: int, phase: str, microbatch: int | None) -> bool:
        if f.wall_clock:
            if f.spec.at_phase is not None and phase != f.spec.at_phase:
                return False  # armed: it strikes at the first such phase after its time
            return time.time() - self.t0 >= f.at_seconds
        if f.step == step and f.phase == phase and (f.microbatch is None or f.microbatch == microbatch):
            return True
        # Its microbatch never came: this replica folded fewer in the step (a shorter
        # quota). Reaching the step's commit means no more will come, so it fires there.
        return f.step == step and phase == "commit" and f.phase in MICROBATCH_PHASES

    def at(self, step: int, phase: str, microbatch: int | None = None) -> None:
        if phase == "allreduce" and self.link_broken_until:
            link_still_broken(self)
        if not self.pending:
            return
        for entry in list(self.pending):
            i, f = entry
            if self._due(f, step, phase, microbatch):
                self.pending.remove(entry)  # before firing: a raise must not leave it armed
                self._fire(i, f, step, phase, microbatch)

    def attach_weights(self, weights: Any) -> None:
        self.weights = weights

    def microbatch_done(self, step: int, microbatch: int, seconds: float) -> None:
        extra = (self.slow_factor - 1.0) * seconds if self.slow_factor > 1.0 else 0.0
        extra = max(extra, self.pace_seconds - seconds)
        if extra > 0:
            time.sleep(extra)

    def outgoing_vote(self, vote: dict) -> dict:
        if not self.spoil_vote:
            return vote
        self.spoil_vote = False
        return {k: v for k, v in vote.items() if k != "loss_sum"}

    def _fire(self, index: int, f: Fault, step: int, phase: str, microbatch: int | None) -> None:
        pid = coordinator_pid(self.out) if f.spec.targets_coordinator else os.getpid()
        append_record(self.out, fault_record(index, f, pid, self.t0, step, phase, microbatch))
        f.spec.worker(self, index, f, step)


def plan_of_run(cfg: Any) -> FaultPlan | None:
    """The plan a worker of `cfg` injects: DIR/fault_plan.json, else cfg.faults, else none."""
    saved = Path(cfg.out) / PLAN_FILE
    if saved.exists():
        return load_plan(saved)
    if getattr(cfg, "faults", ""):
        return load_plan(cfg.faults)
    return None


def worker_hooks(cfg: Any, replica: int, rank: int = 0) -> WorkerHooks:
    """The "module:function" factory named by WORKER_HOOKS (cfg needs only .out and .faults)."""
    plan = plan_of_run(cfg)
    if plan is None:
        return WorkerHooks()
    return FaultInjector(plan, replica, rank, cfg.out)


# ---- inside the coordinator ---------------------------------------------------------------------
class CoordinatorInjector(CoordinatorHooks):
    """Fires the faults planned at a coordinator phase ("commit_sent"), in the coordinator itself."""

    def __init__(self, plan: FaultPlan, out_dir: str | os.PathLike, t0: float | None = None):
        self.out = Path(out_dir)
        self.t0 = run_start_time() if t0 is None else t0
        fired = fired_indices(self.out)  # a restarted coordinator does not fire one twice
        self.pending = [(i, f) for i, f in enumerate(plan.faults)
                        if f.phase in COORDINATOR_PHASES and i not in fired]

    def after_send(self, msg: dict, replica: int) -> None:
        if not self.pending or msg.get("t") != "commit":
            return
        for entry in list(self.pending):
            i, f = entry
            if f.phase == "commit_sent" and msg.get("step") == f.step and replica == f.replica:
                self.pending.remove(entry)
                append_record(self.out, fault_record(i, f, os.getpid(), self.t0, f.step, f.phase,
                                                     fired_by="coordinator"))
                os.kill(os.getpid(), f.spec.coordinator_signal)


def coordinator_hooks(cfg: Any) -> CoordinatorHooks | None:
    """The "module:function" factory named by COORDINATOR_HOOKS (cfg needs only .out and .faults)."""
    plan = plan_of_run(cfg)
    if plan is None or not any(f.phase in COORDINATOR_PHASES for f in plan.faults):
        return None
    return CoordinatorInjector(plan, cfg.out)


# ---- in the launcher --------------------------------------------------------------------------
class FaultLauncherHooks:
    """Launcher-side half of the injector: wall-clock faults by PID, and the end of timed hangs."""

    def __init__(self, plan: FaultPlan, out_dir: str | os.PathLike, t0: float | None = None):
        self.plan = plan
        self.out = Path(out_dir)
        self.t0 = t0  # the run's start on the time.time() clock (None: when the launcher started)
        self.pids: dict[int, list[int]] = {}
        self.due: list[tuple[int, Fault]] = []
        self.dead: set[int] = set()
        self.resume_at: dict[int, float] = {}  # pid -> time.time() at which to SIGCONT it
        self.skipped: list[tuple[int, str]] = []  # (index, why) of wall-clock faults that found no target
        self._offset = 0  # how far faults.jsonl has been read

    def on_start(self, pids: dict[int, list[int]], t0: float) -> None:
        if self.t0 is None:
            self.t0 = time.time() - (time.monotonic() - t0)
        self.pids = {int(r): list(ps) for r, ps in pids.items()}
        fired = fired_indices(self.out)
        self.due = sorted(
            ((i, f) for i, f in enumerate(self.plan.faults) if f.fired_by_launcher and i not in fired),
            key=lambda e: (e[1].at_seconds, e[0]),
        )

    def on_tick(self, elapsed: float) -> None:
        now = time.time() - self.t0
        while self.due and self.due[0][1].at_seconds <= now:
            self._fire(*self.due.pop(0))
        self._scan_hangs()
        self._resume_due()

    def on_exit(self, exit: ProcessExit) -> None:
        self.dead.add(exit.pid)
        self.resume_at.pop(exit.pid, None)

    def _fire(self, index: int, f: Fault) -> None:
        pids = self.pids.get(f.replica, [])
        if f.rank >= len(pids):
            self.skipped.append((index, f"replica {f.replica} has no rank {f.rank} known to the launcher"))
            return
        pid = pids[f.rank]
        if pid in self.dead or process_state(pid) in (None, "Z"):
            self.skipped.append((index, f"replica {f.replica} rank {f.rank} (pid {pid}) had already exited"))
            return
        append_record(self.out, fault_record(index, f, pid, self.t0, fired_by="launcher"))
        try:
            f.spec.launcher(pid, pids)
        except ProcessLookupError:  # it exited between the check and the signal
            pass

    def _scan_hangs(self) -> None:
        """Schedule the SIGCONT of every timed freeze (a hang) recorded since the last look."""
        path = self.out / FAULTS_FILE
        try:
            with open(path, "rb") as fh:
                fh.seek(self._offset)
                chunk = fh.read()
        except FileNotFoundError:
            return
        end = chunk.rfind(b"\n") + 1  # only whole lines; a partial one is read next time
        self._offset += end
        for line in chunk[:end].splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            kind = KINDS.get(rec.get("kind"))
            if kind is not None and kind.freezes and rec.get("seconds") is not None and rec.get("pid") not in self.dead:
                self.resume_at[int(rec["pid"])] = float(rec["time"]) + float(rec["seconds"])

    def _resume_due(self) -> None:
        now = time.time()
        for pid, when in list(self.resume_at.items()):
            if now < when:
                continue
            state = process_state(pid)
            if state in (None, "Z"):
                del self.resume_at[pid]
            elif state in ("T", "t") or not Path("/proc").is_dir():
                os.kill(pid, signal.SIGCONT)
                del self.resume_at[pid]
            # else: it wrote its record but has not stopped itself yet; next tick


# ---- wiring a run ----------------------------------------------------------------------------
def attach_plan(cfg: Any) -> FaultPlan | None:
    """Load and validate cfg.faults for this run, and point cfg.hooks at the injector.

    Returns None (and changes nothing) when the run has no plan; raises PlanError
    for a bad one, before anything starts.
    """
    if not cfg.faults:
        return None
    plan = load_plan(cfg.faults)
    validate_plan(plan, cfg.replicas, cfg.steps, cfg.microbatches, ranks_per_replica=getattr(cfg, "ranks_per_replica", 1))
    cfg.hooks = WORKER_HOOKS
    cfg.coordinator_hooks = COORDINATOR_HOOKS
    return plan


def launcher_hooks(plan: FaultPlan, out_dir: str | os.PathLike, t0: float | None = None) -> FaultLauncherHooks:
    """Save the plan as DIR/fault_plan.json (the workers read it there) and return the launcher's hooks."""
    plan.save(Path(out_dir) / PLAN_FILE)
    return FaultLauncherHooks(plan, out_dir, t0)
