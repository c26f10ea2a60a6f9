"""A fork server for `python -m module` and `python script.py` workers: torch is imported once,
not once per process.

Why: a worker's first seconds are `import torch` (1.5-4 s of CPU here). A test suite
or a grid that starts hundreds of short runs pays that for every process, and on
two cores it is most of the time. The fork server imports torch (and
torch.distributed) once; every worker is then a `fork()` of it, which takes
milliseconds and shares the imported pages.

Contract:
- `ForkServer.start(argv, env, log)` starts `argv` (which must be
  `python_module_argv(module, ...)`: `[sys.executable, "-m", module, *args]`, or
  `[sys.executable, "path/to/script.py", *args]`, a user's own loop under
  `recover launch`) as a new process that behaves as `subprocess.Popen(argv, env=env, stdout=log,
  stderr=STDOUT, process_group=0)` with PR_SET_PDEATHSIG=SIGKILL would:
  - a process of its own with its own PID (faults are injected by that PID), in a
    process group of its own (a "lost node" kills the group);
  - `os.environ` is exactly `env`; `sys.argv` is what `python -m` would set;
    stdout and stderr go to `log`, stdin is /dev/null; a script runs as `__main__`
    with its own folder first on `sys.path`, as `python script.py` puts it there;
  - it is SIGKILLed by the kernel when the launcher dies;
  - its exit code is what the module's `sys.exit` (or an uncaught exception: 1)
    gives, and a signal shows as a negative code, as with Popen.
- The worker is the launcher's child in the sense that matters: the server forks
  twice and the middle process exits, so the worker is re-parented to the
  launcher, which makes itself a child subreaper (PR_SET_CHILD_SUBREAPER) for
  exactly that. The launcher reaps it with `waitpid` like any child, through
  `ForkedProcess`, which has the part of Popen's interface the launcher uses.
- What a fork does not redo is only what `import torch` does. Environment
  variables that torch reads at import time (OMP_NUM_THREADS and the like) are the
  server's, so `ForkServer` is used only where those do not vary between workers;
  the project sets threads through `torch.set_num_threads` at run time.
- Who uses it: the launcher, when RECOVER_WORKER_START=fork, for the workers (the
  project's modules, or a user's script under `recover launch`) and the coordinator (whose first stdout line reaches the launcher through a FIFO). The default stays
  `spawn` (a fresh interpreter per worker), because a benchmark of restart time
  must pay what a restart on a cluster pays; the test suite sets `fork`
  (tests/conftest.py), where start-up cost is only waiting.

One server per launcher process, started on first use and ended with it (its
PDEATHSIG, and `close()` at exit). If it dies, the next `start` starts another. The
server is `python -m` this module, or, when the launcher has already imported what the
server preloads and runs a single thread (a launcher that was itself forked from a
server, as the test suite starts its CLIs), a fork of the launcher that clears what a
fresh interpreter would not have (`_SelfForkedServer`): the same contract for a fork
instead of a second `import torch`.
"""
from __future__ import annotations
from recover.core.contract import env_names

import atexit
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Sequence

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36

#: Modules the server imports before it forks anything: the expensive ones. A worker
#: imports torch.distributed.checkpoint (core/training/checkpoint.py) and, on building AdamW,
#: torch._dynamo: sampled with py-spy, those two were most of a forked worker's CPU
#: before its first step. Neither starts a thread at import, so forking after is safe.
PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "torch._dynamo", "numpy")

START_ENV = env_names.WORKER_START


def _prctl(option: int, value: int) -> bool:
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, value) == 0
    except OSError:  # not Linux
        return False


def wanted() -> bool:
    """True when this process's launches should fork workers (RECOVER_WORKER_START=fork)."""
    mode = os.environ.get(START_ENV, "spawn")
    if mode not in ("spawn", "fork"):
        raise ValueError(f"{START_ENV}: must be 'spawn' or 'fork', got {mode!r}")
    return mode == "fork"


def forkable(argv: Sequence[str]) -> bool:
    """True for the argv the server can start: this interpreter's `-m module ...` or
    `script.py ...` (a file that exists; an option such as `-c` or `-X` is not forkable)."""
    if len(argv) < 2 or argv[0] != sys.executable:
        return False
    if argv[1] == "-m":
        return len(argv) >= 3
    return argv[1].endswith(".py") and not argv[1].startswith("-") and os.path.isfile(argv[1])


class PolledProcess:
    """What `subprocess.Popen` offers on top of `poll()` and `send_signal()`, by polling:
    `wait(timeout)`, `terminate()`, `kill()` (a subclass gives `poll`, `send_signal`, `args`)."""

    args: list
    returncode: int | None

    def poll(self) -> int | None:
        raise NotImplementedError

    def send_signal(self, sig: int) -> None:
        raise NotImplementedError

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() >= end:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.005)
        return self.returncode

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkedProcess(PolledProcess):
    """A worker started by the fork server: the subset of `subprocess.Popen` the launcher uses."""

    def __init__(self, pid: int, args: Sequence[str]):
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere; nothing more to learn
                self.returncode = -signal.SIGKILL
                return self.returncode
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass


class ForkServer:
    """The launcher's side: start the server once, then ask it for workers."""

    _shared: "ForkServer | None" = None
    _shared_lock = threading.Lock()

    def __init__(self) -> None:
        if not _prctl(_PR_SET_CHILD_SUBREAPER, 1):
            raise OSError("PR_SET_CHILD_SUBREAPER unavailable: the fork server needs Linux")
        self._lock = threading.Lock()
        if _can_fork_self():
            self._proc = _SelfForkedServer()
        else:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", __name__, *PRELOAD],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None,
                preexec_fn=lambda: _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL), start_new_session=True,
            )
        line = self._proc.stdout.readline()
        if line.strip() != b"ready":
            self.close()
            raise RuntimeError(f"fork server did not start: {line!r}")

    @classmethod
    def shared(cls) -> "ForkServer":
        """This process's server, started on first use (or again, if it died)."""
        with cls._shared_lock:
            if cls._shared is None or cls._shared._proc.poll() is not None:
                cls._shared = cls()
                atexit.register(cls._shared.close)
            return cls._shared

    def start(self, argv: Sequence[str], env: dict[str, str], log_path: str,
              stdout_path: str | None = None, new_session: bool = False, cwd: str | None = None) -> ForkedProcess:
        """Start argv with stderr (and stdout, unless `stdout_path` names a file or FIFO
        for it) appended to `log_path`; in a session of its own if `new_session`
        (Popen's start_new_session), else in a process group of its own; in the folder
        `cwd` if given (Popen's cwd), else the server's."""
        if not forkable(argv):
            raise ValueError(f"the fork server starts only `{sys.executable} -m module ...` or "
                             f"`{sys.executable} script.py ...`, not {list(argv)!r}")
        script = argv[1] != "-m"
        request = {"argv": list(argv[1:] if script else argv[2:]), "script": script, "env": dict(env), "log": str(log_path), "launcher": os.getpid(),
                   "stdout": None if stdout_path is None else str(stdout_path), "session": new_session,
                   "cwd": None if cwd is None else str(cwd)}
        with self._lock:
            self._proc.stdin.write((json.dumps(request) + "\n").encode())
            self._proc.stdin.flush()
            reply = self._proc.stdout.readline()
        if not reply:
            raise RuntimeError("fork server exited")
        answer = json.loads(reply)
        if "error" in answer:
            raise RuntimeError(f"fork server could not start {list(argv)!r}: {answer['error']}")
        return ForkedProcess(answer["pid"], argv)

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self._proc.stdin.close()
                self._proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()


def _can_fork_self() -> bool:
    """True when this process can be the server's image: it has imported what the server
    preloads, and runs one thread (a fork copies only the calling thread; a lock another
    thread held would stay held in every worker). A launcher that was itself forked from a
    server (a test suite's, tests/conftest.py) is such a process: its server then costs a
    fork, not a fresh `import torch`. Not where the standard streams were replaced (a test
    runner's capture): a worker writes through the server's `sys.stdout`, which must be the
    file on its descriptor 1, as in a fresh interpreter."""
    own_streams = sys.stdin is sys.__stdin__ and sys.stdout is sys.__stdout__ and sys.stderr is sys.__stderr__
    return own_streams and all(m in sys.modules for m in PRELOAD) and threading.active_count() == 1


class _SelfForkedServer:
    """The server as a fork of this process (see `_can_fork_self`): what `Popen` of
    `python -m ...forkserver` gives `ForkServer` (stdin, stdout, poll, wait, kill), and in
    the child what a fresh interpreter would have: a session of its own, the launcher's
    death as its own (PDEATHSIG), default signal dispositions, no descriptor but its pipes
    and stderr, and none of this project's modules (each worker imports them afresh, under
    its own environment, as it would from the exec'd server)."""

    def __init__(self) -> None:
        to_server_r, to_server_w = os.pipe()
        from_server_r, from_server_w = os.pipe()
        parent = os.getpid()
        for stream in (sys.stdout, sys.stderr):  # what is buffered now is ours, not the server's to write again
            if stream is not None:
                stream.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.setsid()
                _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
                if os.getppid() != parent:  # the launcher died before the prctl
                    os._exit(1)
                # as exec would: every signal the launcher catches in Python goes back to its default
                # (an ignored one stays ignored), and SIGINT to the KeyboardInterrupt a new Python sets
                for sig in signal.valid_signals():
                    if sig != signal.SIGINT and callable(signal.getsignal(sig)):
                        signal.signal(sig, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.default_int_handler)
                os.dup2(to_server_r, 0)
                os.dup2(from_server_w, 1)
                os.closerange(3, os.sysconf("SC_OPEN_MAX") if os.sysconf("SC_OPEN_MAX") > 0 else 4096)
                for name in [n for n in sys.modules if n == "recover" or n.startswith("recover.")]:
                    del sys.modules[name]  # (this function's globals stay reachable through it)
                code = _serve_requests(os.fdopen(0, "rb"), os.fdopen(1, "wb"))
            finally:
                os._exit(code)  # never the launcher's atexit handlers
        os.close(to_server_r)
        os.close(from_server_w)
        self.pid = pid
        self.stdin = os.fdopen(to_server_w, "wb")
        self.stdout = os.fdopen(from_server_r, "rb")
        self._exited = ForkedProcess(pid, ["fork server"])

    def poll(self) -> int | None:
        return self._exited.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self._exited.wait(timeout)

    def kill(self) -> None:
        self._exited.kill()


# ---- the server's side -------------------------------------------------------------------------
def _become_worker(request: dict, report_fd: int) -> None:
    """In the grandchild: wait to be re-parented to the launcher, then run the module. Never returns."""
    code = 1
    try:
        # Open a FIFO for stdout before the launcher learns our PID: it reads it as soon
        # as it does, and a FIFO with no writer yet would read as end-of-file.
        stdout_fd = None if request["stdout"] is None else os.open(request["stdout"], os.O_WRONLY)
        if request["session"]:
            os.setsid()  # as Popen(start_new_session=True)
        else:
            os.setpgid(0, 0)  # a process group of its own, as Popen(process_group=0)
        os.write(report_fd, f"{os.getpid()}\n".encode())
        os.close(report_fd)
        # The middle process exits right after it reads our PID; until then our parent
        # is it, and a PDEATHSIG set now would fire on its exit. Wait for the move.
        deadline = time.monotonic() + 10.0
        while os.getppid() != request["launcher"]:
            if time.monotonic() > deadline:  # the launcher is gone (or no subreaper)
                os._exit(1)
            time.sleep(0.0005)
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != request["launcher"]:  # it died between the check and the prctl
            os._exit(1)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 2)
        os.dup2(log if stdout_fd is None else stdout_fd, 1)
        if request.get("cwd"):
            os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        # A fresh interpreter would put $PYTHONPATH on sys.path; so do we.
        sys.path[1:1] = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        import runpy

        try:
            if request.get("script"):
                path = request["argv"][0]
                sys.argv = list(request["argv"])
                # `python script.py` puts the script's folder first on sys.path (where `-m`
                # put the working directory): its sibling modules import as they would.
                sys.path[0] = os.path.dirname(os.path.realpath(path))
                runpy.run_path(path, run_name="__main__")
            else:
                module = request["argv"][0]
                sys.argv = [module, *request["argv"][1:]]  # runpy sets argv[0] to the module's file
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        except BaseException:
            # What the interpreter does with an uncaught exception: the process's own
            # sys.excepthook (a worker's ends a RunEnded with its one line and exit code).
            sys.excepthook(*sys.exc_info())
            code = 1
    finally:
        # Never unwind into the server's loop, and never run its atexit handlers.
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _serve() -> int:
    for name in sys.argv[1:]:
        __import__(name)
    return _serve_requests(sys.stdin.buffer, sys.stdout.buffer)


def _serve_requests(inp, out) -> int:
    """The server's loop: say "ready", then one worker per request line until `inp` closes."""
    out.write(b"ready\n")
    out.flush()
    for line in inp:
        request = json.loads(line)
        try:
            r, w = os.pipe()
            middle = os.fork()
            if middle == 0:
                os.close(r)
                if os.fork() == 0:
                    _become_worker(request, w)
                os._exit(0)
            os.close(w)
            with os.fdopen(r) as f:
                pid = int(f.readline())
            os.waitpid(middle, 0)  # once reaped, the worker has moved to the launcher
            out.write((json.dumps({"pid": pid}) + "\n").encode())
        except Exception as e:  # noqa: BLE001 - the launcher gets the reason
            out.write((json.dumps({"error": repr(e)}) + "\n").encode())
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(_serve())
