"""How a worker process ends: one line saying why, and a documented exit code.

Contract:
- Exit codes of a worker (a `recover train` worker, or a user's loop around
  `Replica`; docs/own-loop.md "How a worker ends"):
    0  the run is complete: every step committed and recorded
    1  the coordinator stopped the run (its reason is the line: no replica left, no
       progress, a non-finite loss, initial weights that differ, ...)
    3  this replica was fenced out (rejoin off, or fenced on evidence) or refused
    4  the coordinator is gone: silent, or no answer within the reconnect timeout
    5  a replica of many ranks lost one of its ranks, frozen or gone
       (core/parallel/rank_beats.py): its other ranks end with it
    6  this replica was the checkpoint writer and `--checkpoint-failures` saves in a
       row failed (core/training/resilient.py); the launcher then stops the whole run, exit 1
       (core/launch/end_policy.py), with the error as its reason
  One more code is not a worker's but the run's, next to these so that the numbers
  stay distinct:
    7  the run directory (--out) could not be written: recover's coordinator held
       more than `MAX_HELD_LINES` (core/storage/results.py) unwritten lines of one file, or held some
       when the run ended (core/coordinator/service.py), or `recover train` could not
       write its own files there (summary.json: experiments/run.py). The coordinator
       and `recover train` exit with it; the workers hear `stop` and exit 1.
  `code_of(run_ended)` is a `RunEnded`'s code (its `code` attribute).
- `exit_now(code, line)` writes the line to stderr (the replica's log), flushes
  stdout and stderr, and ends the process with `os._exit(code)`.
- `install(label)` makes an uncaught `RunEnded` in the main thread of a user's loop
  end the process that way (the line: "<label> exits with code N: reason"), not
  with a traceback; any other uncaught exception keeps Python's traceback (it is a
  bug to read), then ends the same way, with code 1. `Replica` installs it, and so does a follower rank's handle
  (core/parallel/follower.py); a loop
  that catches `RunEnded` itself is untouched.
- Why `os._exit` and not a normal interpreter exit: when a run ends, the worker
  still holds process groups (the last generation's communicator; abandoned ones
  in `comm.Graveyard`, whose destructor waits out the backend timeout of an
  operation a dead peer never finished) and daemon threads blocked in C++ (the
  heartbeat, the graveyard, gloo's own). The interpreter's teardown destroys
  those objects under the threads' feet: that is where "terminate called without
  an active exception" came from, after a traceback had ended `main` (the old
  worker's `os._exit` was never reached when an exception escaped). Nothing left
  in the process is worth a teardown at that point: the coordinator writes the
  records, checkpoints are awaited before the exit, and the two streams are
  flushed here. So the end is explicit.
Importing this module imports no torch.
"""
from __future__ import annotations

import os
import sys
import threading
from typing import Any

EXIT_COMPLETE = 0
EXIT_STOPPED = 1
EXIT_FENCED = 3
EXIT_COORDINATOR_GONE = 4
EXIT_RANK_LOST = 5
EXIT_CHECKPOINTS_FAILED = 6
EXIT_RUN_DIR_UNWRITABLE = 7  # the coordinator's and `recover train`'s, never a worker's

_installed = threading.Lock()
_label = ["worker"]


def code_of(err: BaseException) -> int:
    """The exit code a `RunEnded` stands for (EXIT_STOPPED for anything without one)."""
    code = getattr(err, "code", None)
    return code if isinstance(code, int) else EXIT_STOPPED


def line_of(label: str, err: BaseException) -> str:
    """The one line a worker ends with."""
    return f"{label} exits with code {code_of(err)}: {getattr(err, 'reason', str(err))}"


def exit_now(code: int, line: str | None = None) -> None:
    """Write `line` (if any), flush both streams, end the process with `code` (see the contract)."""
    try:
        if line:
            print(line, file=sys.stderr, flush=True)
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def install(label: str) -> None:
    """An uncaught RunEnded ends the process with its line and code (once per process; the
    latest label names it)."""
    _label[0] = label
    if not _installed.acquire(blocking=False):
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], err: BaseException, tb: Any) -> None:
        if getattr(err, "code", None) is not None and hasattr(err, "reason"):  # a RunEnded
            exit_now(code_of(err), line_of(_label[0], err))
        previous(kind, err, tb)  # a bug: its traceback is the thing to read
        if isinstance(err, Exception):  # (not KeyboardInterrupt: Python's own ending stands)
            exit_now(EXIT_STOPPED)

    sys.excepthook = hook
