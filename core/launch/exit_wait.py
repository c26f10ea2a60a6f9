"""The launcher's nap: one tick, cut short the moment a watched process exits.

Contract:
- `ExitWaiter.wait(pids, seconds)` returns once any process of `pids` has exited, or
  after `seconds`, whichever comes first. It only wakes the caller: the caller still
  learns who exited from its own `poll()`. So a wake it misses costs at most one tick, and
  a spurious one an extra look; neither gives a wrong answer.
- A process's exit wakes one wait, not every later one: its pidfd is then closed and the
  PID left out of later waits (a replica of many ranks stays "running" to the launcher
  until every rank is reaped, and a dead rank must not turn the loop into a spin).
- Why: the launcher reaps exits on a tick (`Launcher.tick_seconds`, 20 ms). When a rank
  other than the leader of a replica of many ranks dies, the launcher is who tells the
  coordinator (`rank_lost`), so the time to its next look was detection time: measured
  at 3 x S2 on the tiny model, a killed rank 1 was seen 34-51 ms after the kill, against
  25 ms for a killed leader, which the coordinator sees on its own connection.
- How: a pidfd per process (Linux 5.3 and later), readable once the process has exited,
  whether it is the launcher's child or the fork server's (a pidfd needs no parenthood).
  Where there are no pidfds (another OS, an old kernel, a sandbox that refuses the call)
  it sleeps the tick, as the launcher did before.
- `close()` closes every pidfd; the waiter can be used again after it.
"""
from __future__ import annotations

import os
import select
import time
from typing import Iterable


class ExitWaiter:
    """Sleep until a watched process exits or the tick ends (see the module docstring)."""

    def __init__(self) -> None:
        self._fds: dict[int, int] = {}  # pid -> its pidfd, while the process has not been seen to exit
        self._seen: set[int] = set()  # pids whose exit already woke a wait: never watched again
        self._pidfds = hasattr(os, "pidfd_open")

    def wait(self, pids: Iterable[int], seconds: float) -> None:
        """Return when any of `pids` exits, or after `seconds`."""
        named = set(pids)
        self._seen &= named  # a PID no longer named was reaped; if it comes back, it is another process
        watched, gone = self._watch(named - self._seen)
        if gone:
            return
        if not watched:
            time.sleep(seconds)
            return
        poller = select.poll()  # not select(): no limit on the fds' numbers (a launcher of many replicas)
        for fd in watched:
            poller.register(fd, select.POLLIN)
        for fd, _ in poller.poll(seconds * 1000):
            pid = watched[fd]
            self._seen.add(pid)
            os.close(self._fds.pop(pid))

    def _watch(self, pids: set[int]) -> tuple[dict[int, int], bool]:
        """(fd -> pid for `pids`, whether one of them is gone already), opening the pidfds not yet
        open and closing those of PIDs no longer watched."""
        for pid in [p for p in self._fds if p not in pids]:
            os.close(self._fds.pop(pid))
        if not self._pidfds:
            return {}, False
        for pid in pids - self._fds.keys():
            try:
                self._fds[pid] = os.pidfd_open(pid)
            except ProcessLookupError:  # gone already: the caller's poll() sees it now
                self._seen.add(pid)
                return {}, True
            except OSError:  # no pidfds here (ENOSYS, EPERM in a sandbox): sleep the ticks
                self._pidfds = False
                self.close()
                return {}, False
        return {fd: pid for pid, fd in self._fds.items()}, False

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
