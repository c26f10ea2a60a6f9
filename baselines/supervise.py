"""Pieces the baselines' supervisors share: their result type, and telling a culprit from a bystander.

Contract:
- A supervisor is a function `supervise(cfg, settings, config_path, env, hooks)`
  that runs a whole job in place of one plain `Launcher` (see
  experiments/systems.py) and returns a `SupervisedResult`: a `LaunchResult` whose
  `summary_extra` is merged into DIR/summary.json.
- `FirstFailure` is a `LauncherHooks` observer that notes the first worker exit
  that was not a clean 0: when it was seen (seconds since the run started), and
  which replicas were at fault. A worker killed by a signal or frozen (SIGSTOP) at
  that moment is a culprit; a worker that merely exited with an error because a
  peer vanished under its collective is a bystander. Only if no process was
  killed or frozen is the first one to fail the culprit (it raised by itself).
- `UntilWorkersExit` is the launcher's end-of-job policy (core/launch/end_policy.py)
  for jobs that shrink in place (torchft, TorchElastic agents): one worker's
  failure does not end the job; the job ends when no worker is left, and
  succeeds if any of them finished cleanly.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from recover.core.launch.end_policy import EndVerdict, JobView
from recover.core.launch.launcher import LaunchResult, ProcessExit
from recover.core.launch.replica_processes import ENDED_WITH_THEIR_REPLICA


@dataclass
class SupervisedResult(LaunchResult):
    """A supervisor's verdict over all its launches."""

    summary_extra: dict = field(default_factory=dict)  # merged into summary.json


def proc_status(pid: int) -> tuple[str, int] | None:
    """(state letter, raw wait status of a zombie) from /proc/<pid>/stat; None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(") ", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    # Field 52 (exit_code) holds a zombie's wait status; rest starts at field 3.
    return rest[0], int(rest[49]) if len(rest) > 49 else 0


def killed_or_frozen(pid: int) -> bool:
    """True for a zombie killed by a signal, or a stopped process; not for a rank the launcher
    itself killed because another rank of its replica had ended (a replica of many ranks ends
    whole: that kill is the consequence of the sibling's end, which says whose fault it was)."""
    if pid in ENDED_WITH_THEIR_REPLICA:
        return False
    st = proc_status(pid)
    if st is None:
        return False  # already reaped: we cannot tell, so do not blame it
    state, status = st
    return state == "T" or (state == "Z" and (status & 0x7F) != 0)


class FirstFailure:
    """LauncherHooks: remember the first failing worker and who was to blame."""

    def __init__(self, t0: float):
        self.t0 = t0
        self.pids: dict[int, list[int]] = {}
        self.exit: ProcessExit | None = None
        self.detected_at: float | None = None
        self.culprits: list[int] = []

    def on_start(self, pids: dict[int, list[int]], t0: float) -> None:
        self.pids = {int(r): list(p) for r, p in pids.items()}

    def on_tick(self, elapsed: float) -> None:
        pass

    def on_exit(self, exit: ProcessExit) -> None:
        if self.exit is not None or exit.returncode in (0, None):
            return
        self.exit = exit
        self.detected_at = time.time() - self.t0
        if exit.role != "worker":
            return  # the store host died: nobody among the replicas is to blame
        others = {r for r, pids in self.pids.items() if r != exit.replica and any(map(killed_or_frozen, pids))}
        if exit.returncode < 0:
            others.add(exit.replica)
        self.culprits = sorted(others) if others else [exit.replica]


class UntilWorkersExit:
    """EndPolicy: the job lasts as long as any worker does (systems that shrink in place).

    The plain launcher's job ends with its coordinator; here the coordinator is
    a bare rendezvous service (torchft's lighthouse, TorchElastic's store) that
    never decides the run's end: its exit is noted, the workers decide. The job
    ends when no worker is left running (the ones left, if any, are frozen and
    can never finish; the cleanup kills them). The verdict: 0 if some worker
    finished with 0 (the survivors completed the run), else 1 with how the last
    one ended.
    """

    def decide(self, job: JobView) -> EndVerdict | None:
        workers = job.worker_exits()
        if not workers:
            return None
        frozen = all((proc_status(p.pid) or ("?",))[0] == "T" for p in job.live.values())
        if job.live and not frozen:
            return None
        ok = any(e.returncode == 0 for e in workers)
        last = workers[-1]
        reason = "" if ok else f"no replica finished (last: replica {last.replica} {last.how})"
        if job.live and not ok:
            reason += f"; replicas {sorted(job.live)} frozen"
        return EndVerdict(0 if ok else 1, reason)
