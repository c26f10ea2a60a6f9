"""Simulated replicas for the coordinator service benchmark: many control connections, one selector.

Contract:
- `python -m recover.experiments.benches.replica_clients SPEC OUT` opens one control
  connection per replica named in SPEC (a JSON file: see `ClientSpec`) to the
  coordinator's membership service and speaks the worker's side of the real control
  protocol on each (core/worker/control.py, core/worker/replica.py, the messages of core/coordinator/protocol.py):
  a hello with the join token; a heartbeat every `heartbeat_interval` seconds (what
  ControlClient's heartbeat thread sends, skipped when another message went out
  within the interval); per step, `step_seconds` after its quota
  arrived (a stand-in for the forward/backward passes and the all-reduce, which never
  touch the coordinator), a vote whose ledger is what it folded, as id ranges; after
  an abort, a join with the ledger kept (a survivor in its all-reduce has folded its
  whole quota), then the redo quota's vote; the heartbeat interval the coordinator
  names in its answer to the hello, when it names one, as ControlClient takes it.
  No torch: one process multiplexes hundreds or thousands of connections.
- Faults are planned by step: fault {"kind", "replica", "step"} fires on that
  replica half a step after its quota for that step first arrived (a quota always
  arrives, so a planned fault fires whatever the load). "crash" closes the
  connection, as the kernel does when a worker process dies; "freeze" sends
  nothing more on it but keeps it open, as a SIGSTOPped worker does, so only
  heartbeat silence can catch it.
- At the end (every replica told "done" or "stop", its connection closed, or
  `deadline` passed) it writes OUT, a JSON object of what it saw, every time on
  the time.time() clock: heartbeats sent, per step the last vote sent and the first
  and last commit received, per aborted generation the first and last abort received,
  each fault as it fired (with the last message the replica had sent), when the
  coordinator closed a frozen replica's connection, and how many replicas finished.
  Nothing here judges what it saw: experiments/benches/coordinator_service.py does.
"""
from __future__ import annotations

import heapq
import json
import os
import selectors
import socket
import sys
import time
from dataclasses import asdict, dataclass, field

from recover.core.contract import idranges
from recover.core.contract.policy import quota_of

DIGEST = "0" * 64  # every replica trains the same weights: one digest for all (checked by the coordinator)


@dataclass
class ClientSpec:
    """What one client process simulates."""

    host: str  # the coordinator's control address
    port: int
    token: str  # the run's join token (RECOVER_JOIN_TOKEN)
    replicas: list[int]  # the replica ids whose connections this process holds
    step_seconds: float  # seconds from a quota's arrival to its vote (compute + all-reduce stand-in)
    heartbeat_interval: float  # seconds between one connection's heartbeats (until the coordinator names one)
    per_replica: int  # microbatches per replica (mb_seconds in the votes)
    faults: list[dict] = field(default_factory=list)  # {"kind": "crash"|"freeze", "replica", "step"}
    deadline: float = 600.0  # seconds after start at which it gives up and writes what it saw


class _Replica:
    __slots__ = ("r", "sock", "buf", "gen", "step", "steps", "members", "quota", "ledger", "voted", "work",
                 "state", "last_sent", "interval")

    def __init__(self, r: int, sock: socket.socket, interval: float):
        self.r, self.sock, self.buf = r, sock, b""
        self.gen = self.step = self.steps = 0
        self.members: idranges.Ranges = []  # the generation's, as its gen message named them
        self.quota: idranges.Ranges = []
        self.ledger: idranges.Ranges = []  # folded this step (kept across an abort)
        self.voted = False  # its vote for (gen, step) is out
        self.work = 0  # bumped when pending work is cancelled: a timer holding an older number is stale
        self.state = "live"  # live | frozen | crashed | closed | done
        self.last_sent = 0.0
        self.interval = interval


class Clients:
    """The replicas of one client process and what they saw."""

    def __init__(self, spec: ClientSpec):
        self.spec = spec
        self.sel = selectors.DefaultSelector()
        self.timers: list[tuple[float, int, str, int, int]] = []  # (due, seq, what, replica, work)
        self.seq = 0
        self.faults = {(f["replica"], f["step"]): f for f in spec.faults}
        self.seen = {"replicas": list(spec.replicas), "heartbeats_sent": 0, "votes_sent": 0, "vote_sent": {},
                     "commit_received": {}, "abort_received": {}, "faults": [], "fenced_at": {}, "done": 0,
                     "stopped": [], "closed_by_coordinator": 0, "heartbeat_interval": spec.heartbeat_interval}
        self.reps: dict[int, _Replica] = {}
        self.active = 0  # replicas live or frozen: the run goes on while there are any

    # ---- plumbing ----------------------------------------------------------------------
    def _at(self, due: float, what: str, rep: _Replica) -> None:
        self.seq += 1
        heapq.heappush(self.timers, (due, self.seq, what, rep.r, rep.work))

    def _send(self, rep: _Replica, msg: dict) -> None:
        try:
            rep.sock.sendall((json.dumps(msg) + "\n").encode())
        except OSError:
            self._gone(rep, "closed")
            return
        rep.last_sent = time.time()

    def _gone(self, rep: _Replica, state: str) -> None:
        if rep.state in ("crashed", "closed", "done"):
            return
        self.active -= 1
        rep.state = state
        try:
            self.sel.unregister(rep.sock)
        except (KeyError, ValueError):
            pass
        rep.sock.close()

    # ---- the run -----------------------------------------------------------------------
    def connect(self) -> None:
        now = time.time()
        n = len(self.spec.replicas)
        for k, r in enumerate(self.spec.replicas):
            sock = socket.create_connection((self.spec.host, self.spec.port), timeout=60)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(None)
            rep = self.reps[r] = _Replica(r, sock, self.spec.heartbeat_interval)
            self.active += 1
            self.sel.register(sock, selectors.EVENT_READ, rep)
            self._send(rep, {"t": "hello", "replica": r, "pid": os.getpid(), "tokens_per_mb": 1024,
                             "weights_sha256": DIGEST, "token": self.spec.token})
            # heartbeats spread over one interval, as independent worker threads would be
            self._at(now + self.spec.heartbeat_interval * (k + 1) / n, "hb", rep)

    def run(self) -> dict:
        start = time.time()
        self.connect()
        while self.active > 0:
            now = time.time()
            if now - start > self.spec.deadline:
                self.seen["gave_up"] = True
                break
            wait = max(0.0, min(self.timers[0][0] - now, 0.5)) if self.timers else 0.5
            for key, _ in self.sel.select(timeout=wait):
                self._read(key.data)
            now = time.time()
            while self.timers and self.timers[0][0] <= now:
                _, _, what, r, work = heapq.heappop(self.timers)
                self._fire(what, self.reps[r], work, now)
        for rep in self.reps.values():
            if rep.state in ("live", "frozen"):
                self._gone(rep, "closed")
        return self.seen

    def _fire(self, what: str, rep: _Replica, work: int, now: float) -> None:
        if what == "hb":
            if rep.state == "live":
                if now - rep.last_sent >= rep.interval:  # as ControlClient: a message just sent was the beat
                    self._send(rep, {"t": "hb"})
                    self.seen["heartbeats_sent"] += 1
                self._at(now + rep.interval, "hb", rep)
            return
        if rep.state != "live" or work != rep.work:
            return  # cancelled by an abort, or the replica is gone
        if what == "vote":
            ledger = idranges.union_disjoint([rep.ledger, rep.quota])
            rep.ledger, rep.quota, rep.voted = ledger, [], True
            self._send(rep, {"t": "vote", "gen": rep.gen, "step": rep.step, "ok": True, "ledger": ledger,
                             "loss_sum": 2.5, "mb_seconds": self.spec.step_seconds / self.spec.per_replica,
                             "lr": 1e-3, "weights_fingerprint": DIGEST})
            self.seen["votes_sent"] += 1
            key = str(rep.step)
            self.seen["vote_sent"][key] = max(self.seen["vote_sent"].get(key, 0.0), rep.last_sent)
        elif what in ("crash", "freeze"):
            self.seen["faults"].append({"kind": what, "replica": rep.r, "step": rep.step, "gen": rep.gen,
                                        "at": now, "last_sent": rep.last_sent})
            if what == "crash":
                self._gone(rep, "crashed")
            else:
                rep.state = "frozen"  # reads on, sends nothing: the coordinator's close is seen

    def _quota(self, rep: _Replica, now: float) -> None:
        """A quota for (gen, step) arrived: its vote (or its planned fault) half or one step later."""
        rep.voted = False
        rep.work += 1
        fault = self.faults.pop((rep.r, rep.step), None)
        if fault is not None:
            self._at(now + self.spec.step_seconds / 2, fault["kind"], rep)
        else:
            self._at(now + self.spec.step_seconds, "vote", rep)

    def _read(self, rep: _Replica) -> None:
        try:
            chunk = rep.sock.recv(65536)
        except OSError:
            chunk = b""
        now = time.time()
        if not chunk:
            if rep.state == "frozen":
                self.seen["fenced_at"][str(rep.r)] = now
            self.seen["closed_by_coordinator"] += 1
            self._gone(rep, "closed")
            return
        rep.buf += chunk
        *lines, rep.buf = rep.buf.split(b"\n")
        for line in lines:
            if line.strip() and rep.state in ("live", "frozen"):
                self._handle(rep, json.loads(line), now)

    def _handle(self, rep: _Replica, msg: dict, now: float) -> None:
        kind = msg["t"]
        if rep.state == "frozen" and kind not in ("done", "stop"):
            return  # a frozen process reads nothing; only its closed connection is noticed
        if kind == "startup":
            if msg.get("heartbeat_interval"):
                rep.interval = float(msg["heartbeat_interval"])
                self.seen["heartbeat_interval"] = rep.interval
        elif kind == "gen":
            rep.gen, rep.step, rep.steps, rep.members = msg["gen"], msg["step"], msg["steps"], msg["members"]
            rep.quota = quota_of(msg, rep.members, rep.r)
            self._quota(rep, now)
        elif kind == "commit":
            key = str(msg["step"])
            lo, hi = self.seen["commit_received"].get(key, (now, now))
            self.seen["commit_received"][key] = (min(lo, now), max(hi, now))
            rep.ledger, rep.step, rep.quota = [], msg["step"] + 1, quota_of(msg, rep.members, rep.r)
            if rep.step < rep.steps:
                self._quota(rep, now)
        elif kind == "abort":
            key = str(msg["gen"])
            lo, hi = self.seen["abort_received"].get(key, (now, now))
            self.seen["abort_received"][key] = (min(lo, now), max(hi, now))
            rep.work += 1  # its vote, if still pending, is not sent
            if not rep.voted:  # it was in its all-reduce: its whole quota is folded, and kept
                rep.ledger, rep.quota = idranges.union_disjoint([rep.ledger, rep.quota]), []
            self._send(rep, {"t": "join", "gen": msg["next"], "step": rep.step, "ledger": rep.ledger})
        elif kind == "done":
            self.seen["done"] += 1
            self._gone(rep, "done")
        elif kind == "stop":
            self.seen["stopped"].append(msg.get("reason", ""))
            self._gone(rep, "done")


def main(argv: list[str]) -> int:
    spec_path, out_path = argv
    spec = ClientSpec(**json.loads(open(spec_path).read()))
    seen = Clients(spec).run()
    seen["spec"] = asdict(spec)
    with open(out_path, "w") as f:
        json.dump(seen, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
