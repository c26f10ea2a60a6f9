"""Daemon threads inside the collective backend, waited for before the interpreter's exit.

Contract:
- `inside(what, until)` is a context manager a daemon thread wraps around a call into
  the backend's C++ code that may block (destroying an abandoned communicator, a
  rendezvous that an abort left behind): while it runs, the call is listed with
  `until`, the monotonic time by which the backend's own timeout has ended it.
  `enter` and `leave` are the same in two halves, for a call listed by one thread
  (burying a communicator) and made by another (the graveyard's reaper).
- At the interpreter's exit (an `atexit` handler, registered on import), every listed
  thread is waited for until its `until`; one still inside then is named in one line
  on stderr and left. `wait()` is that wait, callable directly.
- Why: such a call releases the GIL and takes it back as it returns. Once Python is
  finalizing, a daemon thread that takes the GIL is ended with pthread_exit, whose
  unwinding through the C++ frames (noexcept destructors) calls std::terminate: the
  process dies with SIGABRT and "terminate called without an active exception" after
  its run had completed. Seen in CI: a user's loop ended normally 80 ms after a state
  transfer, while `comm.Graveyard` was destroying that transfer's communicator; and
  reproduced with a communicator buried with a broadcast in flight just before the exit.
  atexit handlers run before the finalizing starts, so a thread that leaves the backend
  during this wait does so safely.
- Workers that end with `worker_exit.exit_now` (os._exit) skip atexit and never wait;
  this is for a user's loop that returns normally, whose own atexit handlers (logging's,
  a tracker's) must still run, so it cannot be ended with os._exit.
- The list is process-wide, as the interpreter's exit is; it holds threads, never a
  process group.
"""
from __future__ import annotations

import atexit
import contextlib
import itertools
import sys
import threading
import time
from typing import Iterator

_lock = threading.Condition()
_inside: dict[int, tuple[str, float]] = {}  # key -> (what, monotonic time the backend's timeout ends it)
_keys = itertools.count(1)


def enter(what: str, until: float) -> int:
    """List a call into the backend, doing `what`, that its timeout ends by `until`; its key."""
    with _lock:
        key = next(_keys)
        _inside[key] = (what, until)
        return key


def leave(key: int) -> None:
    """The call `enter` listed has returned."""
    with _lock:
        del _inside[key]
        _lock.notify_all()


@contextlib.contextmanager
def inside(what: str, until: float) -> Iterator[None]:
    """`enter` ... `leave` around the calling thread's block."""
    key = enter(what, until)
    try:
        yield
    finally:
        leave(key)


def listed() -> list[str]:
    """What the threads inside the backend are doing, now."""
    with _lock:
        return [what for what, _ in _inside.values()]


def wait() -> list[str]:
    """Wait for every listed thread to leave the backend, each at most until its `until`.

    Returns what is still inside once every deadline has passed (empty when all left)."""
    with _lock:
        while True:
            now = time.monotonic()
            pending = [until for _, until in _inside.values() if until > now]
            if not pending:
                return [what for what, _ in _inside.values()]
            _lock.wait(timeout=min(pending) - now)


def _wait_at_exit() -> None:
    left = wait()  # at once when nothing is listed
    if left:
        print(f"exit: still inside the collective backend past its timeout: {'; '.join(left)}",
              file=sys.stderr, flush=True)


atexit.register(_wait_at_exit)
