"""The launcher's line to the coordinator: which worker processes exited, told at once.

Contract:
- A coordinator whose first line says `"accepts_exits": true` (the membership
  service) takes one connection from the launcher on its control port: first
  {"t": "launcher", "token"} with the run's join token, then one
  {"t": "exited", "replica", "how"} per worker process that exited.
- {"t": "rank_lost", "replica", "rank", "pid", "how"} as soon as a rank other than the
  leader of a replica of many ranks failed (the launcher then SIGKILLs the others,
  core/launch/replica_processes.py). Why: without it the coordinator learns of the
  loss from the leader's closed connection, and that closes only once the leader's
  own exit is through: the kernel releases a process's memory before its sockets,
  tens of milliseconds for a training process, paid after the failed rank's own.
  `pid` is the leader's, so news of a slot's earlier process set cannot end a later one.
- Why: a worker that dies before its hello has no control connection whose
  closing the coordinator could see, so without this the coordinator learns of it
  only at its start-up deadline (minutes) while the others wait for generation 0.
- Best effort and never in the way: a coordinator that cannot be reached, or a
  send that fails, only turns the notices off; the start-up deadline still holds.
- The coordinator beats on this connection too; `silent_for()` says how long it
  has been silent (0 until its first beat), which is how the launcher tells a
  frozen coordinator (alive to the kernel, so no exit to reap) from a busy one.
- Ending, the coordinator says who is still a member ({"t": "ended", "members"});
  `members_at_end()` reads it (None when it never came: an older coordinator, a
  crash), so the launcher waits only for the workers that will see the end.
"""
from __future__ import annotations

import json
import select
import socket
import time


class ExitNotices:
    """Tells the coordinator of worker exits; no method raises."""

    def __init__(self, host: str, port: int, token: str, timeout: float = 5.0):
        self.sock: socket.socket | None = None
        self._beating = False  # a beat arrived: silence from now on means something
        self._last_heard = time.monotonic()
        self._buf = b""  # bytes of a line not yet complete
        self._members_at_end: list[int] | None = None
        try:
            self.sock = socket.create_connection((host, port), timeout=timeout)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            self.sock = None
            return
        self._send({"t": "launcher", "token": token})

    def exited(self, replica: int, how: str) -> None:
        self._send({"t": "exited", "replica": replica, "how": how})

    def rank_lost(self, replica: int, rank: int, leader_pid: int, how: str) -> None:
        self._send({"t": "rank_lost", "replica": replica, "rank": rank, "pid": leader_pid, "how": how})

    def silent_for(self) -> float:
        """Seconds since the coordinator last sent anything here (0 before its first beat, or once closed)."""
        if self.sock is None:
            return 0.0
        try:
            while select.select([self.sock], [], [], 0)[0]:
                data = self.sock.recv(65536)
                if not data:
                    self.close()  # it exited: the launcher's reaper sees that
                    return 0.0
                self._beating, self._last_heard = True, time.monotonic()
                self._take(data)
        except OSError:
            self.close()
            return 0.0
        return time.monotonic() - self._last_heard if self._beating else 0.0

    def members_at_end(self) -> list[int] | None:
        """The members the coordinator named as it ended (reads what arrived); None if it named none."""
        self.silent_for()
        return self._members_at_end

    def _take(self, data: bytes) -> None:
        """Keep the `ended` line; beats and anything else only count as signs of life."""
        *lines, self._buf = (self._buf + data).split(b"\n")
        for line in lines:
            if b'"ended"' not in line:
                continue
            try:
                msg = json.loads(line)
                self._members_at_end = [int(r) for r in msg["members"]]
            except (ValueError, KeyError, TypeError):
                pass  # best effort, as every notice here

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def _send(self, msg: dict) -> None:
        if self.sock is None:
            return
        try:
            self.sock.sendall((json.dumps(msg) + "\n").encode())
        except OSError:
            self.close()
