"""The local launcher: one coordinator process and one worker process per replica.

Contract:
- The coordinator (store + membership) is its own process, never a worker, so no
  worker's death takes the rendezvous store down.
- Workers are started with `subprocess.Popen` (torch's `mp.spawn` SIGTERMs every
  child when one dies, so it cannot host survivors), or, with
  RECOVER_WORKER_START=fork, forked from a server that has torch imported under
  the same contract (core/launch/forkserver.py), each in its own process
  group (a replica's processes die together on a "lost node"), with its output
  streamed to DIR/logs/replica<r>.log.
- Every child is started with PR_SET_PDEATHSIG=SIGKILL and is killed, by PID,
  when the launcher returns, is interrupted (Ctrl-C, SIGTERM) or fails: no orphan
  process survives the launcher.
- `run()` reports how every process exited (`ProcessExit`), and the launcher's
  hooks (`LauncherHooks`) see the PIDs and a periodic tick, which is how the fault
  injector fires wall-clock faults and ends timed hangs.
- A coordinator that accepts them (`"accepts_exits"` in its first line) is told
  of every worker exit at once (`exit_notices.py`): a worker lost before its hello
  does not hold generation 0 until the start-up deadline.
- Each run gets a fresh random join token (RECOVER_JOIN_TOKEN), set in the
  environment of the coordinator and of every worker, and of nothing else.
- Replacements (`replace_after` seconds, None = never): a worker that exits
  non-zero while the job runs gets a new process in its slot (same replica id)
  that many seconds later, as a cluster scheduler replacing a failed node would;
  it joins the running job through the coordinator's admission (core/worker/replica.py).
  A slot whose replacements keep dying at once (a bad node, a broken image) is
  not restarted forever: each replacement that exits non-zero within
  `QUICK_DEATH_SECONDS` of its start doubles the next wait (`replacement_delay`),
  and after `MAX_QUICK_DEATHS` in a row the slot is left empty, saying so; a
  replacement that lived longer starts the count again.
  A replica of many ranks is replaced as a whole, every rank a new process; each
  process set of a slot is numbered (RECOVER_INCARNATION: 0 for the first), so its
  groups inside the replica use store keys of their own, never its predecessor's.
  Each worker is started with RECOVER_WORKER_STARTED (time.time() at its start),
  pids.json is rewritten, and the hooks' `on_start` is called again with the new
  PIDs (a fault injector then targets the replacement).
- A coordinator that dies by a signal while workers run (SIGKILL, a crash) is
  restarted, up to `coordinator_restarts` times, on the same host and ports with
  `--rebuild --expect <running replicas>`: the workers reconnect and it rebuilds
  the run from their reports (core/coordinator/service.py). Such workers are told
  so (RECOVER_COORDINATOR_SUPERVISED=1): they keep reconnecting for as long as
  it takes, since the launcher either restarts the coordinator or ends the job. One that stops beating on the
  exit-notice connection for `coordinator_timeout` seconds (frozen) is SIGKILLed
  by its PID first. pids.json and the hooks' `on_start` then name the new one.
  A restarted coordinator's exit is recorded with `restarted` set: it is not the
  job's verdict.
- When the job is over, and its verdict, is the end policy's call
  (core/launch/end_policy.py): by default the job ends when the coordinator exits and
  its code is the verdict; `FailFast` ends it as soon as a worker exits non-zero
  (a plain data-parallel job cannot outlive a worker). The launcher stays the
  only loop that reaps and kills processes.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Protocol, Sequence

from recover.core.launch import forkserver
from recover.core.launch.end_policy import CoordinatorEnds, EndPolicy, JobView
from recover.core.launch.exit_notices import ExitNotices
from recover.core.launch.exit_wait import ExitWaiter
from recover.core.launch.forkserver import ForkedProcess
from recover.core.launch.replica_processes import ReplicaProcesses
from recover.core.launch.startup import JOIN_TOKEN_ENV, new_join_token
from recover.core.contract import env_names
from recover.core.launch.coordinator_command import rebuild_args

_PR_SET_PDEATHSIG = 1
QUICK_DEATH_SECONDS = 60.0  # a replacement that fails sooner than this after its start died "at once"
MAX_QUICK_DEATHS = 5  # replacements of one slot that died at once, in a row, before it is left empty


def replacement_delay(replace_after: float, quick_deaths: int) -> float:
    """Seconds before a slot's next replacement: `replace_after`, doubled per replacement of the
    slot that died at once in a row (so a crash-looping slot costs ever less)."""
    return replace_after * 2 ** quick_deaths


def _die_with_parent() -> None:
    """preexec_fn: have the kernel SIGKILL this child if the launcher dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux: rely on the launcher's own cleanup
        pass


def describe_exit(code: int | None) -> str:
    if code is None:
        return "running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return "exited 0" if code == 0 else f"exited with code {code}"


@dataclass
class ProcessExit:
    """How one child process ended."""

    role: str  # "coordinator" or "worker"
    replica: int  # -1 for the coordinator
    pid: int
    returncode: int | None
    at: float  # seconds since launch
    how: str
    restarted: bool = False  # a coordinator that the launcher restarted (so not the job's verdict)


class LauncherHooks(Protocol):
    """What the launcher tells an observer (the fault injector, a progress bar)."""

    def on_start(self, pids: dict[int, list[int]], t0: float) -> None: ...

    def on_tick(self, elapsed: float) -> None: ...

    def on_exit(self, exit: ProcessExit) -> None: ...


@dataclass
class LaunchResult:
    """The verdict of one launch."""

    returncode: int  # the end policy's verdict (the coordinator's code by default), 130 on interrupt
    wall_time: float
    exits: list[ProcessExit] = field(default_factory=list)
    reason: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


class Launcher:
    """Start the coordinator and the workers; watch them; clean up everything."""

    def __init__(
        self,
        out_dir: str | os.PathLike,
        coordinator_argv: Sequence[str],
        worker_argv: Callable[[int], Sequence[str]],
        replicas: int | Sequence[int],
        env: dict[str, str] | None = None,
        hooks: Sequence[LauncherHooks] = (),
        end: EndPolicy | None = None,
        tick_seconds: float = 0.02,
        grace_seconds: float = 10.0,
        replace_after: float | None = None,
        fork_workers: bool | None = None,
        coordinator_restarts: int = 0,
        coordinator_timeout: float | None = None,
        ranks_per_replica: int = 1,
    ):
        self.out = Path(out_dir)
        self.coordinator_argv = list(coordinator_argv)
        self.worker_argv = worker_argv
        # A count R means replicas 0..R-1; a list names them (a job restarted
        # with survivors keeps their ids).
        self.replica_ids = list(range(replicas)) if isinstance(replicas, int) else list(replicas)
        self.replicas = len(self.replica_ids)
        self.env = {**os.environ, **(env or {})}
        self.hooks = list(hooks)
        self.end: EndPolicy = end if end is not None else CoordinatorEnds()
        self.tick_seconds = tick_seconds
        self.grace_seconds = grace_seconds
        # Fork `python -m` workers from a server that has torch imported (tests), or
        # spawn a fresh interpreter each (default: what a restart really costs).
        self.fork_workers = forkserver.wanted() if fork_workers is None else fork_workers
        self.coordinator: subprocess.Popen | ForkedProcess | None = None
        self.workers: dict[int, subprocess.Popen | ForkedProcess] = {}
        self.exits: list[ProcessExit] = []
        self._interrupted: str | None = None
        self._logs: list = []  # the coordinators' logs (their stdout is drained here); one per restart
        self._notices: ExitNotices | None = None
        self._t0 = time.monotonic()  # run()'s start: the launcher's log lines count from it
        self.replace_after = replace_after
        self._replace_at: dict[int, float] = {}  # replica -> monotonic time its replacement starts
        self._replaced_at: dict[int, float] = {}  # replica -> monotonic start of its current replacement
        self._quick_deaths: dict[int, int] = {}  # replica -> its replacements that died at once, in a row
        self._worker_env: dict[str, str] = {}
        self.coordinator_restarts = coordinator_restarts  # restarts left (see the contract)
        self.coordinator_timeout = coordinator_timeout  # None: a silent coordinator is never killed
        self._coordinator_info: dict = {}
        self.ranks_per_replica = ranks_per_replica  # > 1: each replica is that many processes, ended together
        self._incarnations: dict[int, int] = {}  # replica -> the last of its process sets started (0: the first)
        self._exit_waiter = ExitWaiter()  # the tick's sleep, cut short by an exit (core/launch/exit_wait.py)

    # ---- process start -------------------------------------------------------------
    def _start_coordinator(self, timeout: float = 60.0, argv: Sequence[str] | None = None) -> dict:
        argv = list(self.coordinator_argv if argv is None else argv)
        log_path = self.out / "logs" / "coordinator.log"
        log = open(log_path, "ab")
        self._logs.append(log)
        if self.fork_workers and forkserver.forkable(argv):
            # Its stdout reaches us through a FIFO, as a pipe would (core/launch/forkserver.py).
            fifo = self.out / "logs" / ".coordinator.stdout"
            fifo.unlink(missing_ok=True)
            os.mkfifo(fifo)
            reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # does not wait for the writer
            self.coordinator = forkserver.ForkServer.shared().start(
                argv, self.env, str(log_path), stdout_path=str(fifo), new_session=True)
            os.set_blocking(reader, True)
            self.coordinator.stdout = os.fdopen(reader, "rb")
            fifo.unlink()
        else:
            self.coordinator = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=log, env=self.env,
                preexec_fn=_die_with_parent, start_new_session=True,
            )
        # The coordinator's first stdout line announces its ports.
        box: dict = {}

        def read_line() -> None:
            box["line"] = self.coordinator.stdout.readline()

        t = threading.Thread(target=read_line, daemon=True)
        t.start()
        t.join(timeout)
        line = box.get("line", b"")
        if not line:
            code = self.coordinator.poll()
            raise RuntimeError(
                f"coordinator did not start ({describe_exit(code)}); see {self.out / 'logs' / 'coordinator.log'}"
            )
        info = json.loads(line)

        # Keep draining its stdout into the log so it can never block on a full pipe.
        def drain() -> None:
            for chunk in iter(lambda: self.coordinator.stdout.read1(65536), b""):
                log.write(chunk)
                log.flush()

        threading.Thread(target=drain, daemon=True).start()
        return info

    def _start_worker(self, replica: int, env: dict[str, str]) -> subprocess.Popen | ForkedProcess | ReplicaProcesses:
        if self.ranks_per_replica == 1:
            return self._start_rank(replica, 0, env)
        # the replica's ranks, leader first; any one of them dying ends the others (core/launch/replica_processes.py).
        # Each set of them counts (a replacement's groups must not meet its predecessor's store keys)
        n = self._incarnations[replica] = self._incarnations.get(replica, -1) + 1
        env = {**env, env_names.INCARNATION: str(n)}
        return ReplicaProcesses([self._start_rank(replica, i, env) for i in range(self.ranks_per_replica)],
                                on_rank_failed=lambda p: self._tell_rank_lost(replica, p))

    def _start_rank(self, replica: int, rank: int, env: dict[str, str]) -> subprocess.Popen | ForkedProcess:
        argv = list(self.worker_argv(replica))
        env = {**env, env_names.REPLICA: str(replica), env_names.WORKER_STARTED: repr(time.time()),
               env_names.LOCAL_RANK: str(rank), env_names.RANKS_PER_REPLICA: str(self.ranks_per_replica),
               env_names.REPLICAS: str(len(self.replica_ids))}
        log_path = self.out / "logs" / (f"replica{replica}.log" if rank == 0 else f"replica{replica}_rank{rank}.log")
        if self.fork_workers and forkserver.forkable(argv):
            # Same process, group, output and parent-death contract as below, without
            # a fresh `import torch` (core/launch/forkserver.py).
            return forkserver.ForkServer.shared().start(argv, env, str(log_path))
        # The child writes its own copy of the descriptor: the launcher's is closed at once, so a run
        # with a replacement every hour holds no descriptor per worker it ever started.
        with open(log_path, "ab") as log:
            return subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                preexec_fn=_die_with_parent, process_group=0,
            )

    # ---- the watch loop ----------------------------------------------------------------
    def run(self) -> LaunchResult:
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        t0 = self._t0 = time.monotonic()
        old_handlers = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                old_handlers[sig] = signal.signal(sig, self._on_signal)
        # A fresh random join token per run: the coordinator requires it in every
        # hello, so only the workers started here (their environment) can join.
        self.env[JOIN_TOKEN_ENV] = new_join_token()
        if self.coordinator_restarts > 0:
            # a dead coordinator comes back, or the job ends and its workers with it: a worker's
            # reconnect needs no fixed bound of its own, however long a restart takes under load
            self.env[env_names.COORDINATOR_SUPERVISED] = "1"
        try:
            info = self._coordinator_info = self._start_coordinator()
            if info.get("accepts_exits"):
                self._notices = ExitNotices(info["host"], info["control_port"], self.env[JOIN_TOKEN_ENV])
            env = {
                **self.env,
                env_names.STORE_ADDR: f"{info['host']}:{info['store_port']}",
                env_names.CONTROL_ADDR: f"{info['host']}:{info.get('control_port', 0)}",
            }
            self._worker_env = env
            for r in self.replica_ids:
                self.workers[r] = self._start_worker(r, env)
            self._announce_pids(t0)
            return self._watch(t0)
        finally:
            self._cleanup(t0)
            self._exit_waiter.close()
            if self._notices is not None:
                self._notices.close()
            for sig, h in old_handlers.items():
                signal.signal(sig, h)
            for log in self._logs:
                log.close()

    def _announce_pids(self, t0: float) -> None:
        """pids.json and the hooks' on_start: the current process of every replica."""
        pids = {r: list(getattr(p, "pids", [p.pid])) for r, p in self.workers.items()}
        (self.out / "pids.json").write_text(
            json.dumps({"coordinator": self.coordinator.pid, "replicas": pids}, indent=1)
        )
        for h in self.hooks:
            h.on_start(pids, t0)

    def _start_replacements(self, live: dict[int, subprocess.Popen], t0: float) -> None:
        """Start the replacements that are due (see the module docstring)."""
        now = time.monotonic()
        due = sorted(r for r, at in self._replace_at.items() if at <= now)
        for r in due:
            del self._replace_at[r]
            self._replaced_at[r] = time.monotonic()
            self.workers[r] = live[r] = self._start_worker(r, self._worker_env)
            print(f"[launcher {now - t0:8.3f}s] replica {r}: replacement started (pid {self.workers[r].pid})",
                  file=sys.stderr, flush=True)
        if due:
            self._announce_pids(t0)

    def _on_signal(self, signum, frame) -> None:
        self._interrupted = signal.Signals(signum).name

    def _record(self, role: str, replica: int, proc: subprocess.Popen, t0: float,
                restarted: bool = False) -> ProcessExit:
        e = ProcessExit(role, replica, proc.pid, proc.returncode, time.monotonic() - t0, describe_exit(proc.returncode),
                        restarted)
        self.exits.append(e)
        if role == "worker" and self._notices is not None:
            self._notices.exited(replica, e.how)
        for h in self.hooks:
            h.on_exit(e)
        return e

    def _watch(self, t0: float) -> LaunchResult:
        """Reap exits and tick the hooks until the end policy says the job is over."""
        live = dict(self.workers)
        while True:
            if self._interrupted:
                return LaunchResult(130, time.monotonic() - t0, self.exits, f"interrupted by {self._interrupted}")
            self._reap(live, t0)
            verdict = self.end.decide(JobView(live, tuple(self.exits)))
            if verdict is not None:
                if verdict.wait_for_workers:
                    # Give the workers a moment to see the end and exit by themselves: those the
                    # coordinator still counted as members. Any other (a replica fenced for a
                    # stall that never ends) would not: it is stopped at once, by `_cleanup`.
                    waiting = self._members_to_wait_for(live, t0)
                    end = time.monotonic() + self.grace_seconds
                    while waiting and time.monotonic() < end:
                        self._reap(waiting, t0)
                        for h in self.hooks:  # e.g. a timed hang ends and its process leaves
                            h.on_tick(time.monotonic() - t0)
                        self._nap(waiting)
                return LaunchResult(verdict.returncode, time.monotonic() - t0, self.exits, verdict.reason)
            if self._replace_at:
                self._start_replacements(live, t0)
            self._kill_frozen_coordinator(t0)
            for h in self.hooks:
                h.on_tick(time.monotonic() - t0)
            self._nap(live)

    def _nap(self, live: dict) -> None:
        """One tick, or less: until a worker process of `live` exits. A dead rank of a replica of
        many ranks is the coordinator's news through this launcher (`_tell_rank_lost`), so its exit
        is looked at when it happens, not at the next tick.

        The coordinator's own exit is still seen on the tick. Why: when a run ends, the launcher
        stops at once the workers the coordinator did not name members (a replica fenced for a
        stall would never exit by itself), and a worker told the end needs a moment to say why
        it ends. Woken by the coordinator's exit, the launcher killed such workers before they
        had (a fresh-clone CI run: a start-up refusal's replicas left no reason in their logs)."""
        self._exit_waiter.wait([pid for p in live.values() for pid in getattr(p, "pids", [p.pid])],
                               self.tick_seconds)

    def _members_to_wait_for(self, live: dict[int, subprocess.Popen], t0: float) -> dict[int, subprocess.Popen]:
        """The live workers the ending coordinator named members (all of them if it named none)."""
        members = self._notices.members_at_end() if self._notices is not None else None
        if members is None:
            return dict(live)
        others = sorted(set(live) - set(members))
        if others:
            print(f"[launcher {time.monotonic() - t0:8.3f}s] the run ended without replica(s) {others} as members: "
                  f"stopping their processes", file=sys.stderr, flush=True)
        return {r: p for r, p in live.items() if r in members}

    def _reap(self, live: dict[int, subprocess.Popen], t0: float) -> None:
        """Record every worker that exited since the last look, and the coordinator once.

        Exits seen in one look are recorded deaths by signal first: when a SIGKILLed
        worker and a peer whose collective then failed (exit 1) are both gone by the
        same tick, the kill is the cause and the other its consequence, so the first
        failure recorded (what FailFast and the baselines report) is the kill, not
        whichever replica id comes first."""
        exited = [(r, p) for r, p in list(live.items()) if p.poll() is not None]
        for r, p in sorted(exited, key=lambda rp: rp[1].returncode >= 0):  # stable: else by replica
            del live[r]
            self._record("worker", r, p, t0)
            if self.replace_after is not None and p.returncode != 0:
                self._schedule_replacement(r, t0)
        if self.coordinator.poll() is not None and not any(e.pid == self.coordinator.pid for e in self.exits):
            restart = (self.coordinator_restarts > 0 and self.coordinator.returncode < 0
                       and bool(live or self._replace_at) and not self._interrupted)
            self._record("coordinator", -1, self.coordinator, t0, restarted=restart)
            if restart:
                self._restart_coordinator(live, t0)

    def _tell_rank_lost(self, r: int, p: ReplicaProcesses) -> None:
        """A rank of replica r failed, and its others are about to be killed (`ReplicaProcesses.poll`):
        when that rank is not the leader, tell the coordinator now that the replica is lost, one
        process exit before its leader's connection closes (core/launch/exit_notices.py). A leader's
        own death closes that connection as soon as a notice could come."""
        rank = p.failed_rank
        if rank is None or rank == 0:
            return
        how = describe_exit(p.procs[rank].returncode)
        print(f"[launcher {time.monotonic() - self._t0:8.3f}s] replica {r}: rank {rank} {how}; stopping its other "
              f"ranks", file=sys.stderr, flush=True)
        if self._notices is not None:
            self._notices.rank_lost(r, rank, p.pid, how)

    def _schedule_replacement(self, r: int, t0: float) -> None:
        """The slot's next replacement, later each time one died at once; none past MAX_QUICK_DEATHS."""
        now = time.monotonic()
        started = self._replaced_at.pop(r, None)
        if started is not None and now - started < QUICK_DEATH_SECONDS:
            self._quick_deaths[r] = self._quick_deaths.get(r, 0) + 1
        else:
            self._quick_deaths[r] = 0  # the first process of the slot, or one that lived: no streak
        n = self._quick_deaths[r]
        if n >= MAX_QUICK_DEATHS:
            print(f"[launcher {now - t0:8.3f}s] replica {r}: not replaced again: its last {n} replacements "
                  f"failed within {QUICK_DEATH_SECONDS:g}s of their start", file=sys.stderr, flush=True)
            return
        self._replace_at[r] = now + replacement_delay(self.replace_after, n)

    def _kill_frozen_coordinator(self, t0: float) -> None:
        """SIGKILL, by its PID, a coordinator silent past `coordinator_timeout` (then `_reap` restarts it)."""
        if self.coordinator_timeout is None or self._notices is None or self.coordinator.poll() is not None:
            return
        silent = self._notices.silent_for()
        if silent > self.coordinator_timeout:
            print(f"[launcher {time.monotonic() - t0:8.3f}s] coordinator (pid {self.coordinator.pid}) silent for "
                  f"{silent:.1f}s: frozen; killing it to restart it", file=sys.stderr, flush=True)
            self._notices.close()
            self._notices = None
            try:
                os.kill(self.coordinator.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _restart_coordinator(self, live: dict, t0: float) -> None:
        """Start a coordinator on the dead one's host and ports that rebuilds the run (see the contract)."""
        self.coordinator_restarts -= 1
        info = self._coordinator_info
        dead = self.coordinator
        argv = [*self.coordinator_argv, *rebuild_args(str(info["host"]), info["store_port"], info["control_port"],
                                                     sorted(live))]
        print(f"[launcher {time.monotonic() - t0:8.3f}s] coordinator (pid {dead.pid}) "
              f"{describe_exit(dead.returncode)}: restarting it on port {info['control_port']} to rebuild the run "
              f"from replicas {sorted(live)}", file=sys.stderr, flush=True)
        if self._notices is not None:
            self._notices.close()
            self._notices = None
        try:
            new = self._start_coordinator(argv=argv)
        except RuntimeError as e:  # its exit is reaped (and judged) on the next look
            print(f"[launcher] the restarted coordinator did not start: {e}", file=sys.stderr, flush=True)
            return
        if new.get("accepts_exits"):
            self._notices = ExitNotices(new["host"], new["control_port"], self.env[JOIN_TOKEN_ENV])
        self._announce_pids(t0)

    def _cleanup(self, t0: float) -> None:
        """Kill, by PID, every child still running: SIGCONT+SIGTERM, then SIGKILL."""
        procs = [(r, p) for r, p in self.workers.items()]
        if self.coordinator is not None:
            procs.append((-1, self.coordinator))
        running = [(r, p) for r, p in procs if p.poll() is None]
        for _, p in running:
            # A frozen process must wake to die politely; SIGTERM goes first so that it is
            # pending when SIGCONT wakes the process, which then dies without running
            # another line of its own code (a frozen-for-good worker stays fenced).
            for sig in (signal.SIGTERM, signal.SIGCONT):
                try:
                    p.send_signal(sig)  # every rank of a replica of many
                except ProcessLookupError:
                    pass
        end = time.monotonic() + 2.0
        for r, p in running:
            try:
                p.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    p.kill()
                except ProcessLookupError:
                    pass
                p.wait()
            if not any(e.pid == p.pid for e in self.exits):
                self._record("coordinator" if r < 0 else "worker", r, p, t0)


def python_module_argv(module: str, *args: str) -> list[str]:
    """argv to run `python -m module args...` with this interpreter."""
    return [sys.executable, "-m", module, *args]
