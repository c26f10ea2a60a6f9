"""The coordinator's service (`CoordinatorService`): sockets and clocks around `protocol.ProtocolStateMachine`.

Contract:
- Listens on a TCP port for one control connection per worker (see `control.py`).
  A connection that closes, or stays silent for the heartbeat timeout, makes
  its replica dead (until the replica's first vote, silence is allowed up to the
  collective timeout: see `_silent`); past a few hundred replicas the heartbeat
  interval and timeout stretch with R so the heartbeat load stays within
  `heartbeat_budget` per second (core/contract/heartbeat.py: the strategy), and the interval
  is named to each worker in the answer to its hello. Any line is a sign of life.
  The protocol then aborts the generation and re-forms it with the survivors. A dead replica's connection is
  closed after a last line saying so ({"t": "fenced", "reason"}; a refused hello gets {"t": "refused", "reason"}):
  if it was only frozen, it wakes up to that line and rejoins or leaves (fencing). A close with no such line
  means the coordinator died; the worker then reconnects (core/worker/replica.py).
- It is the single writer of DIR/metrics.jsonl (one line per committed step) and
  DIR/events.jsonl (one line per recovery, and one {"kind": "fenced", "replica",
  "reason", ...} per replica fenced for persistent faults or corrupt weights; per
  admission one "admitted" line, and per newcomer one "join" line at its first
  commit: bytes and seconds of its state transfer, seconds from its process start
  to that commit, every member's weights digest at it; a failed transfer adds a
  "join_failed" line, and a newcomer refused after `--max-heal-attempts` of them a
  "join_refused" line): no worker, replica 0
  included, is special, so any of them can die.
- A dead replica's slot takes a new connection only from a newcomer (a hello
  with `can_heal`): a replacement process, or the same replica woken from a
  freeze. Its old connection stays closed, so nothing it sent there counts.
- Times in the records are seconds since the run started (RECOVER_T0), on the
  same clock as the fault injector's DIR/faults.jsonl.
- Each commit's metrics line carries the coordinator's own load, "coordinator":
  {"vote_to_commit_s": seconds from reading the step's last vote to the last commit
  message sent, "cpu_s": this process's CPU seconds so far, "heartbeats" and
  "messages": how many heartbeats and well-formed lines it has handled so far}, so
  its cost per step and its CPU share over any window of steps are read from the
  run itself (`recover bench coordinator --service` does).
- A connection is a replica's only after a hello carrying the run's join token
  (RECOVER_JOIN_TOKEN, set by the launcher; generated here when unset). Any line
  that is malformed, oversized, of an unknown type, ill-typed (`wire.py`) or out
  of protocol (a second hello, a message or heartbeat before the hello, a wrong token) is
  dropped and counted; a wrong token, or `wire.MAX_REFUSALS` refused lines, closes the
  connection. Refusals are written as one events.jsonl line per `REFUSAL_INTERVAL`
  ({"kind": "refused", "count", "closed", "peers", "what": {reason: count}, "first",
  "since", "until"}), never one line each. Nothing a peer sends crashes the coordinator
  or ends the run: a member (a peer holding the token) whose line is refused, or whose
  message the protocol cannot take (a vote without loss_sum, for another step, with a
  ledger it was not dealt), is fenced ("fenced" record, `ProtocolStateMachine.on_bad`).
- Without the token a peer holds little: a connection gets `HELLO_TIMEOUT`
  seconds to say hello; at most `max_strangers` (a quarter of RLIMIT_NOFILE, at most
  1,024) connections without a hello are held, a new one closing the oldest; a line
  before the hello is bounded by `MAX_HELLO_BYTES` (then the connection closes), and
  lines are kept in pieces, only new bytes searched for a newline; accept() out of
  descriptors (EMFILE/ENFILE) stops polling the listener for `ACCEPT_BACKOFF` and
  closes half the connections without a hello, instead of spinning. Only a replica's
  registered connection speaks for it: the close of one it replaced is not a loss.
- Start-up is visible: each hello is counted in the log ("replicas connected 3/4");
  a replica whose process exited before its hello (the launcher says so at once, on
  a connection of its own that shows the join token) and the forming of generation
  0 are logged and recorded in events.jsonl as {"kind": "startup", ...}.
- It beats every connection (workers and the launcher's) it has sent nothing to
  for `beat_interval` seconds, so a frozen coordinator is noticed (control.py).
- Ending, it tells the launcher who is still a member ({"t": "ended", "members"}):
  those see the end and exit by themselves; any other worker still running (a
  replica fenced for a stall that never ends) is stopped by the launcher at once.
- Restarted (`rebuild=True`, on the same ports, by the launcher after the old one
  died): it first collects one hello per worker, each with a report of where that
  worker stands (sent by the worker's heartbeat thread while its training thread
  works inside a quota, a hello marked `standby`, or else by the training thread
  at its next unit of work), answers each with {"t": "rebuilt"}, and once every expected
  replica reported (or its exit was told by the launcher, or the wait passed: the
  collective timeout plus four times the longest gap between units of work a member
  had measured, which the last metrics line records, since a worker's training
  thread notices the death only at its next unit of work) hands them to `ProtocolStateMachine.rebuild`, which forms the next generation
  from them. Nothing else a worker sends before that counts (it belonged to the
  dead coordinator's generation). metrics.jsonl and events.jsonl are continued:
  a commit already recorded is not recorded twice, and one the old coordinator
  sent but did not record is recorded from the workers' votes.
- `serve()` returns 0 when the last step is committed, 1 when no replica is left
  (everything committed so far is already on disk), 130 when stopped by a signal;
  its verdict and reason are the last line of events.jsonl ("kind": "run_end").
- A run directory that cannot be written (full, over quota) does not end the run:
  metrics.jsonl and events.jsonl are `HeldLineWriter`s (core/storage/results.py), so
  a line that fails to write is held in memory, in order, and written by the next
  write or by the retry every `RETRY_INTERVAL`; commits go on meanwhile. Going on,
  not stopping, because a full disk is often transient and the run's state is in the
  workers: stopping would cost the work since the last checkpoint for a few KB a
  step of memory. The log says it twice, one line when a file starts failing (the
  error) and one when its held lines are written. Bounded: past `MAX_HELD_LINES`
  held lines in one file the coordinator stops the run (every live replica hears
  `stop`; everything committed is in the workers' checkpoints, if any) and exits
  `EXIT_RUN_DIR_UNWRITABLE` (7, core/contract/worker_exit.py) with one line naming
  the file and the error; it exits 7 too when lines are still held at the end of
  the run (they are lost: the line says how many). Its log is written the same way
  (a log line that cannot be written is dropped, never raised).
"""
from __future__ import annotations

import errno
import hmac
import os
import re
import resource
import selectors
import socket
import sys
import threading
import time
from pathlib import Path

from recover.core.config.train_config import TrainConfig
from recover.core.contract.heartbeat import heartbeat_plan
from recover.core.launch.hooks import load_coordinator_hooks
from recover.core.coordinator.protocol import Act, ProtocolStateMachine, Out, ProtocolError
from recover.core.contract.worker_exit import EXIT_RUN_DIR_UNWRITABLE
from recover.core.storage.results import HeldLineWriter
from recover.core.launch.startup import JOIN_TOKEN_ENV, new_join_token
from recover.core.coordinator.gc_pacing import pace, settle
from recover.core.contract.wire import MAX_LINE_BYTES, MAX_REFUSALS, dumps, loads, read_line
from recover.core.contract import env_names
from recover.core.contract.step_messages import Ready, Vote

SEND_TIMEOUT = 1.0  # a worker that cannot take a small message in 1 s is not healthy
HELLO_TIMEOUT = 10.0  # seconds a connection may stay open without a hello (a worker says it at once)
MAX_HELLO_BYTES = 1 << 20  # a line before the hello: a hello with its report is a few KiB
REFUSAL_INTERVAL = 5.0  # refusals are counted, and written as one summary line per interval
ACCEPT_BACKOFF = 0.2  # seconds the listener is not polled after accept() ran out of descriptors
_HEARTBEAT = b'{"t":"hb"}\n'
RETRY_INTERVAL = 1.0  # seconds between retries of held lines when nothing new is written
TAIL_BYTES = 64 << 20  # of metrics.jsonl read by a restarted coordinator: a few lines even at R = 16,384


class _Conn:
    def __init__(self, sock: socket.socket, now: float, peer: str = "?"):
        self.sock = sock
        self.parts: list[bytes] = []  # the unterminated line so far, in pieces (joined once, at its newline)
        self.size = 0  # its bytes
        self.accepted = now
        self.closed = False
        self.replica: int | None = None
        self.last_seen = now
        self.peer = peer  # host:port, for the records of what it sent that was refused
        self.refusals = 0
        self.skipping = False  # inside an oversized line: drop bytes up to its newline
        self.voted = False  # has voted once: past its first step's one-time costs
        self.progress: int | None = None  # the last progress count its heartbeat carried
        self.last_sent = now  # when a line last went to it (a heartbeat is due a beat after)


class _Batch:
    """What the handlers of one `_apply` share: the connection the input came on (a refused
    hello's), when the batch's sends went out, the last message encoded (a broadcast's line,
    reused), and the replicas whose send failed (their loss is applied after the batch)."""

    __slots__ = ("origin", "sent_at", "last_msg", "line", "lost")

    def __init__(self, origin: "_Conn | None", sent_at: float):
        self.origin, self.sent_at = origin, sent_at
        self.last_msg: dict | None = None
        self.line = b""
        self.lost: list[tuple[int, str]] = []


class CoordinatorService:
    """Serves the control connections of one run until it ends."""

    def __init__(self, cfg: TrainConfig, host: str, port: int, stop: threading.Event, join_token: str = "",
                 rebuild: bool = False, expect: set[int] | None = None):
        self.cfg = cfg
        self.stop = stop
        # one handler per kind of the state machine's actions (`_apply`)
        self._handlers = {Act.SEND: self._do_send, Act.CLOSE: self._do_close, Act.COMMIT: self._do_commit,
                          Act.RECOVERY: self._do_recovery, Act.EVENT: self._do_event, Act.FINISH: self._do_finish}
        # Without it a connection cannot become a replica; a job script that did not
        # set one reads the generated one from the coordinator's first line.
        self.join_token = join_token or os.environ.get(JOIN_TOKEN_ENV, "") or new_join_token()
        self.refused = 0
        self.t0 = float(os.environ.get(env_names.T0, time.time()))
        self.listener = socket.create_server((host, port))
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.listener, selectors.EVENT_READ)
        self.by_replica: dict[int, _Conn] = {}
        # Connections that have not said hello (or are not yet known to be a member or the
        # launcher), oldest first: each gets `hello_timeout` seconds, and at most
        # `max_strangers` are held (a new one past that closes the oldest), so a peer without
        # the token holds a bounded number of descriptors for a bounded time.
        self.strangers: dict[_Conn, None] = {}
        self.hello_timeout = HELLO_TIMEOUT
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        room = soft if soft != resource.RLIM_INFINITY else 1 << 16
        self.max_strangers = max(8, min(1024, room // 4))
        self.accept_paused_until: float | None = None  # accept() ran out of descriptors: not polled until then
        self.accept_backoffs = 0
        # refusals of the current interval, written as one summary line (`_flush_refusals`)
        self.refusal_window: dict[str, object] | None = None
        # the heartbeat interval the workers are told, and the silence that makes one dead
        self.heartbeat_interval, self.heartbeat_timeout = heartbeat_plan(
            cfg.replicas, cfg.heartbeat_interval, cfg.heartbeat_timeout, cfg.heartbeat_budget)
        # A survivor that is still computing its quota rejoins only when done, so
        # the rejoin deadline is the collective deadline, not the heartbeat one.
        self.proto = ProtocolStateMachine(cfg.replicas, cfg.microbatches, cfg.steps, cfg.collective_timeout, self.now(),
                                fence_after=cfg.fence_after, max_failed_generations=cfg.max_failed_generations,
                                startup_timeout=cfg.startup_timeout, heartbeat_interval=self.heartbeat_interval,
                                start_step=cfg.start_step, min_replicas=cfg.min_replicas,
                                on_nonfinite=cfg.on_nonfinite, max_heal_attempts=cfg.max_heal_attempts)
        self.launcher: _Conn | None = None  # the launcher's connection, once it said who it is
        out = Path(cfg.out)
        self.metrics = HeldLineWriter(out / "metrics.jsonl")
        self.events = HeldLineWriter(out / "events.jsonl")
        self.unwritable: str | None = None  # why the run stops: a file held more lines than its bound
        self.next_retry = 0.0
        self.result: tuple[int, str] | None = None
        # Largest silence seen from a live worker: the evidence for how tight the
        # heartbeat timeout can be without false alarms.
        self.max_gap = 0.0
        self.heartbeats = 0  # heartbeat lines handled (the coordinator's load, in each commit record)
        self.messages = 0  # well-formed lines handled, heartbeats included
        self.read_at = 0.0  # when the lines being handled were read (a commit's latency starts there)
        # The coordinator's own heartbeat to each connection (a frozen coordinator is seen by its silence).
        self.beat_interval = min(1.0, cfg.coordinator_timeout / 5)
        self.next_beat = 0.0
        tail = self._tail_records(out / "metrics.jsonl") if rebuild else []  # read once: both below come from it
        self.recorded_step = self._last_step(tail)
        self.hooks = load_coordinator_hooks(cfg.coordinator_hooks, cfg)  # None: no hook calls at all
        # A restarted coordinator: the hellos it collects, the replicas it waits for, those known gone.
        self.rebuilding = rebuild
        self.rebuild_hellos: dict[int, dict] = {}
        self.rebuild_expect = set(range(cfg.replicas)) if expect is None else set(expect)
        self.rebuild_exited: set[int] = set()
        # A member's training thread notices the old coordinator's death at its next unit of
        # work, and only then reconnects with its report: the wait allows four of the longest
        # such gaps the members had measured (metrics.jsonl says it), on top of the collective
        # timeout, so slow work (a microbatch longer than the timeout) is waited for.
        self.rebuild_gap = self._last_gap(tail)
        self.rebuild_wait = cfg.collective_timeout + 4 * self.rebuild_gap
        self.rebuild_deadline = self.now() + self.rebuild_wait
        if rebuild:
            self.log(f"restarted: rebuilding the run from the reports of replicas {sorted(self.rebuild_expect)} "
                     f"(last step recorded: {self.recorded_step})")

    def now(self) -> float:
        return time.time() - self.t0

    @staticmethod
    def _tail_records(path: Path) -> list[dict]:
        """The whole records of metrics.jsonl's tail (a long run's file is not read whole); a torn
        last line (the old coordinator was killed mid-write) is skipped here, and ended by the
        writer before its first line."""
        if not path.exists():
            return []
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(max(0, size - TAIL_BYTES))
            data = f.read()
        lines = data.splitlines()
        if size > TAIL_BYTES and lines:
            lines = lines[1:]  # the first is cut by the seek
        out = []
        for line in lines:
            try:
                rec = loads(line)
            except ValueError:  # a torn line: not a record
                continue
            if isinstance(rec, dict):
                out.append(rec)
        return out

    @staticmethod
    def _last_recorded_step(path: Path) -> int:
        """The last step metrics.jsonl holds (-1: none). Steps are written in order, so the tail says it."""
        return CoordinatorService._last_step(CoordinatorService._tail_records(path))

    @staticmethod
    def _last_step(records: list[dict]) -> int:
        """The last step of metrics.jsonl's tail records (-1: none)."""
        last = -1
        for rec in records:
            try:
                last = max(last, int(rec["step"]))
            except (ValueError, KeyError, TypeError):
                continue
        return last

    @staticmethod
    def _last_gap(records: list[dict]) -> float:
        """The longest gap between units of work any member had measured, as the last of the tail
        records that says it (`progress_gap`) recorded it: 0.0 when none does."""
        for rec in reversed(records):
            gap = rec.get("progress_gap")
            if type(gap) in (int, float) and 0 <= gap < float("inf"):
                return float(gap)
        return 0.0

    def log(self, text: str) -> None:
        try:
            print(f"[coordinator {self.now():8.3f}s] {text}", file=sys.stderr, flush=True)
        except OSError:  # the log's disk is full too: the run goes on without this line
            pass

    # ---- the run's files ------------------------------------------------------------------
    def _write(self, writer: HeldLineWriter, record: dict) -> None:
        """One record into metrics.jsonl or events.jsonl: held if it cannot be written (see the contract)."""
        failing = writer.error is not None
        self._said(writer, failing, writer.write(record))

    def _retry_held(self, now: float) -> None:
        """Held lines are tried again every RETRY_INTERVAL, so space that is back is used
        before the next commit; a file past its bound stops the run (once)."""
        if now >= self.next_retry:
            self.next_retry = now + RETRY_INTERVAL
            for w in (self.metrics, self.events):
                if w.held:
                    self._said(w, True, w.flush())
        if self.unwritable is None:
            for w in (self.metrics, self.events):
                if w.over_bound:
                    self.unwritable = (f"the run directory cannot be written: {w.held} lines of {w.path} held "
                                       f"unwritten (more than {w.max_held}), {w.error}")
                    self.log(f"stopping the run: {self.unwritable}")
                    self._apply(self.proto.on_stop(EXIT_RUN_DIR_UNWRITABLE, self.unwritable, now))
                    break

    def _said(self, writer: HeldLineWriter, was_failing: bool, ok: bool) -> None:
        """One log line when a file starts failing, one when its held lines are written."""
        if not was_failing and not ok:
            self.log(f"cannot write {writer.path}: {writer.error}; holding its lines in memory (at most "
                     f"{writer.max_held}) and retrying; the run goes on")
        elif was_failing and ok:
            self.log(f"{writer.path} is written again: the held lines are on disk")

    # ---- the loop ----------------------------------------------------------------------
    def serve(self) -> int:
        tick = min(0.05, self.cfg.heartbeat_interval)
        if self.heartbeat_interval > self.cfg.heartbeat_interval:
            self.log(f"{self.cfg.replicas} replicas: heartbeats every {self.heartbeat_interval:.2f}s, silent for "
                     f"{self.heartbeat_timeout:.1f}s = dead (budget {self.cfg.heartbeat_budget:g}/s)")
        next_scan = 0.0
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
                pace(now)  # between steps too, garbage cycles are collected (core/coordinator/gc_pacing.py)
                self._guard(now)
                if now >= self.next_beat:
                    self._beat(now)
                self._retry_held(now)
                if self.result is not None:
                    break
                if self.rebuilding:
                    self._maybe_rebuild(now)
                    continue
                # The silence scan is O(R): once per tick, not once per batch of messages
                # (under load the selector returns after every few messages).
                if now >= next_scan:
                    next_scan = now + tick
                    for r, silence in self._silent(now):
                        self._apply(self.proto.on_lost(r, f"no heartbeat for {silence:.1f}s", now))
                self._apply(self.proto.on_tick(now))
        except ProtocolError as e:
            self.log(f"PROTOCOL ERROR (nothing was committed for this step): {e}")
            self.result = (3, str(e))
        finally:
            if self.result is not None:
                code, reason = self.result
                self._flush_refusals(self.now(), force=True)
                self._write(self.events, {"kind": "run_end", "code": code, "reason": reason, "wall_time": self.now(),
                                          "max_heartbeat_gap": self.max_gap, "refused": self.refused,
                                          "heartbeat_interval": self.heartbeat_interval,
                                          "heartbeat_timeout": self.heartbeat_timeout})
            if self.launcher is not None:
                # who is still a member: the launcher waits for those to see the end and exit, and
                # stops the others at once (a replica fenced for stalling for good never exits)
                self._send(self.launcher, {"t": "ended", "members": sorted(self.proto.members)})
            lost = [(w, w.held) for w in (self.metrics, self.events) if not w.close()]
            for conn in list(self.by_replica.values()) + list(self.strangers):
                conn.sock.close()
        code, reason = self.result
        if lost and self.unwritable is None:
            # a run that ends with lines still held is not a complete record: said, and not exit 0
            code, reason = EXIT_RUN_DIR_UNWRITABLE, "the run ended with lines it could not write: " + "; ".join(
                f"{n} of {w.path} lost ({w.error})" for w, n in lost)
        self.log(f"finished: {reason}")
        return code

    def _beat(self, now: float) -> None:
        """A heartbeat to every connection that heard nothing for a beat (O(R) once a beat)."""
        self.next_beat = now + self.beat_interval
        conns = list(self.by_replica.values()) + ([self.launcher] if self.launcher is not None else [])
        for conn in conns:
            if now - conn.last_sent >= self.beat_interval:
                self._send_line(conn, _HEARTBEAT, now)

    def _maybe_rebuild(self, now: float) -> None:
        """Rebuild once every expected replica reported or is known gone, or at the deadline."""
        heard = set(self.rebuild_hellos) | self.rebuild_exited
        if not (self.rebuild_expect <= heard or now >= self.rebuild_deadline):
            return
        self.rebuilding = False
        missing = sorted(self.rebuild_expect - heard)
        self.log(f"rebuilding from {len(self.rebuild_hellos)} report(s)"
                 + (f"; no report from replicas {missing} within {self.rebuild_wait:.1f}s (the collective timeout "
                    f"plus 4 x {self.rebuild_gap:.2f}s, the longest gap in the members' work)" if missing else ""))
        reports = [h.get("report") or {} for h in self.rebuild_hellos.values()]
        # (a hello without a report is a worker's first: it never reached the old coordinator; a
        # worker's step before generation 0 is 0 even in a resumed run, so it is not compared)
        if reports and self.recorded_step < self.proto.current_step() and all(
                not rep.get("member") and rep.get("gen", -1) == -1 for rep in reports):
            # It died during start-up (nothing formed, nothing committed): start-up goes on here,
            # with the hellos it has (they answer the workers' wait for generation 0).
            self._write(self.events, {"kind": "rebuilt", "startup": True, "reports": len(reports), "at": now})
            self.log("the old coordinator died during start-up: start-up goes on")
            for r, hello in sorted(self.rebuild_hellos.items()):
                self._apply(self.proto.on_hello(r, hello, now), self.by_replica.get(r))
        else:
            self._apply(self.proto.rebuild(self.rebuild_hellos, now, self.recorded_step, self.rebuild_gap))
        for r in sorted(self.rebuild_exited):
            self._apply(self.proto.on_exit(r, "exited", now))

    def _rebuild_hello(self, conn: _Conn, msg: dict, now: float) -> None:
        """A worker's hello to a restarted coordinator: its report is kept for the rebuild."""
        r = msg["replica"]
        if not 0 <= r < self.cfg.replicas or r in self.by_replica:
            return self._refuse(conn, f"hello as replica {r} while rebuilding: unknown or already reported", now,
                                close=True)
        conn.replica = r
        self.by_replica[r] = conn
        self.rebuild_hellos[r] = msg
        self.proto.note_pid(r, msg.get("pid"))
        rep = msg.get("report") or {}
        self.log(f"replica {r} reported step {rep.get('step')} generation {rep.get('gen')} "
                 f"(wait {rep.get('wait') or '-'}; {len(self.rebuild_hellos)}/{len(self.rebuild_expect)})")
        self._send(conn, {"t": "rebuilt", "heartbeat_interval": self.heartbeat_interval})

    def _send(self, conn: _Conn, msg: dict) -> None:
        self._send_line(conn, dumps(msg) + b"\n", self.now())

    @staticmethod
    def _send_line(conn: _Conn, line: bytes, now: float) -> None:
        """A line outside the protocol's actions (a beat, an answer, a last word): a failed send
        is not a loss here, its closing is seen by the reading side."""
        conn.last_sent = now
        try:
            conn.sock.sendall(line)
        except OSError:
            pass

    def _guard(self, now: float) -> None:
        """What bounds a peer without the token, once per loop: connections past their hello
        deadline are closed, the listener is polled again after a back-off, and the interval's
        refusals are written as one line. O(connections closed) + O(1)."""
        while self.strangers:
            conn = next(iter(self.strangers))
            if now - conn.accepted < self.hello_timeout:
                break
            self._close_stranger(conn, f"no hello within {self.hello_timeout:g}s", now)
        if self.accept_paused_until is not None and now >= self.accept_paused_until:
            self.accept_paused_until = None
            self.sel.register(self.listener, selectors.EVENT_READ)
        self._flush_refusals(now)

    def _close_stranger(self, conn: _Conn, what: str, now: float) -> None:
        """Close a connection that is not a member's or the launcher's (counted, not one line each)."""
        self._count_refusal(conn, what, now, closed=True)
        conn.refusals = -1
        self._drop(conn)

    def _accept(self) -> None:
        now = self.now()
        try:
            sock, addr = self.listener.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):  # the peer gave up in between
            return
        except OSError as e:
            if e.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                return
            # Out of descriptors: the listener stays readable, so polling it again at once would
            # spin. Stop polling it for a moment, and free what strangers hold (the store, in this
            # process, needs descriptors too: every rendezvous goes through it).
            self.accept_backoffs += 1
            self.sel.unregister(self.listener)
            self.accept_paused_until = now + ACCEPT_BACKOFF
            for conn in list(self.strangers)[:max(1, len(self.strangers) // 2)]:
                self._close_stranger(conn, f"closed to free descriptors ({errno.errorcode[e.errno]})", now)
            if self.accept_backoffs == 1 or self.accept_backoffs % 100 == 0:
                self.log(f"accept: {e}: not accepting for {ACCEPT_BACKOFF:g}s ({self.accept_backoffs} time(s))")
            return
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:  # already reset by the peer
            sock.close()
            return
        sock.settimeout(SEND_TIMEOUT)
        peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
        if len(self.strangers) >= self.max_strangers:  # the oldest goes: a worker's hello comes at once
            self._close_stranger(next(iter(self.strangers)),
                                 f"more than {self.max_strangers} connections without a hello", now)
        conn = _Conn(sock, now, peer)
        self.strangers[conn] = None
        self.sel.register(sock, selectors.EVENT_READ, conn)
        # A first beat at once: the peer then knows this coordinator beats, and judges its
        # silence from the start (one that froze before its first beat would never be judged).
        self._send_line(conn, _HEARTBEAT, self.now())

    def _drop(self, conn: _Conn) -> None:
        conn.closed = True
        self.strangers.pop(conn, None)
        conn.parts, conn.size = [], 0
        try:
            self.sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
        if conn.replica is not None and self.by_replica.get(conn.replica) is conn:
            del self.by_replica[conn.replica]

    def _silent(self, now: float) -> list[tuple[int, float]]:
        """(replica, seconds of silence) of each member silent past its limit, O(R).

        The limit is the heartbeat timeout once the replica has voted. Before its
        first vote a worker is in its first step, paying one-time costs (first calls,
        lazy imports, first-touch page faults of torch's libraries) inside C code that
        holds the GIL, so its heartbeat thread cannot run: on a loaded machine this was
        seen to silence every worker at once for over 1.5 s before step 0, and all of
        them were declared dead ("no replica left"). Until then silence is judged by
        the collective timeout, the deadline for work of unknown length; a crash is
        still seen at once (its connection closes). The price: a replica that freezes
        during its first step is caught after the collective timeout, not the
        heartbeat one."""
        hb, cold = self.heartbeat_timeout, max(self.heartbeat_timeout, self.cfg.collective_timeout)
        return [(r, now - c.last_seen) for r, c in list(self.by_replica.items())
                if now - c.last_seen > (hb if c.voted else cold)]

    def _read(self, conn: _Conn) -> None:
        if conn.closed:  # dropped earlier in this select() batch: what it had is not read
            return
        gone = "control connection closed (process gone)"
        try:
            chunk = conn.sock.recv(65536)
        except OSError as e:  # reset, or timed out: said as such, a closed connection is not the only way
            chunk, gone = b"", f"control connection failed: {type(e).__name__}: {e}"
        now = self.read_at = self.now()
        if not chunk:
            reporter = conn.replica is not None and self.by_replica.get(conn.replica) is conn
            self._drop(conn)
            # Only the replica's registered connection speaks for it: a connection it replaced
            # (a reconnect's hello, read earlier) closing now says nothing about the replica.
            if self.rebuilding:  # gone before the rebuild: it is not a member of it
                if reporter:
                    self.rebuild_hellos.pop(conn.replica, None)
            elif reporter:
                self._apply(self.proto.on_lost(conn.replica, gone, now))
            return
        if conn.replica is not None:
            self.max_gap = max(self.max_gap, now - conn.last_seen)
        conn.last_seen = now
        for line in self._lines(conn, chunk, now):
            if not line.strip():
                continue
            msg, why = read_line(line)  # a vote or a ready comes typed (core/contract/step_messages.py)
            if msg is None:
                self._refuse(conn, why, now)
            else:
                self._dispatch(conn, msg, now)
            if conn.closed or self.result is not None:
                return  # closed, or the run ended

    def _lines(self, conn: _Conn, chunk: bytes, now: float) -> list[bytes]:
        """The complete lines `chunk` ends (O(len(chunk)): only the new bytes are searched; a long
        line is kept in pieces and joined once). A line past the limit (`MAX_LINE_BYTES`, or
        `MAX_HELLO_BYTES` before the hello) is refused as it grows, and the rest of it dropped."""
        limit = MAX_LINE_BYTES if conn.replica is not None or conn is self.launcher else MAX_HELLO_BYTES
        i = chunk.find(b"\n")
        if i < 0:
            if not conn.skipping:
                conn.parts.append(chunk)
                conn.size += len(chunk)
                if conn.size > limit:
                    self._oversized(conn, conn.size, limit, now)
            return []
        lines: list[bytes] = []
        if conn.skipping:  # the newline ends the oversized line being dropped
            conn.skipping = False
        elif conn.size + i > limit:
            size, conn.parts, conn.size = conn.size + i, [], 0
            self._refuse(conn, f"oversized line ({size} bytes > {limit})", now, close=conn in self.strangers)
            if conn.closed:
                return []
        elif conn.parts:
            conn.parts.append(chunk[:i])
            lines.append(b"".join(conn.parts))
        else:
            lines.append(chunk[:i])
        *more, rest = chunk[i + 1:].split(b"\n")
        lines += more
        conn.parts, conn.size = ([rest], len(rest)) if rest else ([], 0)
        return lines

    def _oversized(self, conn: _Conn, size: int, limit: int, now: float) -> None:
        conn.parts, conn.size, conn.skipping = [], 0, True
        self._refuse(conn, f"oversized line ({size} bytes > {limit})", now, close=conn in self.strangers)

    def _refuse(self, conn: _Conn, what: str, now: float, close: bool = False) -> None:
        """Drop what `conn` sent, counted in the interval's refusal line; close it if it keeps at
        it. A member's connection (a peer holding the join token) is not refused line by line:
        a message its replica cannot have meant fences it (`ProtocolStateMachine.on_bad`), and the run
        goes on without it."""
        if conn.closed:
            return
        conn.refusals += 1
        member = conn.replica is not None and self.by_replica.get(conn.replica) is conn
        if member and not self.rebuilding:
            self._count_refusal(conn, what, now, closed=True)
            conn.refusals = -1
            self._apply(self.proto.on_bad(conn.replica, f"it sent a message that was refused: {what}", now))
            if not conn.closed:  # (the protocol had already let it go)
                self._send(conn, {"t": "fenced", "reason": what})
                self._drop(conn)
            return
        close = close or conn.refusals >= MAX_REFUSALS
        self._count_refusal(conn, what, now, closed=close)
        if not close:
            return
        conn.refusals = -1  # closed: read nothing more from it
        self._send(conn, {"t": "refused", "reason": what})  # so it does not take the close for a crash
        self._drop(conn)
        if member:
            self._apply(self.proto.on_lost(conn.replica, f"its connection was closed: {what}", now))

    def _count_refusal(self, conn: _Conn, what: str, now: float, closed: bool = False) -> None:
        """One refused message (or closed connection) into the interval's summary: events.jsonl gets
        one "refused" line per `REFUSAL_INTERVAL` with refusals, whatever a peer sends."""
        self.refused += 1
        w = self.refusal_window
        if w is None:
            w = self.refusal_window = {"kind": "refused", "since": now, "count": 0, "closed": 0, "peers": set(),
                                       "what": {}, "first": {"peer": conn.peer, "replica": conn.replica,
                                                             "what": what}}
        w["count"] += 1
        w["closed"] += int(closed)
        if len(w["peers"]) < 10_000:  # (a bound on the summary's own memory)
            w["peers"].add(conn.peer)
        whats = w["what"]
        key = re.sub(r"\d+", "N", what)[:80]  # one key per kind of refusal, not per number in it
        if key in whats or len(whats) < 32:
            whats[key] = whats.get(key, 0) + 1
        else:
            whats["(other)"] = whats.get("(other)", 0) + 1
        if closed and conn.replica is not None:
            self.log(f"closed the connection of {conn.peer} (replica {conn.replica}): {what}")

    def _flush_refusals(self, now: float, force: bool = False) -> None:
        w = self.refusal_window
        if w is None or (not force and now - w["since"] < REFUSAL_INTERVAL):
            return
        self.refusal_window = None
        rec = {**w, "peers": len(w["peers"]), "until": now, "at": now}
        self._write(self.events, rec)
        self.log(f"refused {w['count']} message(s)/connection(s) from {len(w['peers'])} peer(s) "
                 f"({w['closed']} closed) in {now - w['since']:.1f}s: {dict(list(w['what'].items())[:3])}")

    def _dispatch(self, conn: _Conn, msg: dict | Vote | Ready, now: float) -> None:
        kind = msg.get("t") if type(msg) is dict else msg.TYPE
        self.messages += 1
        if kind == "hb":
            if conn.replica is None and conn is not self.launcher:
                return self._refuse(conn, "hb before a hello", now)
            self.heartbeats += 1
            # the training thread's count rides on the beat: a change is progress (a beat alone is liveness)
            if (p := msg.get("p")) is not None and p != conn.progress and self.by_replica.get(conn.replica) is conn:
                conn.progress = p
                self.proto.on_progress(conn.replica, now)
            return
        if kind in ("launcher", "exited", "rank_lost"):
            return self._from_launcher(conn, msg, now)
        if kind == "hello":
            if conn.replica is not None:
                return self._refuse(conn, "a second hello on one connection", now)
            if not self._token_ok(msg):
                return self._refuse(conn, f"hello as replica {msg.get('replica')} with a wrong join token", now,
                                    close=True)
            if msg.get("standby") and not self.rebuilding:
                # a worker's heartbeat thread, after a connection this coordinator closed on purpose
                # (it said why on that one, which the training thread reads): nothing to take here
                return self._drop(conn)
            old = self.by_replica.get(msg["replica"])
            if old is not None and msg.get("report") is not None and self.proto.same_process(msg["replica"],
                                                                                             msg.get("pid")):
                # The same process reconnecting: its old connection's close has not been read yet.
                self._drop(old)
                if self.rebuilding:
                    self.rebuild_hellos.pop(msg["replica"], None)
                else:
                    self._apply(self.proto.on_lost(msg["replica"], "it reconnected: its old connection is gone", now))
            self.strangers.pop(conn, None)  # said who it is: a member, a newcomer, or closed below
            if self.rebuilding:
                return self._rebuild_hello(conn, msg, now)
            r = msg["replica"]
            conn.replica = r
            # a dead replica's slot takes a new connection only from a newcomer (protocol: admission)
            if 0 <= r < self.cfg.replicas and r not in self.by_replica and \
                    self.proto.slot_open_to(r, msg.get("can_heal") is True):
                self.by_replica[r] = conn
            self._apply(self.proto.on_hello(r, msg, now), conn)
            return
        r = conn.replica
        if r is None:
            return self._refuse(conn, f"{kind} before a hello", now)
        if self.by_replica.get(r) is not conn:
            return  # fenced: it was a member once, and is closed
        if self.rebuilding:
            return  # of the dead coordinator's generation: the rebuild decides what happens to it
        if kind == "vote":
            conn.voted = True
        self.proto.on_progress(r, now)  # a member's message is work done, whatever it says
        # the step's messages (R of each a step) came typed from the wire; the others are dicts
        if kind == "vote":
            return self._apply(self.proto.on_vote(r, msg, now))
        if kind == "ready":
            return self._apply(self.proto.on_ready(r, msg, now))
        handler = {"join": self.proto.on_join, "fail": self.proto.on_fail, "healed": self.proto.on_healed,
                   "stop_run": self.proto.on_stop_run}.get(kind)
        if handler is not None:
            self._apply(handler(r, msg, now))

    def _token_ok(self, msg: dict) -> bool:
        """Whether a hello (a replica's or the launcher's) shows the run's join token (constant time)."""
        return hmac.compare_digest(str(msg.get("token", "")).encode(), self.join_token.encode())

    def _from_launcher(self, conn: _Conn, msg: dict, now: float) -> None:
        """The launcher's line: it says who it is (with the join token), then which
        worker processes exited, so a replica lost before its hello is known at once, and
        which replica of many ranks lost a rank, so its loss is known before its leader's
        connection closes (core/launch/exit_notices.py)."""
        if msg["t"] == "launcher":
            if conn.replica is not None or self.launcher is not None:
                return self._refuse(conn, "a launcher hello on a replica's or a second connection", now)
            if not self._token_ok(msg):
                return self._refuse(conn, "launcher hello with a wrong join token", now, close=True)
            self.launcher = conn
            self.strangers.pop(conn, None)
            return
        if conn is not self.launcher:
            return self._refuse(conn, "exited from a connection that is not the launcher's", now)
        r = msg["replica"]
        if msg["t"] == "rank_lost":
            if self.rebuilding:  # its processes are being killed: unless a later set's hello is in, it is gone
                hello = self.rebuild_hellos.get(r)
                if hello is None or hello.get("pid") == msg["pid"]:
                    self.rebuild_exited.add(r)
                    self.rebuild_hellos.pop(r, None)
                return
            return self._apply(self.proto.on_rank_lost(r, msg["rank"], msg["pid"], msg["how"], now))
        if self.rebuilding:
            self.rebuild_exited.add(r)
            self.rebuild_hellos.pop(r, None)
            return
        self._apply(self.proto.on_exit(r, msg["how"], now))

    # ---- actions ------------------------------------------------------------------------
    def _apply(self, actions: list[Out], origin: _Conn | None = None) -> None:
        """Carry out the state machine's actions in order, each by the handler of its kind."""
        batch = _Batch(origin, self.now())
        handlers = self._handlers
        for a in actions:
            handlers[a.kind](a, batch)
        # A failed send makes its replica lost, and that loss has consequences (an
        # abort, a new generation) that are applied only after every action of this
        # batch: applied at once, they would overtake the rest of a broadcast, and
        # the other replicas would read [abort, commit] or [abort(g), gen(g)].
        for r, reason in batch.lost:
            self._apply(self.proto.on_lost(r, reason, self.now()))

    def _do_send(self, a: Out, batch: "_Batch") -> None:
        conn = self.by_replica.get(a.replica)
        if conn is None:
            return
        conn.last_sent = batch.sent_at
        if a.reason:
            self.log(a.reason)
        if a.msg is not batch.last_msg:  # a broadcast is one message object sent to many: encode it once
            batch.last_msg, batch.line = a.msg, dumps(a.msg) + b"\n"
        try:
            conn.sock.sendall(batch.line)
        except OSError as e:
            self._drop(conn)
            batch.lost.append((a.replica, f"send failed: {e}"))
            return
        if self.hooks is not None:
            self.hooks.after_send(a.msg, a.replica)

    def _do_close(self, a: Out, batch: "_Batch") -> None:
        # A refused hello closes the connection it came on, not the member's.
        origin = batch.origin
        conn = origin if origin is not None and origin.replica == a.replica else self.by_replica.get(a.replica)
        if conn is not None and conn is origin and self.by_replica.get(a.replica) is not conn:
            self._refuse(conn, f"hello as replica {a.replica} refused: {a.reason}", self.now(), close=True)
        elif conn is not None:
            self.log(f"replica {a.replica} removed: {a.reason}")
            # Said before the close, so a worker that wakes up reads why (fenced: it may
            # rejoin; refused: never) instead of a bare close, which means a dead coordinator.
            self._send(conn, {"t": "fenced", **a.msg, "reason": a.reason})
            self._drop(conn)

    def _do_commit(self, a: Out, batch: "_Batch") -> None:
        # The commit messages went out before this action (the protocol orders them so).
        settle()  # the run's state survived a step: later collections need not rescan it
        done = self.now()
        if a.msg["step"] <= self.recorded_step:
            return  # recorded by the coordinator before a restart: one line per step
        self.recorded_step = a.msg["step"]
        self._write(self.metrics, {**a.msg, "wall_time": done, "coordinator": {
            "vote_to_commit_s": done - self.read_at, "cpu_s": time.process_time(),
            "heartbeats": self.heartbeats, "messages": self.messages}})

    def _do_recovery(self, a: Out, batch: "_Batch") -> None:
        rec = a.msg
        self.log(
            f"recovered step {rec['step']} in {rec['recovery_seconds']:.3f}s: {rec['fault']}; "
            f"generation {rec['generation']} = {rec['survivors']}, redid {len(rec['redone'])} microbatches"
        )
        self._write(self.events, {"kind": "recovery", **rec})

    def _do_event(self, a: Out, batch: "_Batch") -> None:
        self.log(a.reason)
        self._write(self.events, a.msg)

    def _do_finish(self, a: Out, batch: "_Batch") -> None:
        self.result = (a.code, a.reason)
