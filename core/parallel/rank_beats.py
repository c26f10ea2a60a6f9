"""Liveness inside a replica of many ranks: every rank beats to its leader.

Contract:
- The coordinator hears only the leader (core/parallel/replica_link.py), so a
  frozen rank behind a live leader would hold its whole replica, and every other
  replica waiting for its `ready`, for ever: the leader's own heartbeat says
  nothing of its ranks. So each rank other than the leader writes a byte every
  `interval` seconds, from a thread of its own, on a TCP connection to its
  leader, and the leader's thread watches them. A rank whose connection closes
  (gone), or that is silent for longer than `limit()` seconds (frozen), is lost:
  `on_silent(rank, seconds)` is called once (the worker's: log it and exit, so the
  launcher ends the replica's other ranks and the coordinator sees the leader's
  connection close: the whole replica goes, as a crash of any of its ranks makes
  it go).
- Silence is judged only over time the watcher itself ran: a leader whose process was
  frozen (SIGSTOPped, then woken) reads the beats that waited in the sockets before it
  judges anyone, and counts silence from its own return.
- `limit` is a callable so the caller can allow more before the first commit (a
  rank's first step pays one-time costs holding the GIL, as the coordinator
  allows its workers: core/coordinator/service.py `_silent`).
- A rank whose leader is gone (its connection closes or a write fails) calls
  `on_leader_gone()`: the replica is out, nothing is left for the rank to do.
- `stop()`, once the rank's training loop is over: a rank says goodbye (a "!"),
  and its leader stops judging it; a leader stops judging all. After it, ranks
  ending in any order are not losses.
- The leader's address travels once through the coordinator's store (key
  "replica<r>/beats"); the beats themselves never touch the store or the
  coordinator: O(S) bytes per interval per replica, between its own processes.
- Why a socket and not a gloo send: measured here, a gloo send/recv pair from a
  background thread, beside a blocking collective of the main thread, delivered
  two beats in two seconds; a socket write needs nothing from the other threads.
"""
from __future__ import annotations

import selectors
import socket
import threading
import time
from typing import Callable

import torch.distributed as dist


def local_address(towards: str) -> str:
    """This host's address on the route to `towards` (what a peer on that network can reach)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((towards, 9))  # no packet is sent: this only picks the route
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


class RankBeats:
    """The beats of a replica's ranks to their leader (see the module docstring)."""

    def __init__(self, store: dist.Store, replica: int, local_rank: int, size: int, interval: float,
                 limit: Callable[[], float], on_silent: Callable[[int, float], None],
                 on_leader_gone: Callable[[], None], host: str = "127.0.0.1", prefix: str | None = None):
        # `prefix`: this process set's (core/parallel/context.py replica_prefix), so a replacement's
        # ranks find their own leader, never the address its dead predecessor left
        self.store, self.key = store, f"{prefix or f'replica{replica}/'}beats"
        self.local_rank, self.size = local_rank, size
        self.interval, self.limit = interval, limit
        self.on_silent, self.on_leader_gone = on_silent, on_leader_gone
        self.last_heard: dict[int, float] = {}
        self._server: socket.socket | None = None
        self._conn: socket.socket | None = None  # a rank's connection to its leader
        self._stopped = threading.Event()
        if local_rank == 0:
            self._server = socket.create_server((host, 0))
            self.store.set(self.key, f"{host}:{self._server.getsockname()[1]}")

    def start(self) -> None:
        target = self._watch if self.local_rank == 0 else self._beat
        threading.Thread(target=target, name="rank-beats", daemon=True).start()

    def _beat(self) -> None:
        try:
            host, port = self.store.get(self.key).decode().rsplit(":", 1)
            conn = self._conn = socket.create_connection((host, int(port)), timeout=30)
            conn.sendall(f"{self.local_rank}\n".encode())
            while not self._stopped.wait(self.interval):
                conn.sendall(b".")
        except OSError:  # the leader is gone (or never came): so is this replica
            if not self._stopped.is_set():
                self.on_leader_gone()

    def stop(self) -> None:
        """The loop is over (see the contract)."""
        self._stopped.set()
        if self._conn is not None:
            try:
                self._conn.sendall(b"!")
            except OSError:
                pass

    def _watch(self) -> None:
        sel = selectors.DefaultSelector()
        self._server.setblocking(False)
        sel.register(self._server, selectors.EVENT_READ)
        start = time.monotonic()
        rank_of: dict[socket.socket, int | None] = {}
        finished: set[int] = set()  # ranks that said goodbye
        last_turn = start  # when this watcher last ran: silence is judged only over time it was awake
        while not self._stopped.is_set():
            if time.monotonic() - last_turn > self.limit():
                # This watcher itself was frozen (its process SIGSTOPped and woken: the leader of a
                # replica declared dead while alive, which rejoins) or starved: its ranks' beats of that
                # time wait unread in the sockets. It judges no one before it read them, and counts
                # their silence from its own return.
                start = time.monotonic()
                self.last_heard = {r: start for r in self.last_heard}
            for key, _ in sel.select(timeout=self.interval / 2):
                if key.fileobj is self._server:
                    conn, _ = self._server.accept()
                    conn.setblocking(False)
                    rank_of[conn] = None
                    sel.register(conn, selectors.EVENT_READ)
                    continue
                conn = key.fileobj
                try:
                    data = conn.recv(4096)
                except OSError:
                    data = b""
                r = rank_of[conn]
                if r in finished or self._stopped.is_set():
                    sel.unregister(conn)
                    continue
                if not data:  # closed: the rank is gone
                    self.on_silent(r if r is not None else -1, time.monotonic() - self.last_heard.get(r, start))
                    return
                if r is None:  # its first line says which rank it is
                    r = rank_of[conn] = int(data.split(b"\n", 1)[0])
                self.last_heard[r] = time.monotonic()
                if data.endswith(b"!"):
                    finished.add(r)
            if self._stopped.is_set():
                return
            now = time.monotonic()
            if now - last_turn > self.limit():
                continue  # frozen within this turn: the next one reads what waited, then judges (above)
            for r in range(1, self.size):
                if r in finished:
                    continue
                silent = now - self.last_heard.get(r, start)
                if silent > self.limit():
                    self.on_silent(r, silent)
                    return
            last_turn = time.monotonic()
