"""When a launched job is over, and what its verdict is: the launcher's end-of-job policies.

Contract:
- The launcher (core/launch/launcher.py) owns the processes: it starts them, reaps each
  exit into a `ProcessExit`, ticks its hooks and kills what is left. It does not
  decide when the job ends; an `EndPolicy` does. Every tick, after reaping, the
  launcher calls `policy.decide(job)` with a read-only `JobView`; `None` means
  "not over", an `EndVerdict` ends the job with its code and reason.
- An `EndVerdict` with `wait_for_workers` set gives the workers still running
  the launcher's grace period to exit by themselves (they have seen the end)
  before the cleanup kills them; their exits are recorded too.
- A policy never starts, signals or reaps a process. That keeps the one
  process-owning loop in the launcher, and lets a baseline add a policy
  (baselines/supervise.py `UntilWorkersExit`) without reaching into it.

The policies here:
- `CoordinatorEnds` (the default): the job ends when the coordinator exits; its
  code is the verdict. The recover system's coordinator decides the run, with one
  exception the worker decides: a checkpoint writer whose saves kept failing exits
  with code 6 (core/contract/worker_exit.py, core/training/resilient.py), and the job ends at once
  with 1 (the survivors would only hit the same storage, one writer at a time).
- `FailFast`: a plain data-parallel job cannot outlive a worker, so the first
  worker to exit non-zero ends the job with 1; when every worker has exited 0
  the job is done (the coordinator is then a bare store host). A coordinator
  that exits first still ends it, as with `CoordinatorEnds`.
"""
from __future__ import annotations

import subprocess
from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence

from recover.core.contract.worker_exit import EXIT_CHECKPOINTS_FAILED, EXIT_STOPPED


class ExitRecord(Protocol):
    """What a policy reads of one recorded exit (the launcher's `ProcessExit`)."""

    role: str  # "coordinator" or "worker"
    replica: int  # -1 for the coordinator
    pid: int
    returncode: int | None
    how: str  # e.g. "killed by SIGKILL"
    restarted: bool  # a coordinator the launcher restarted: not the job's verdict


@dataclass(frozen=True)
class JobView:
    """What a policy may look at: the job as the launcher last reaped it."""

    live: Mapping[int, subprocess.Popen]  # replica -> worker still running
    exits: Sequence[ExitRecord]  # every exit recorded so far, in order (the coordinator's too)

    def worker_exits(self) -> list[ExitRecord]:
        return [e for e in self.exits if e.role == "worker"]

    def coordinator_exit(self) -> ExitRecord | None:
        """The exit of the job's coordinator (one the launcher restarted does not count)."""
        return next((e for e in self.exits if e.role == "coordinator" and not getattr(e, "restarted", False)), None)


@dataclass(frozen=True)
class EndVerdict:
    """The job is over: its code, why, and whether the workers get a grace period."""

    returncode: int
    reason: str = ""
    wait_for_workers: bool = False


class EndPolicy(Protocol):
    """Decides, from the job's state, whether the job is over."""

    def decide(self, job: JobView) -> EndVerdict | None: ...


def coordinator_verdict(job: JobView) -> EndVerdict | None:
    """The verdict of a job whose coordinator exited, or None while it runs."""
    e = job.coordinator_exit()
    if e is None:
        return None
    return EndVerdict(e.returncode, "" if e.returncode == 0 else f"coordinator {e.how}", wait_for_workers=True)


class CoordinatorEnds:
    """The job ends with its coordinator, whose exit code is the verdict."""

    def decide(self, job: JobView) -> EndVerdict | None:
        for e in job.worker_exits():
            if e.returncode == EXIT_CHECKPOINTS_FAILED:
                return EndVerdict(EXIT_STOPPED, f"replica {e.replica} (pid {e.pid}) stopped the run: its checkpoint "
                                                f"saves failed --checkpoint-failures times in a row")
        return coordinator_verdict(job)


class FailFast:
    """The first worker that fails ends the job; all workers done is success."""

    def decide(self, job: JobView) -> EndVerdict | None:
        for e in job.worker_exits():
            if e.returncode != 0:
                return EndVerdict(1, f"replica {e.replica} (pid {e.pid}) {e.how}")
        verdict = coordinator_verdict(job)
        if verdict is not None:
            return verdict
        if not job.live and job.worker_exits():
            # Every worker finished cleanly; the coordinator (a bare store host
            # here) is stopped by the cleanup.
            return EndVerdict(0)
        return None
