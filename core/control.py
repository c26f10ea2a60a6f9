"""The control channel between a worker and the coordinator: JSON lines over TCP.

Contract:
- One TCP connection per worker, opened at start and held for the whole run. The
  kernel closes it when the worker process dies, which is how the coordinator
  learns of a crash within milliseconds, on this machine or across a cluster;
  heartbeats, sent by a thread of their own, catch what a closed socket cannot
  (a frozen process, a lost node).
- Messages arrive in order in `inbox`. When the coordinator closes the connection
  (the run ended, or this worker was declared dead: fenced), the inbox receives
  {"t": "closed"} and `closed` is set.
- `aborted_generation` is the highest generation the coordinator has aborted; a
  collective polls it through `abort_reason(gen)` so a survivor stuck waiting on a
  dead peer gets out as soon as the coordinator knows, not at the deadline.
"""
from __future__ import annotations

import json
import queue
import socket
import threading
from typing import Any


class ControlClient:
    """A worker's connection to the coordinator's membership service."""

    def __init__(self, host: str, port: int, heartbeat_interval: float = 0.1, connect_timeout: float = 60.0):
        self.sock = socket.create_connection((host, port), timeout=connect_timeout)
        self.sock.settimeout(None)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.inbox: "queue.Queue[dict[str, Any]]" = queue.Queue()
        self.closed = threading.Event()
        self.aborted_generation = -1
        self._send_lock = threading.Lock()
        self._heartbeat_interval = heartbeat_interval
        threading.Thread(target=self._read_loop, name="control-reader", daemon=True).start()
        threading.Thread(target=self._heartbeat_loop, name="control-heartbeat", daemon=True).start()

    def send(self, msg: dict[str, Any]) -> None:
        data = (json.dumps(msg) + "\n").encode()
        with self._send_lock:
            try:
                self.sock.sendall(data)
            except OSError:
                self._mark_closed()

    def recv(self, timeout: float | None) -> dict[str, Any] | None:
        """The next message, or None after `timeout` seconds."""
        try:
            return self.inbox.get(timeout=timeout)
        except queue.Empty:
            return None

    def abort_reason(self, generation: int) -> str | None:
        """Why an operation of `generation` should be abandoned now, if it should."""
        if self.closed.is_set():
            return "connection to the coordinator closed"
        if self.aborted_generation >= generation:
            return f"coordinator aborted generation {generation}"
        return None

    def close(self) -> None:
        self.closed.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    # ---- threads ---------------------------------------------------------------------
    def _mark_closed(self) -> None:
        if not self.closed.is_set():
            self.closed.set()
            self.inbox.put({"t": "closed"})

    def _read_loop(self) -> None:
        buf = b""
        while True:
            try:
                chunk = self.sock.recv(65536)
            except OSError:
                chunk = b""
            if not chunk:
                self._mark_closed()
                return
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                if not line.strip():
                    continue
                msg = json.loads(line)
                if msg.get("t") == "abort":
                    self.aborted_generation = max(self.aborted_generation, int(msg["gen"]))
                self.inbox.put(msg)

    def _heartbeat_loop(self) -> None:
        while not self.closed.wait(self._heartbeat_interval):
            self.send({"t": "hb"})
