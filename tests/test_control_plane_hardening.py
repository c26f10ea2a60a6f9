"""The coordinator's control port against what a peer sends, pure.

The real `CoordinatorService` (its `_read`, `_accept`, `_dispatch`, `_apply`) and the real
`ProtocolStateMachine` run against fake sockets: bytes in through `recv`, lines out through
`sendall`, no network. What is checked:
- 6: the close of a connection that is no longer its replica's (a reconnect's hello was
  read first, in the same select() batch) does not make the replica lost;
- 7: a member (a peer holding the join token) whose message is bad (a vote without
  loss_sum, for the wrong step, with a ledger it was not dealt) is fenced with a "fenced"
  record, its ids go to the others, and the run goes on; a null loss_sum (a non-finite
  loss, core/contract/nonfinite.py) still means what it means;
- 8: a peer without the token: its heartbeats before a hello are refused, its silent
  connections are closed at the hello deadline, at most `max_strangers` are held, an
  unterminated line is bounded and kept in pieces, accept() out of descriptors backs off,
  and refusals become one events.jsonl line per interval.
"""
from __future__ import annotations

import errno
import json
import threading

from recover.core.coordinator import service as membership

from recover.core.contract import idranges
from recover.core.config.train_config import TrainConfig
from recover.core.coordinator.service import CoordinatorService, _Conn
from recover.core.storage.results import expand_members


class FakeSock:
    def __init__(self):
        self.inbox: list[bytes] = []  # what recv returns next (b"": the peer closed)
        self.sent: list[dict] = []
        self.closed = False

    def recv(self, n: int) -> bytes:
        if self.closed:
            raise OSError(errno.EBADF, "closed")
        return self.inbox.pop(0) if self.inbox else b""

    def sendall(self, data: bytes) -> None:
        if self.closed:
            raise OSError("closed")
        self.sent += [json.loads(x) for x in data.splitlines()]

    def close(self) -> None:
        self.closed = True

    def settimeout(self, t) -> None:
        pass

    def setsockopt(self, *a) -> None:
        pass


class FakeSel:
    def __init__(self):
        self.registered: set = set()

    def register(self, obj, events, data=None):
        self.registered.add(id(obj))

    def unregister(self, obj):
        if id(obj) not in self.registered:
            raise KeyError(obj)
        self.registered.discard(id(obj))


class Events(list):
    """Stands in for a HeldLineWriter that always writes (core/storage/results.py)."""
    error, held, over_bound = None, 0, False

    def write(self, rec):
        self.append(rec)
        return True

    def flush(self):
        return True

    def close(self):
        return True


def service(tmp_path, R=2, M=4, S=3) -> CoordinatorService:
    cfg = TrainConfig(system="recover", replicas=R, microbatches=M, steps=S, out=str(tmp_path))
    svc = CoordinatorService(cfg, "127.0.0.1", 0, threading.Event())
    svc.listener.close()
    svc.sel.close()
    svc.sel = FakeSel()
    svc.sel.register(svc.listener, 1)
    svc.metrics.close()
    svc.events.close()
    svc.metrics, svc.events = Events(), Events()
    svc.log = lambda text: None
    svc.clock = 0.0
    svc.now = lambda: svc.clock
    return svc


def connect(svc: CoordinatorService, peer: str = "10.0.0.1:1") -> _Conn:
    conn = _Conn(FakeSock(), svc.now(), peer)
    if hasattr(svc, "strangers"):  # (absent before the service bounded strangers: the first test runs on that code too)
        svc.strangers[conn] = None
    svc.sel.register(conn.sock, 1, conn)
    return conn


def send(svc: CoordinatorService, conn: _Conn, *msgs, raw: bytes = b"") -> None:
    conn.sock.inbox.append(b"".join(json.dumps(m).encode() + b"\n" for m in msgs) + raw)
    svc._read(conn)


def hello(svc, r, **extra) -> dict:
    return {"t": "hello", "replica": r, "token": svc.join_token, "pid": 100 + r, "tokens_per_mb": 1, **extra}


def formed(tmp_path, R=2, M=4):
    svc = service(tmp_path, R, M)
    conns = [connect(svc, f"10.0.0.{r}:1") for r in range(R)]
    for r, c in enumerate(conns):
        send(svc, c, hello(svc, r))
    assert svc.proto.gen == 0 and svc.proto.state == "running"
    return svc, conns


def quota(conn: _Conn, r: int) -> list:
    from recover.core.contract.policy import quota_of
    gen = [m for m in conn.sock.sent if m["t"] in ("gen", "commit")][-1]
    return quota_of(gen, gen.get("members") or [[0, 2]], r)


def vote(svc, r, ledger, **extra) -> dict:
    return {"t": "vote", "gen": svc.proto.gen, "step": svc.proto.step, "ok": True, "ledger": ledger,
            "loss_sum": 1.0, "mb_seconds": 0.01, "lr": 0.1, **extra}


# ---- item 6 ------------------------------------------------------------------------------
def test_a_stale_eof_after_a_reconnect_does_not_fence_the_reconnected_replica(tmp_path):
    svc, (c0, c1) = formed(tmp_path)
    report = {"member": True, "step": 0, "gen": 0, "ledger": [], "wait": "go", "awaiting": None, "vote": None}
    c0b = connect(svc, "10.0.0.0:2")
    # One select() batch: the reconnect's hello is read first, then the old connection's EOF.
    send(svc, c0b, hello(svc, 0, report=report, can_heal=True, rejoin=True))
    assert 0 in svc.proto.newcomers and svc.by_replica[0] is c0b
    c0.sock.closed = False  # (a real socket's EOF, not the close the service did: the worst case)
    svc._read(c0)
    assert svc.by_replica.get(0) is c0b and 0 in svc.proto.alive and 0 in svc.proto.newcomers
    assert not c0b.sock.closed and not [m for m in c0b.sock.sent if m["t"] in ("fenced", "refused")]


# ---- item 7 ------------------------------------------------------------------------------
def _fenced_and_redone(svc, conns, bad: dict, why: str):
    (c0, c1) = conns
    q0, q1 = quota(c0, 0), quota(c1, 1)
    send(svc, c1, vote(svc, 1, q1))
    send(svc, c0, bad)
    assert svc.result is None, svc.result  # the run goes on
    fenced = [e for e in svc.events if e.get("kind") == "fenced"]
    assert len(fenced) == 1 and fenced[0]["replica"] == 0 and why in fenced[0]["reason"], fenced
    assert 0 in svc.proto.dead and c0.sock.closed and c0.sock.sent[-1]["t"] == "fenced"
    assert c1.sock.sent[-1]["t"] == "abort"
    send(svc, c1, {"t": "join", "gen": svc.proto.next_gen, "step": 0, "ledger": q1})
    gen = c1.sock.sent[-1]
    assert gen["t"] == "gen" and gen["members"] == [[1, 2]] and gen["split"] == q0  # replica 0's ids, redone
    send(svc, c1, vote(svc, 1, idranges.union_disjoint([q0, q1])))
    (commit,) = map(expand_members, svc.metrics)
    assert commit["members"] == [1] and commit["step"] == 0


def test_a_vote_without_loss_sum_fences_the_member_and_the_run_goes_on(tmp_path):
    svc, conns = formed(tmp_path)
    bad = vote(svc, 0, quota(conns[0], 0))
    del bad["loss_sum"]
    _fenced_and_redone(svc, conns, bad, "loss_sum")


def test_a_vote_for_the_wrong_step_fences_the_member(tmp_path):
    svc, conns = formed(tmp_path)
    _fenced_and_redone(svc, conns, {**vote(svc, 0, quota(conns[0], 0)), "step": 5}, "voted for step 5")


def test_a_vote_with_a_ledger_it_was_not_dealt_fences_the_member(tmp_path):
    svc, conns = formed(tmp_path)
    _fenced_and_redone(svc, conns, vote(svc, 0, [[0, 4]]), "not what it was dealt")


def test_a_malformed_ledger_or_a_ready_for_the_wrong_step_fences_the_member(tmp_path):
    svc, conns = formed(tmp_path)
    _fenced_and_redone(svc, conns, vote(svc, 0, [[3, 1]]), "refused")
    svc, (c0, c1) = formed(tmp_path)
    send(svc, c0, {"t": "ready", "gen": 0, "step": 2})
    assert svc.result is None and 0 in svc.proto.dead
    assert [e["replica"] for e in svc.events if e.get("kind") == "fenced"] == [0]


def test_a_null_loss_sum_is_still_a_non_finite_loss(tmp_path):
    svc, (c0, c1) = formed(tmp_path)
    q0, q1 = quota(c0, 0), quota(c1, 1)
    send(svc, c0, vote(svc, 0, q0, loss_sum=None, nonfinite=[q0[0][:1] + [q0[0][0] + 1]]))
    send(svc, c1, vote(svc, 1, q1, loss_sum=None))  # reduced sum not finite, none of its own ids named
    assert not [e for e in svc.events if e.get("kind") == "fenced"]
    (rec,) = [e for e in svc.events if e.get("kind") == "nonfinite"]
    assert rec["nonfinite"] == {"0": [[q0[0][0], q0[0][0] + 1]]}
    assert svc.result[0] == 1 and "non-finite" in svc.result[1]  # --on-nonfinite stop, as before


# ---- item 8 ------------------------------------------------------------------------------
def test_heartbeats_before_a_hello_are_refused(tmp_path):
    svc = service(tmp_path)
    c = connect(svc)
    send(svc, c, {"t": "hb"})
    assert svc.heartbeats == 0 and svc.refused == 1


def test_silent_connections_are_closed_at_the_hello_deadline_and_members_are_not(tmp_path):
    svc, (c0, c1) = formed(tmp_path)
    idle = [connect(svc, f"10.9.0.{i}:1") for i in range(5)]
    svc.clock = svc.hello_timeout - 0.1
    svc._guard(svc.clock)
    assert not any(c.sock.closed for c in idle)
    svc.clock = svc.hello_timeout + 0.1
    svc._guard(svc.clock)
    assert all(c.sock.closed for c in idle) and not svc.strangers
    assert not c0.sock.closed and not c1.sock.closed and svc.result is None


def test_at_most_max_strangers_connections_without_a_hello_are_held(tmp_path):
    svc = service(tmp_path)
    svc.max_strangers = 10
    socks = []

    def accept():
        s = FakeSock()
        socks.append(s)
        return s, ("10.1.0.1", len(socks))

    svc.listener = type("L", (), {"accept": staticmethod(accept)})()
    for _ in range(1000):
        svc._accept()
    assert len(svc.strangers) == 10 and sum(not s.closed for s in socks) == 10
    assert all(not s.closed for s in socks[-10:])  # the oldest went first
    c = next(reversed(svc.strangers))  # a worker connecting now still gets in with its hello
    send(svc, c, hello(svc, 0))
    assert svc.by_replica[0] is c and c not in svc.strangers


def test_accept_out_of_descriptors_backs_off_instead_of_spinning(tmp_path):
    svc = service(tmp_path)
    held = [connect(svc, f"10.2.0.{i}:1") for i in range(6)]
    calls = []

    def accept():
        calls.append(1)
        raise OSError(errno.EMFILE, "Too many open files")

    listener = svc.listener
    svc.listener = type("L", (), {"accept": staticmethod(accept)})()
    svc.sel.registered.add(id(svc.listener))
    svc._accept()
    assert id(svc.listener) not in svc.sel.registered  # not polled: the loop does not spin on it
    assert sum(c.sock.closed for c in held) == 3  # half the strangers' descriptors freed
    svc.clock = membership.ACCEPT_BACKOFF / 2
    svc._guard(svc.clock)
    assert id(svc.listener) not in svc.sel.registered
    svc.clock = membership.ACCEPT_BACKOFF + 0.01
    svc._guard(svc.clock)
    assert id(svc.listener) in svc.sel.registered and len(calls) == 1
    listener.close()


def test_an_unterminated_line_is_bounded_and_kept_in_pieces(tmp_path):
    svc = service(tmp_path)
    c = connect(svc)
    chunk = b"x" * 65536
    for _ in range(membership.MAX_HELLO_BYTES // len(chunk)):
        c.sock.inbox.append(chunk)
        svc._read(c)
    assert not c.sock.closed and c.size == membership.MAX_HELLO_BYTES and len(c.parts) == 16
    c.sock.inbox.append(chunk)
    svc._read(c)
    assert c.sock.closed and c.size == 0 and c.parts == []  # past the limit before a hello: closed
    # a member's line may be longer (MAX_LINE_BYTES), and a line split over many chunks still parses
    svc2, (c0, c1) = formed(tmp_path / "b")
    line = json.dumps({"t": "ready", "gen": 0, "step": 0}).encode() + b"\n"
    for i in range(len(line)):
        c0.sock.inbox.append(line[i:i + 1])
        svc2._read(c0)
    assert 0 in svc2.proto.ready


def test_refusals_are_counted_in_one_line_per_interval(tmp_path):
    svc = service(tmp_path)
    for i in range(300):
        c = connect(svc, f"10.3.{i // 250}.{i % 250}:1")
        send(svc, c, raw=b"garbage\n" * 3)
    assert svc.refused == 900 and not [e for e in svc.events if e.get("kind") == "refused"]
    svc.clock = membership.REFUSAL_INTERVAL + 0.1
    svc._guard(svc.clock)
    (rec,) = [e for e in svc.events if e.get("kind") == "refused"]
    assert rec["count"] == 900 and rec["peers"] == 300 and rec["closed"] == 0
    assert sum(rec["what"].values()) == 900 and rec["first"]["peer"] == "10.3.0.0:1"
