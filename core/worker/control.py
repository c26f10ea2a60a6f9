"""The control channel between a worker and the coordinator: JSON lines over TCP.

Contract:
- One TCP connection per worker, opened at start and held for the whole run. The
  kernel closes it when the worker process dies, which is how the coordinator
  learns of a crash within milliseconds, on this machine or across a cluster;
  heartbeats, sent by a thread of their own, catch what a closed socket cannot
  (a frozen process, a lost node). Any message is a sign of life to the
  coordinator, so a heartbeat is skipped when something else was sent within the
  interval; `heartbeat_interval` may be changed while running (the coordinator
  names one in its answer to the hello: core/contract/heartbeat.py).
- Messages are read by the thread that asks for them (`recv`, `abort_reason`),
  in order. There is deliberately no reader thread: the commit message a worker
  waits for after its vote then wakes that worker directly, one scheduling hop
  instead of two (reader thread, then the waiting thread), which is measurable
  on every iteration of an oversubscribed machine.
- When the connection closes, `recv` returns {"t": "closed"} and `closed` is set.
  A coordinator that closes it on purpose says why first ({"t": "fenced"} or
  {"t": "refused"}, core/coordinator/service.py); a close without such a line is a
  coordinator that died, and the worker reconnects (core/worker/replica.py).
- `abort_reason(gen)` drains whatever has arrived without blocking and says
  whether the coordinator has aborted generation `gen`: a collective polls it so
  a survivor stuck waiting on a dead peer gets out as soon as the coordinator
  knows, not at the deadline.
- `on_lost(client)`, when given, is called from the heartbeat thread once the
  connection is lost (a failed send, an end of stream, a silent coordinator), and
  never after `close()`: that thread is not the training thread, so a worker can
  reach a restarted coordinator while its training thread is in the middle of a
  microbatch (core/worker/replica.py `_report_from_heartbeat`).
- The heartbeat carries the training thread's progress count (`p`, a
  `ProgressMeter`'s, core/worker/progress.py) when the client is given one: the
  coordinator tells a replica whose work has stopped from one that is slow.
- Heartbeats the other way: the membership service beats every connection it
  has sent nothing to for a second ({"t": "hb"}, never queued for the reader).
  Once one has arrived, a coordinator silent for `silence_limit` seconds while
  this worker reads (a frozen coordinator: its kernel still holds the socket
  open, so no EOF ever comes) counts as a closed connection: `recv` returns
  {"t": "closed"}. Silence is judged only after draining what the kernel buffered,
  so a worker that was itself busy or frozen does not blame the coordinator.
"""
from __future__ import annotations

import collections
import json
import select
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from recover.core.worker.progress import ProgressMeter


class ControlClient:
    """A worker's connection to the coordinator's membership service."""

    def __init__(self, host: str, port: int, heartbeat_interval: float = 0.1, connect_timeout: float = 60.0,
                 silence_limit: float = 10.0, progress: "ProgressMeter | None" = None,
                 on_lost: "Callable[[ControlClient], None] | None" = None):
        self.sock = socket.create_connection((host, port), timeout=connect_timeout)
        self.silence_limit = silence_limit
        self._beating = False  # the coordinator beats (a heartbeat arrived): its silence can be judged
        self._last_heard = time.monotonic()
        self.sock.settimeout(None)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.closed = threading.Event()
        self.aborted_generation = -1
        self._pending: "collections.deque[dict[str, Any]]" = collections.deque()
        self._buf = b""
        self._send_lock = threading.Lock()
        self.heartbeat_interval = heartbeat_interval
        self.progress = progress  # its count rides on each heartbeat
        self.on_lost = on_lost
        self._closed_here = False  # close() was called: the loss is this worker's own doing
        self._last_sent = time.monotonic()
        threading.Thread(target=self._heartbeat_loop, name="control-heartbeat", daemon=True).start()

    def send(self, msg: dict[str, Any]) -> None:
        self.send_line(json.dumps(msg).encode())

    def send_line(self, data: bytes) -> None:
        """Send one encoded message (a step message's `to_line()`); the newline is added if missing."""
        if not data.endswith(b"\n"):
            data += b"\n"
        with self._send_lock:
            try:
                self.sock.sendall(data)
            except OSError:
                self.closed.set()
            self._last_sent = time.monotonic()

    def recv(self, timeout: float | None) -> dict[str, Any] | None:
        """The next message, or None after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._pending:
            if self._eof:
                return {"t": "closed"}
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if self._beating:  # wake up to judge the coordinator's silence
                left = 1.0 if left is None else min(left, 1.0)
            if not self._read(left):
                if self._coordinator_silent():
                    return {"t": "closed"}
                if deadline is not None and time.monotonic() >= deadline:
                    return None
        return self._pending.popleft()

    @property
    def coordinator_beats(self) -> bool:
        """The coordinator's heartbeats arrive: it is alive, and its silence is being judged."""
        return self._beating and not self._eof

    def put_back(self, msg: dict[str, Any]) -> None:
        """Make `msg` the next message `recv` returns (one read elsewhere, still to be acted on)."""
        self._pending.appendleft(msg)

    def abort_reason(self, generation: int) -> str | None:
        """Why an operation of `generation` should be abandoned now, if it should."""
        if not self._read(0.0):
            self._coordinator_silent()
        if self.closed.is_set() or self._eof:
            return "connection to the coordinator closed"
        if self.aborted_generation >= generation:
            return f"coordinator aborted generation {generation}"
        return None

    def close(self) -> None:
        self._closed_here = True
        self.closed.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    # ---- internals -------------------------------------------------------------------
    _eof = False

    def _coordinator_silent(self) -> bool:
        """After a read found nothing: has a beating coordinator been silent too long? Then it is gone."""
        if not self._beating or time.monotonic() - self._last_heard <= self.silence_limit:
            return False
        self._eof = True
        self.closed.set()
        try:  # a coordinator that wakes up finds this connection gone, as a dead one's would be
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        return True

    def _read(self, timeout: float | None) -> bool:
        """Read what is available (waiting up to `timeout`); True if anything arrived."""
        if self._eof:
            return False
        try:
            ready, _, _ = select.select([self.sock], [], [], timeout)
        except (OSError, ValueError):
            ready = [self.sock]
        if not ready:
            return False
        try:
            chunk = self.sock.recv(65536)
        except OSError:
            chunk = b""
        if not chunk:
            self._eof = True
            self.closed.set()
            return True
        self._last_heard = time.monotonic()
        self._buf += chunk
        *lines, self._buf = self._buf.split(b"\n")
        for line in lines:
            if line.strip():
                msg = json.loads(line)
                if msg.get("t") == "hb":  # the coordinator's heartbeat: only a sign of life
                    self._beating = True
                    continue
                if msg.get("t") == "abort":
                    self.aborted_generation = max(self.aborted_generation, int(msg["gen"]))
                self._pending.append(msg)
        return True

    def _heartbeat_loop(self) -> None:
        while not self.closed.wait(self.heartbeat_interval):
            if time.monotonic() - self._last_sent >= self.heartbeat_interval:  # else that message was the beat
                self.send({"t": "hb"} if self.progress is None else {"t": "hb", "p": self.progress.count})
        if self.on_lost is not None and not self._closed_here:
            self.on_lost(self)
