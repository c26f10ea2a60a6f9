"""The coordinator's membership service: sockets and clocks around `protocol.Membership`.

Contract:
- Listens on a TCP port for one control connection per worker (see `control.py`).
  A connection that closes, or stays silent for `heartbeat_timeout` seconds, makes
  its replica dead; the protocol then aborts the generation and re-forms it with
  the survivors. A dead replica's connection is closed: if it was only frozen, it
  wakes up to a closed socket and leaves (fencing).
- It is the single writer of DIR/metrics.jsonl (one line per committed step) and
  DIR/events.jsonl (one line per recovery): no worker, replica 0 included, is
  special, so any of them can die.
- Times in the records are seconds since the run started (RECOVER_T0), on the
  same clock as the fault injector's DIR/faults.jsonl.
- `serve()` returns 0 when the last step is committed, 1 when no replica is left
  (everything committed so far is already on disk), 130 when stopped by a signal;
  its verdict and reason are the last line of events.jsonl ("kind": "run_end").
"""
from __future__ import annotations

import json
import os
import selectors
import socket
import sys
import threading
import time
from pathlib import Path

from .config import TrainConfig
from .protocol import Membership, Out, ProtocolError
from .results import JsonlWriter

SEND_TIMEOUT = 1.0  # a worker that cannot take a small message in 1 s is not healthy


class _Conn:
    def __init__(self, sock: socket.socket, now: float):
        self.sock = sock
        self.buf = b""
        self.replica: int | None = None
        self.last_seen = now


class MembershipService:
    """Serves the control connections of one run until it ends."""

    def __init__(self, cfg: TrainConfig, host: str, port: int, stop: threading.Event):
        self.cfg = cfg
        self.stop = stop
        self.t0 = float(os.environ.get("RECOVER_T0", time.time()))
        self.listener = socket.create_server((host, port))
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.listener, selectors.EVENT_READ)
        self.by_replica: dict[int, _Conn] = {}
        # A survivor that is still computing its quota rejoins only when done, so
        # the rejoin deadline is the collective deadline, not the heartbeat one.
        self.proto = Membership(cfg.replicas, cfg.microbatches, cfg.steps, cfg.collective_timeout, self.now())
        out = Path(cfg.out)
        self.metrics = JsonlWriter(out / "metrics.jsonl")
        self.events = JsonlWriter(out / "events.jsonl")
        self.result: tuple[int, str] | None = None
        # Largest silence seen from a live worker: the evidence for how tight the
        # heartbeat timeout can be without false alarms.
        self.max_gap = 0.0

    def now(self) -> float:
        return time.time() - self.t0

    def log(self, text: str) -> None:
        print(f"[coordinator {self.now():8.3f}s] {text}", file=sys.stderr, flush=True)

    # ---- the loop ----------------------------------------------------------------------
    def serve(self) -> int:
        hb_timeout = self.cfg.heartbeat_timeout
        tick = min(0.05, self.cfg.heartbeat_interval)
        try:
            while self.result is None:
                if self.stop.is_set():
                    self.log("stopped by signal")
                    return 130
                for key, _ in self.sel.select(timeout=tick):
                    if key.fileobj is self.listener:
                        self._accept()
                    else:
                        self._read(key.data)
                    if self.result is not None:
                        break
                now = self.now()
                for r, conn in list(self.by_replica.items()):
                    if now - conn.last_seen > hb_timeout:
                        self._apply(self.proto.on_lost(r, f"no heartbeat for {now - conn.last_seen:.1f}s", now))
                self._apply(self.proto.on_tick(now))
        except ProtocolError as e:
            self.log(f"PROTOCOL ERROR (nothing was committed for this step): {e}")
            self.result = (3, str(e))
        finally:
            if self.result is not None:
                code, reason = self.result
                self.events.write({"kind": "run_end", "code": code, "reason": reason, "wall_time": self.now(),
                                  "max_heartbeat_gap": self.max_gap})
            self.metrics.close()
            self.events.close()
            for conn in list(self.by_replica.values()):
                conn.sock.close()
        code, reason = self.result
        self.log(f"finished: {reason}")
        return code

    def _accept(self) -> None:
        sock, _ = self.listener.accept()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(SEND_TIMEOUT)
        self.sel.register(sock, selectors.EVENT_READ, _Conn(sock, self.now()))

    def _drop(self, conn: _Conn) -> None:
        try:
            self.sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
        if conn.replica is not None and self.by_replica.get(conn.replica) is conn:
            del self.by_replica[conn.replica]

    def _read(self, conn: _Conn) -> None:
        try:
            chunk = conn.sock.recv(65536)
        except OSError:
            chunk = b""
        now = self.now()
        if not chunk:
            self._drop(conn)
            if conn.replica is not None:
                self._apply(self.proto.on_lost(conn.replica, "control connection closed (process gone)", now))
            return
        if conn.replica is not None:
            self.max_gap = max(self.max_gap, now - conn.last_seen)
        conn.last_seen = now
        conn.buf += chunk
        *lines, conn.buf = conn.buf.split(b"\n")
        for line in lines:
            if line.strip():
                self._dispatch(conn, json.loads(line), now)

    def _dispatch(self, conn: _Conn, msg: dict, now: float) -> None:
        kind = msg.get("t")
        if kind == "hb":
            return
        if kind == "hello":
            r = int(msg["replica"])
            conn.replica = r
            if r not in self.by_replica and r not in self.proto.dead:
                self.by_replica[r] = conn
            self._apply(self.proto.on_hello(r, msg, now), conn)
            return
        r = conn.replica
        if r is None or self.by_replica.get(r) is not conn:
            return  # not a member (fenced or never said hello)
        handler = {"join": self.proto.on_join, "vote": self.proto.on_vote, "fail": self.proto.on_fail}.get(kind)
        if handler is not None:
            self._apply(handler(r, msg, now))

    # ---- actions ------------------------------------------------------------------------
    def _apply(self, actions: list[Out], origin: _Conn | None = None) -> None:
        # A failed send makes its replica lost, and that loss has consequences (an
        # abort, a new generation) that are applied only after every action of this
        # batch: applied at once, they would overtake the rest of a broadcast, and
        # the other replicas would read [abort, commit] or [abort(g), gen(g)].
        lost: list[tuple[int, str]] = []
        for a in actions:
            if a.kind == "send":
                conn = self.by_replica.get(a.replica)
                if conn is None:
                    continue
                try:
                    conn.sock.sendall((json.dumps(a.msg) + "\n").encode())
                except OSError as e:
                    self._drop(conn)
                    lost.append((a.replica, f"send failed: {e}"))
            elif a.kind == "close":
                # A refused hello closes the connection it came on, not the member's.
                conn = origin if origin is not None and origin.replica == a.replica else self.by_replica.get(a.replica)
                if conn is not None:
                    self.log(f"replica {a.replica} removed: {a.reason}")
                    self._drop(conn)
            elif a.kind == "commit":
                self.metrics.write({**a.msg, "wall_time": self.now()})
            elif a.kind == "recovery":
                rec = a.msg
                self.log(
                    f"recovered step {rec['step']} in {rec['recovery_seconds']:.3f}s: {rec['fault']}; "
                    f"generation {rec['generation']} = {rec['survivors']}, redid {len(rec['redone'])} microbatches"
                )
                self.events.write({"kind": "recovery", **rec})
            elif a.kind == "finish":
                self.result = (a.code, a.reason)
        for r, reason in lost:
            self._apply(self.proto.on_lost(r, reason, self.now()))
