"""`--replace-after` on Slurm: task 0 of a run's job replaces a lost replica with a job of its own.

Contract:
- A node that fails leaves a --no-kill job's allocation for good, and a task slot whose
  worker exited is not started again, so a lost replica cannot come back inside the run's
  job. Task 0 (which hosts the coordinator) submits a one-node replacement job for it
  instead: K tasks (the replica's ranks), the run's own Slurm options, excluding the nodes
  of the run's job where a replica still runs (they are full; a node whose replicas are all
  lost may take it). Slurm starts it when a
  node is free (e.g. when the failed node returns); its tasks run the replica's ranks with
  the coordinator's address and join token from the job's sync directory, numbered as the
  local launcher numbers a slot's process sets (RECOVER_INCARNATION n: the n-th
  replacement of the slot), and join the running job as newcomers, healed by state
  transfer (rank to rank for a replica of many ranks).
- A replica is lost when one of its ranks exited non-zero (its task's done marker), or its
  node left the run's job (squeue's node list: Slurm excised a failed node); a
  replacement is lost when one of its ranks exited non-zero, or its job ended while the run
  goes on without a word from its ranks (ranks that all exited 0 saw the run end). Either
  is replaced `replace_after` seconds later, later each time a replacement
  died at once (`replacement_delay`, as the local launcher), and not after
  MAX_QUICK_DEATHS such deaths in a row.
- Every wait is bounded by Slurm's own account: a replacement job pending for a reason no
  time lifts (`NEVER_STARTS`), or pending past `start_timeout_min` (when set), is
  cancelled with one line saying why, and the run goes on without it (the coordinator's
  --min-replicas wait is bounded by its --startup-timeout). Slurm is asked at most every
  `poll_s`.
- When the run ends (`close`): a replacement still pending is cancelled; a running one is
  given the workers' own bound for a coordinator that is gone (`reconnect_timeout`) to
  report its ranks' exits, then cancelled; no replacement job is left in the queue.
  `record()` says what became of each one (for summary.json).
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from recover.core.launch.launcher import MAX_QUICK_DEATHS, QUICK_DEATH_SECONDS, replacement_delay

# Not launch_submitit (which starts this): what runs a replacement's tasks is given (`task_body`).
from .slurm_queue import NEVER_STARTS, SLURM_LIVE, job_state as _job_state, pending_reason as _pending_reason

CANCEL_WAIT_S = 30.0  # at most this long for a cancelled job to leave the queue (Slurm's KillWait, and then some)


@dataclass
class ReplaceOptions:
    """How task 0 submits a replacement job (built by the submitter from its SlurmOptions)."""

    folder: str  # submitit's folder: the replacement job's script, logs and pickled call
    params: dict[str, Any]  # submitit executor parameters of a one-node job of the replica's K ranks
    poll_s: float = 5.0  # how often Slurm is asked about the run's job and its replacements
    start_timeout_min: float = 0.0  # cancel a replacement still pending after this long (0: no limit)


@dataclass
class Replacement:
    """One replacement job of a replica slot, and what became of it."""

    replica: int  # the slot it fills
    incarnation: int  # its process set's number in the slot (RECOVER_INCARNATION; 1 for the first)
    job_id: str  # its Slurm job
    submitted_at: float  # seconds since the run's t0
    state: str = "PENDING"  # Slurm's last word on it
    started_at: float | None = None  # seconds since t0 it was first seen running: RUNNING, or a task's start marker (None: never)
    outcome: str = ""  # '' while it may still run; else how it ended, in words


@dataclass
class SlurmReplacements:
    """Task 0's bookkeeping of a run's lost replicas and their replacement jobs (see the module docstring)."""

    task: Any  # task 0 of the run's job (launch_submitit.SlurmTask)
    root: str  # the grid's results root (the replacement's tasks find the run's directory under it)
    opts: ReplaceOptions
    replace_after: float  # seconds between a loss and its replacement's submission
    reconnect_timeout: float  # the workers' bound on reaching a coordinator that is gone
    t0: float  # the run's clock (time.time() at its start)
    task_body: Callable[..., Any]  # each task of a replacement job (launch_submitit.replacement_task)
    jobs: list[Replacement] = field(default_factory=list)
    _due: dict[int, float] = field(default_factory=dict)  # replica -> monotonic time its next replacement is submitted
    _quick_deaths: dict[int, int] = field(default_factory=dict)  # replica -> its replacements that died at once, in a row
    _given_up: set[int] = field(default_factory=set)  # slots left empty (a job that cannot start, a crash loop)
    _next_poll: float = 0.0  # monotonic time Slurm may be asked again
    _stop: threading.Event = field(default_factory=threading.Event)  # set by `close`: the watching thread ends
    _thread: threading.Thread | None = None  # the watching thread (`start`)

    def _say(self, line: str) -> None:
        print(f"[slurm replacements {time.time() - self.t0:8.3f}s] {line}", file=sys.stderr, flush=True)

    def _current(self, replica: int) -> Replacement | None:
        mine = [j for j in self.jobs if j.replica == replica]
        return mine[-1] if mine else None

    def _done_codes(self, folder: Path) -> dict[int, int]:
        codes = {}
        for p in folder.glob("done-*"):
            try:
                codes[int(p.name.split("-")[1])] = int(p.read_text() or 1)
            except ValueError:  # being written
                pass
        return codes

    def _started(self, job: Replacement) -> bool:
        """Whether one of the job's tasks has started (its marker; see `_follow`)."""
        return any(self.replacement_dir(job.replica, job.incarnation).glob("started-*"))

    def replacement_dir(self, replica: int, incarnation: int) -> Path:
        """Where a replacement's ranks leave their done markers (in the run's job's sync directory)."""
        return self.task.sync / f"replacement-{replica}-{incarnation}"

    # ---- losses ---------------------------------------------------------------------------
    def _job_nodes(self) -> set[str] | None:
        """The nodes the run's job holds now (None when Slurm did not say)."""
        try:
            listed = subprocess.run(["squeue", "-h", "-j", self.task.job_id, "-o", "%N"], capture_output=True,
                                    text=True, timeout=30).stdout.strip()
            if not listed:
                return None
            names = subprocess.run(["scontrol", "show", "hostnames", listed], capture_output=True, text=True,
                                   timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return set(names.stdout.split()) if names.returncode == 0 else None

    def _busy_nodes(self) -> list[str]:
        """The run's job's nodes that still run a replica of its own: a replacement goes elsewhere.
        A node whose every replica is lost may take it (its task slots are dead; where Slurm
        shares nodes it fits there, else it waits for a free node)."""
        nodes = self._job_nodes()
        if not nodes:
            return []
        k = self.task.ranks_per_replica
        busy = set()
        for r in range(self.task.spec.replicas):
            node_file = self.task.sync / f"node-{r * k}"
            if self._current(r) is None and not self._first_lost(r, nodes) and node_file.exists():
                busy.add(node_file.read_text().strip())
        return sorted(busy & nodes)

    def _first_lost(self, replica: int, nodes: set[str] | None) -> str:
        """Why the slot's first process set is gone ('' when it is not)."""
        k = self.task.ranks_per_replica
        codes = self._done_codes(self.task.sync)
        failed = {g: c for g, c in codes.items() if replica * k <= g < (replica + 1) * k and c != 0}
        if failed:
            return "; ".join(f"task {g} exited {c}" for g, c in sorted(failed.items()))
        node_file = self.task.sync / f"node-{replica * k}"
        if nodes is not None and node_file.exists():
            node = node_file.read_text().strip()
            if node and node not in nodes:
                return f"its node {node} left the job"
        return ""

    def _replacement_lost(self, job: Replacement) -> str:
        codes = self._done_codes(self.replacement_dir(job.replica, job.incarnation))
        failed = {i: c for i, c in codes.items() if c != 0}
        if failed:
            return "; ".join(f"rank {i} exited {c}" for i, c in sorted(failed.items()))
        if job.state not in SLURM_LIVE and not codes:
            # a job whose ranks all exited 0 is not lost: the run ended for them, and task 0's
            # own rank may still be finishing (`close` records it as run to the end); seen on a
            # loaded machine, where the replacement's job had ended before task 0 closed
            return f"its job ended {job.state}"
        return ""

    def _schedule(self, replica: int, why: str, lived: float | None) -> None:
        n = self._quick_deaths[replica] = (self._quick_deaths.get(replica, 0) + 1
                                           if lived is not None and lived < QUICK_DEATH_SECONDS else 0)
        if n >= MAX_QUICK_DEATHS:
            self._given_up.add(replica)
            self._say(f"replica {replica}: not replaced again: its last {n} replacements failed within "
                      f"{QUICK_DEATH_SECONDS:g}s of their start")
            return
        delay = replacement_delay(self.replace_after, n)
        self._due[replica] = time.monotonic() + delay
        self._say(f"replica {replica} lost ({why}): a replacement job is submitted in {delay:g}s")

    # ---- the loop -------------------------------------------------------------------------
    def start(self) -> None:
        """Watch in a thread of task 0 (whose main thread runs replica 0's rank) until `close`."""
        self._thread = threading.Thread(target=self._watch, name="slurm-replacements", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.5):
            try:
                self.tick()
            except Exception as e:  # a Slurm command that failed once: say so, ask again next poll
                self._say(f"could not follow the replacements this time: {type(e).__name__}: {e}")

    def tick(self) -> None:
        """One pass of task 0's loop while the run goes on: find losses, submit, follow the queue."""
        now = time.monotonic()
        if now < self._next_poll:
            return
        self._next_poll = now + self.opts.poll_s
        for job in self.jobs:
            if not job.outcome:
                self._follow(job)
        nodes = None
        for r in range(self.task.spec.replicas):
            if r in self._due or r in self._given_up:
                continue
            current = self._current(r)
            if current is None:
                nodes = self._job_nodes() if nodes is None else nodes
                why = self._first_lost(r, nodes)
                if why:
                    self._schedule(r, why, lived=None)
            elif not current.outcome:
                why = self._replacement_lost(current)
                if why:
                    current.outcome = f"lost: {why}"
                    self._cancel(current)
                    lived = None if current.started_at is None else time.time() - self.t0 - current.started_at
                    self._schedule(r, why, lived=0.0 if lived is None else lived)
        for r, at in sorted(self._due.items()):
            if at <= time.monotonic():
                del self._due[r]
                self._submit(r)

    def _follow(self, job: Replacement) -> None:
        job.state = _job_state(job.job_id)
        # Started: Slurm says so, or a task left its marker (sacct lags slurmctld: it has said
        # PENDING of a job whose tasks were training; such a job must not be cancelled as pending)
        if job.started_at is None and (job.state == "RUNNING" or self._started(job)):
            job.started_at = time.time() - self.t0
            self._say(f"replica {job.replica}: replacement job {job.job_id} started")
        if job.state not in ("PENDING", "") or job.started_at is not None:
            return
        reason = _pending_reason(job.job_id)
        waited = time.time() - self.t0 - job.submitted_at
        never = reason in NEVER_STARTS
        if never or (self.opts.start_timeout_min and waited > 60 * self.opts.start_timeout_min):
            self._cancel(job)
            self._given_up.add(job.replica)
            why = (f"pending for a reason that will not pass ({reason})" if never else
                   f"still pending after {waited / 60:.1f} min ({reason or 'no reason given'})")
            job.outcome = f"cannot start: {why}; cancelled"
            self._say(f"replica {job.replica}: replacement job {job.job_id} cannot start: {why}; cancelled; "
                      f"the run goes on without it")

    def _submit(self, replica: int) -> None:
        import submitit

        incarnation = len([j for j in self.jobs if j.replica == replica]) + 1
        params = dict(self.opts.params)
        extra = dict(params.pop("slurm_additional_parameters", {}))
        held = self._busy_nodes()
        if held:  # the run's live replicas fill them; a replica's ranks share a node of their own
            extra["exclude"] = ",".join(held)
        params["slurm_additional_parameters"] = extra
        params["name"] = f"{params.get('name', 'recover')}-replica{replica}"
        self.replacement_dir(replica, incarnation).mkdir(parents=True, exist_ok=True)
        executor = submitit.AutoExecutor(folder=self.opts.folder, cluster="slurm")
        executor.update_parameters(**params)
        conf = os.environ.get("SLURM_CONF")
        # Submitted from inside a job: that job's SLURM_* variables must not shape the new one
        # (srun would read them), but the cluster's configuration file is still the one to use.
        with submitit.helpers.clean_env():
            if conf:
                os.environ["SLURM_CONF"] = conf
            try:
                job = executor.submit(self.task_body, self.task.spec.to_dict(), self.root,
                                      replica, incarnation, str(self.task.sync))
            except Exception as e:  # sbatch refused it: say so once, leave the slot empty
                self._given_up.add(replica)
                self._say(f"replica {replica}: sbatch refused its replacement job: {' '.join(str(e).split())}")
                return
        self.jobs.append(Replacement(replica, incarnation, str(job.job_id), time.time() - self.t0))
        self._say(f"replica {replica}: replacement job {job.job_id} submitted (incarnation {incarnation}, "
                  f"excluding {','.join(held) or 'no node'})")

    def _cancel(self, job: Replacement) -> None:
        subprocess.run(["scancel", job.job_id], capture_output=True, timeout=30)

    # ---- the run's end --------------------------------------------------------------------
    def close(self) -> None:
        """The run is over: no replacement job left queued or running (see the module docstring)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._due.clear()
        for job in self.jobs:
            if job.outcome:
                continue
            job.state = _job_state(job.job_id)
            if job.state in ("PENDING", "REQUEUED", "") and not self._started(job):
                self._cancel(job)
                job.outcome = "cancelled: still pending when the run ended"
                continue
            if job.started_at is None and self._started(job):
                job.started_at = time.time() - self.t0  # (first seen at the end)
            if job.state in SLURM_LIVE:
                ranks = self.task.ranks_per_replica
                folder = self.replacement_dir(job.replica, job.incarnation)
                end = time.monotonic() + self.reconnect_timeout
                while len(self._done_codes(folder)) < ranks and time.monotonic() < end and \
                        _job_state(job.job_id) in SLURM_LIVE:
                    time.sleep(0.5)
            codes = self._done_codes(self.replacement_dir(job.replica, job.incarnation))
            job.outcome = (f"ran to the run's end (ranks exited {sorted(codes.items())})" if codes else
                           f"ended {job.state} without its ranks' exits")
            self._cancel(job)  # its tasks have returned (or stopped answering): the job ends with them
        end = time.monotonic() + CANCEL_WAIT_S
        while any(_job_state(j.job_id) in SLURM_LIVE for j in self.jobs) and time.monotonic() < end:
            time.sleep(0.5)
        for job in self.jobs:
            job.state = _job_state(job.job_id)

    def record(self) -> list[dict[str, Any]]:
        return [asdict(j) for j in self.jobs]

