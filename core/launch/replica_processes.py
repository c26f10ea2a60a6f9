"""The processes of one replica of many ranks, seen by the launcher as one process.

Contract:
- `ReplicaProcesses(procs)` holds a replica's rank processes, rank 0 (its
  leader) first, and offers the subset of `subprocess.Popen` the launcher uses
  (`pid`, `poll`, `wait`, `returncode`, `send_signal`, `kill`), so the launcher's
  loop, its records and its end policies treat a replica as one process whatever
  its size.
- The replica is the failure domain: once any rank has exited, every rank still
  running is SIGKILLed by its PID (a rank's death leaves its peers blocked in the
  replica's collectives; the leader's closed control connection is how the
  coordinator learns that the replica is gone). `poll()` returns the replica's
  code only once every rank is reaped: the code of the first rank that failed (a
  SIGKILLed rank's -9; of failures first seen together, a death by signal), else 0.
- The ranks it kills for their replica are named in `ENDED_WITH_THEIR_REPLICA` (their
  death by signal is the replica's end, not a fault of theirs) until it reaps them (a reaped
  PID may be reused).
- `failed_rank` is that first failed rank (None while none failed), set in the same
  `poll()` that kills the others, which first calls `on_rank_failed(self)` once: the
  replica is lost from then on, and the launcher tells the coordinator there, when the
  failed rank is not the leader (core/launch/exit_notices.py), before the kill, so the
  word never trails a leader's closed connection.
- `pids` lists every rank's PID, rank order (pids.json, and the fault injector's
  launcher-side faults, which address `rank` within `replica`); `pid` is the leader's.
"""
from __future__ import annotations

import os
import signal
from typing import Callable, Sequence

from recover.core.launch.forkserver import PolledProcess


# The PIDs of ranks this launcher SIGKILLed because another rank of their replica had ended:
# a death by signal that is the replica's end, not a fault of the rank's own. A supervisor
# telling who was killed or frozen (the checkpoint-restart baseline's culprits) reads it, so a
# replica whose rank merely exited on a broken collective is not blamed for its siblings' kill.
ENDED_WITH_THEIR_REPLICA: set[int] = set()


class ReplicaProcesses(PolledProcess):
    """A replica's rank processes, ended together (see the module docstring)."""

    def __init__(self, procs: Sequence, on_rank_failed: Callable[["ReplicaProcesses"], None] | None = None):
        self.procs = list(procs)
        self.on_rank_failed = on_rank_failed  # called once, before the others are killed (see the docstring)
        self.pid = self.procs[0].pid
        self.args = getattr(self.procs[0], "args", [])
        self.returncode: int | None = None
        self._first_failure: int | None = None
        self.failed_rank: int | None = None  # the rank whose failure ended the replica (see the docstring)
        self._killed = False

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        codes = [p.poll() for p in self.procs]
        for p, c in zip(self.procs, codes):
            if c is not None:  # reaped: its PID may now be reused by another process, never blamed
                ENDED_WITH_THEIR_REPLICA.discard(p.pid)
        if self._first_failure is None:
            # among failures first seen together, a death by signal is the cause and the others its
            # consequence (a rank killed, its leader then exiting on the lost rank): as the launcher's _reap
            failed = sorted(((c, k) for k, c in enumerate(codes) if c not in (None, 0)), key=lambda ck: ck[0] >= 0)
            if failed:
                self._first_failure, self.failed_rank = failed[0]
        if any(c is not None for c in codes) and any(c is None for c in codes) and not self._killed:
            if self._first_failure is not None:  # a rank died: the replica dies with it
                if self.on_rank_failed is not None:
                    self.on_rank_failed(self)  # first: the others' deaths take a while to be seen
                self._kill_running()
        if all(c is not None for c in codes):
            self.returncode = self._first_failure if self._first_failure is not None else 0
        return self.returncode

    def _kill_running(self) -> None:
        self._killed = True
        for p in self.procs:
            if p.poll() is None:
                ENDED_WITH_THEIR_REPLICA.add(p.pid)
        self.send_signal(signal.SIGKILL)

    def send_signal(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.kill(p.pid, sig)
                except ProcessLookupError:
                    pass
