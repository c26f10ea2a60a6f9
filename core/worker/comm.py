"""Fault-tolerant collectives (layer 1): generation-scoped communicators with deadlines.

Contract:
- A `Communicator` belongs to exactly one generation. It is built over a
  `PrefixStore` ("gen<g>/") of the coordinator's store, so a communicator of one
  generation can never rendezvous with, or receive bytes meant for, another.
  There is no module-global process group: a communicator is an object, dropped and
  rebuilt mid-run.
- Every operation has a deadline. A peer's crash, a hang, a broken link, or an abort
  requested by the caller (the coordinator announced a new generation) surfaces as
  one exception type, `CollectiveError`, and never leaves the caller blocked past
  its deadline.
- Why waits in slices: measured on gloo, a SIGKILLed peer makes only its ring neighbours
  fail fast ("Connection closed by peer"); the other ranks wait out the whole gloo
  timeout, and abort() does not shorten it. So operations are issued with
  async_op and the caller waits in short slices, checking between them an abort
  check that is fed by the coordinator, which learns of a death from the first
  detector (or from the dead process's closed control socket). On gloo a slice
  is a blocking `work.wait(2 ms)`; elsewhere (nccl, whose timed-out wait aborts
  its communicator) the caller polls `is_completed()`, spinning 2 ms then
  sleeping. Why not poll on gloo too: a spinning caller takes a core from the
  backend's own threads. Measured by `recover bench transfer --models tiny small`
  on this 2-core machine (three runs each, alternated): a plain broadcast of
  1.4 MB 0.8-1.0 ms blocking against 1.7-2.7 ms polling, and of 10 MB 4.7-5.2 ms
  against 6.3-7.6 ms.
- A failed or abandoned operation may still be running inside the backend and may
  still write its tensor later; callers therefore reduce a fresh buffer, never
  their accumulator (see `accumulator.py`), and hand the communicator to a
  `Graveyard`: measured here, dropping the last reference to a gloo process group
  with an operation in flight blocks the dropping thread until that operation's
  backend timeout (28 s of a 30 s timeout, in the middle of a recovery), so the
  training thread must never be the one that drops it.
- The daemon threads left inside the backend (the graveyard's reaper in a destructor,
  an abandoned rendezvous) are listed in `backend_threads`, whose atexit handler waits
  for them, each at most its backend timeout (+5 s), before the interpreter finalizes:
  one that took the GIL back during finalization would abort the process.
- Each communicator rendezvous over a store client of its own, opened by the
  `open_store` it is built with and dropped with it. Why: a c10d TCPStore client
  is one socket whose requests are serialized, and a rendezvous abandoned by an
  abort stays inside the backend, blocked in the store's wait for a member that
  died, until the backend timeout. Through a shared client that dead wait held
  the next generation's rendezvous just as long (measured: a survivor of a loss
  at step 0 waited out the 30 s timeout before generation 1 formed); through a
  fresh client (~1 ms to open here) the next rendezvous starts at once.
"""
from __future__ import annotations

import queue
import threading
import time
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist

from recover.core.worker import backend_threads

AbortCheck = Callable[[], Optional[str]]
"""Returns a reason string when the caller wants the operation abandoned, else None."""

OpenStore = Callable[[], dist.Store]
"""Opens a new client of the rendezvous store (one per communicator: see the contract)."""

POLL_SECONDS = 0.0005
EXIT_SLACK = 5.0  # s past a backend timeout that the interpreter's exit waits for a call it bounds
WAIT_SLICE = timedelta(milliseconds=2)  # gloo: longest blind stretch of a wait (see `_wait_blocking`)


class CollectiveError(RuntimeError):
    """A collective (or building a communicator) failed, timed out or was aborted."""

    def __init__(self, generation: int, reason: str):
        super().__init__(f"generation {generation}: {reason}")
        self.generation = generation
        self.reason = reason


def _make_process_group(backend: str, store: dist.Store, rank: int, size: int, timeout: float):
    td = timedelta(seconds=timeout)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, td)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = td
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    raise ValueError(f"unknown backend {backend!r}")


class Communicator:
    """A process group for one generation's members, with deadline-bound operations."""

    def __init__(self, pg, generation: int, rank: int, size: int, backend: str, store: dist.Store | None = None,
                 timeout: float = 30.0):
        self.pg = pg
        self.timeout = timeout  # the backend's own: no operation of it outlives this
        self.store = store  # this communicator's own store client (the backend may still use it)
        self.generation = generation
        self.rank = rank
        self.size = size
        self.backend = backend

    @classmethod
    def build(
        cls,
        open_store: OpenStore,
        generation: int,
        rank: int,
        size: int,
        backend: str = "gloo",
        timeout: float = 30.0,
        should_abort: AbortCheck | None = None,
        namespace: str = "",
    ) -> "Communicator":
        """Rendezvous the `size` members of `generation` under "<namespace>gen<g>/".

        The store client comes from `open_store`, called once per build, so that
        no rendezvous abandoned earlier can hold this one up. The backend's connect
        step blocks until every member arrives; it runs (with opening the client)
        on a helper thread so that a member dying mid-rendezvous (or an abort)
        cannot hold the caller past `timeout`.
        """
        prefix = f"{namespace}gen{generation}/"
        result: dict = {}

        def connect() -> None:
            # listed while inside: an abandoned rendezvous returns up to `timeout` later,
            # maybe as the interpreter exits (core/worker/backend_threads.py)
            with backend_threads.inside(f"rendezvous of {prefix}", time.monotonic() + timeout + EXIT_SLACK):
                try:
                    result["store"] = store = open_store()
                    result["pg"] = _make_process_group(backend, dist.PrefixStore(prefix, store), rank, size, timeout)
                except BaseException as e:  # noqa: BLE001 - reported to the caller below
                    result["error"] = e

        t = threading.Thread(target=connect, name=f"connect-gen{generation}", daemon=True)
        t.start()
        deadline = time.monotonic() + timeout
        while t.is_alive():
            t.join(POLL_SECONDS * 10)
            if should_abort is not None and (reason := should_abort()):
                raise CollectiveError(generation, f"rendezvous aborted: {reason}")
            if time.monotonic() > deadline:
                raise CollectiveError(generation, f"rendezvous timed out after {timeout:.1f}s")
        if "error" in result:
            raise CollectiveError(generation, f"rendezvous failed: {result['error']}")
        return cls(result["pg"], generation, rank, size, backend, result["store"], timeout)

    def allreduce(
        self,
        tensor: torch.Tensor,
        timeout: float,
        should_abort: AbortCheck | None = None,
        while_in_flight: Callable[[], None] | None = None,
    ) -> None:
        """Sum `tensor` in place across the members, or raise CollectiveError.

        `while_in_flight` runs once right after the operation is issued (the fault
        injector's "allreduce" point); whatever it raises counts as the collective
        failing, as a broken link would make it.
        """
        try:
            work = self.pg.allreduce([tensor])
            if while_in_flight is not None:
                while_in_flight()
        except CollectiveError:
            raise
        except Exception as e:  # a backend error on issue, or an injected link failure
            raise CollectiveError(self.generation, f"allreduce failed: {e}") from e
        self._wait(work, "allreduce", timeout, should_abort)

    def broadcast(self, tensor: torch.Tensor, root: int, timeout: float,
                  should_abort: AbortCheck | None = None) -> None:
        """Overwrite `tensor` on every member with rank `root`'s, or raise CollectiveError.

        Used by the live state transfer (`state_transfer.py`); like `allreduce`, a
        receiver must pass a tensor nothing else reads until this returns, since an
        abandoned broadcast may still write into it."""
        try:
            work = self.pg.broadcast(tensor, root)
        except Exception as e:  # a backend error on issue
            raise CollectiveError(self.generation, f"broadcast failed: {e}") from e
        self._wait(work, "broadcast", timeout, should_abort)

    def broadcast_many(self, tensors: list[torch.Tensor], root: int, timeout: float,
                       should_abort: AbortCheck | None = None,
                       while_in_flight: Callable[[], None] | None = None,
                       after_each: Callable[[int], None] | None = None,
                       issued: list | None = None) -> None:
        """`broadcast` of each tensor, all issued before any is waited for (the backend runs
        them back to back instead of one Python round trip each); `timeout` is per tensor.
        `while_in_flight`, if given, runs once they are all issued (work that overlaps the wire);
        `after_each(i)` once tensor i's broadcast completed, while the later ones still travel.
        `issued`, if given, gets every issued operation (the backend's work handle), even when
        this raises: a caller that received into memory it keeps learns from them when an
        abandoned operation can no longer write (`is_completed()`)."""
        works = issued if issued is not None else []
        first = len(works)
        for t in tensors:
            try:
                works.append(self.pg.broadcast(t, root))
            except Exception as e:  # a backend error on issue
                raise CollectiveError(self.generation, f"broadcast failed: {e}") from e
        if while_in_flight is not None:
            while_in_flight()
        for i, work in enumerate(works[first:]):
            self._wait(work, "broadcast", timeout, should_abort)
            if after_each is not None:
                after_each(i)

    def _wait(self, work, what: str, timeout: float, should_abort: AbortCheck | None) -> None:
        if self.backend == "gloo":
            self._wait_blocking(work, what, timeout, should_abort)
            return
        deadline = time.monotonic() + timeout
        spin_until = time.monotonic() + 0.002  # most local collectives finish within a few ms
        while not work.is_completed():
            if should_abort is not None and (reason := should_abort()):
                raise CollectiveError(self.generation, f"{what} aborted: {reason}")
            now = time.monotonic()
            if now > deadline:
                raise CollectiveError(self.generation, f"{what} timed out after {timeout:.1f}s")
            if now > spin_until:
                time.sleep(POLL_SECONDS)
        try:
            work.wait()
        except Exception as e:
            raise CollectiveError(self.generation, f"{what} failed: {e}") from e

    def _wait_blocking(self, work, what: str, timeout: float, should_abort: AbortCheck | None) -> None:
        """gloo: block inside the backend (GIL released) for `WAIT_SLICE` at a time, checking the
        abort and the deadline between slices. A slice that ends before the work does raises
        without harming it (measured: the operation completes, with the right values, after any
        number of them); once `is_completed()`, an untimed wait gives the work's own outcome."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                work.wait(WAIT_SLICE)
                return
            except Exception:
                if work.is_completed():  # finished as the slice ended, or failed: its own outcome
                    try:
                        work.wait()
                    except Exception as e:
                        raise CollectiveError(self.generation, f"{what} failed: {e}") from e
                    return
            if should_abort is not None and (reason := should_abort()):
                raise CollectiveError(self.generation, f"{what} aborted: {reason}")
            if time.monotonic() > deadline:
                raise CollectiveError(self.generation, f"{what} timed out after {timeout:.1f}s")


class Graveyard:
    """Holds abandoned communicators and destroys them on a thread of its own.

    A process group's destructor waits for its in-flight operations, which after
    a peer's death means waiting out the backend timeout; here that wait happens
    off the training thread, one communicator at a time. A communicator is listed
    in `backend_threads` from its burial until it is destroyed, so the interpreter's
    exit waits for its destructor instead of ending the reaper inside it.
    """

    def __init__(self) -> None:
        self._queue: "queue.Queue[tuple[Communicator, int]]" = queue.Queue()
        self._thread: threading.Thread | None = None

    def bury(self, comm: "Communicator | None") -> None:
        if comm is None:
            return
        # Listed from now: its last operation was issued before this burial, so the backend
        # timeout ends it, and with it the destructor's wait, within `comm.timeout` of now.
        key = backend_threads.enter(f"destroying generation {comm.generation}'s communicator",
                                    time.monotonic() + comm.timeout + EXIT_SLACK)
        self._queue.put((comm, key))
        if self._thread is None:
            self._thread = threading.Thread(target=self._reap, name="comm-graveyard", daemon=True)
            self._thread.start()

    def _reap(self) -> None:
        while True:
            comm, key = self._queue.get()
            try:
                comm.pg = None  # the destructor (and its wait) runs here
                comm.store = None  # then its store client's socket is closed
                del comm
            finally:
                backend_threads.leave(key)
