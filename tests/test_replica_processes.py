"""A replica of many ranks ends whole, and the ranks it ends are not blamed for their death.

core/launch/replica_processes.py: once one rank has exited, every rank still running is
SIGKILLed by its PID and named in ENDED_WITH_THEIR_REPLICA; the checkpoint-restart
supervisor's `killed_or_frozen` (which picks the replicas to leave out of the next start)
then counts a zombie killed by a signal only when the kill was not its replica's end. Seen in
a run before this rule: a survivor whose rank exited on the broken collective had its other
rank killed by the launcher, was blamed for that kill, and the job had no replica left.
Real processes (`sleep`), ended by PID.
"""
from __future__ import annotations

import signal
import subprocess
import time

import pytest

from recover.baselines.supervise import killed_or_frozen
from recover.core.launch.replica_processes import ENDED_WITH_THEIR_REPLICA, ReplicaProcesses

pytestmark = [pytest.mark.procs, pytest.mark.timeout(60)]


def _until(cond, what: str, seconds: float = 20.0) -> None:
    end = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.01)


def test_a_rank_that_exits_ends_its_replica_and_the_ranks_killed_for_it_are_not_blamed():
    ranks = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    stranger = subprocess.Popen(["sleep", "60"])  # killed by a fault, not by its replica's end
    try:
        replica = ReplicaProcesses(ranks)
        ranks[0].send_signal(signal.SIGTERM)  # the leader ends (a rank's own exit)
        _until(lambda: ranks[0].poll() is not None, "rank 0 did not end")
        # the replica notices, kills rank 1 and remembers that it did; rank 1 is not reaped yet
        # (poll reaps only what it asks about next time), so it is a zombie killed by a signal
        replica.poll()
        assert ranks[1].pid in ENDED_WITH_THEIR_REPLICA and ranks[0].pid not in ENDED_WITH_THEIR_REPLICA
        _until(lambda: _zombie(ranks[1].pid), "rank 1 was not killed")
        assert not killed_or_frozen(ranks[1].pid)  # its replica's end, not a fault of its own
        stranger.send_signal(signal.SIGKILL)
        _until(lambda: _zombie(stranger.pid), "the stranger was not killed")
        assert killed_or_frozen(stranger.pid)  # a death by signal of its own still counts
        _until(lambda: replica.poll() is not None, "the replica did not end")
        assert replica.returncode == -signal.SIGTERM  # the first rank's end is the replica's
        assert ranks[1].pid not in ENDED_WITH_THEIR_REPLICA  # reaped: its PID may be reused, and blamed then
    finally:
        for p in [*ranks, stranger]:
            if p.poll() is None:
                p.kill()
            p.wait()


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return False
