"""How a `Communicator` waits for a gloo collective (core/worker/comm.py, `_wait_blocking`).

On gloo the caller blocks inside the backend in `WAIT_SLICE` slices and checks its
abort and deadline between them. Checked over real gloo ranks (two threads, one
TCPStore on a free port): a peer that arrives many slices late still gives the
right sum, and an abort requested mid-wait ends it as `CollectiveError`. And, as
pure logic on a stand-in work object: a slice that times out just as the work
completes is a success, not a failure; a work that failed is a `CollectiveError`.
"""
from __future__ import annotations

import threading
import time

import torch

from conftest import gloo_pair

from recover.core.worker.comm import WAIT_SLICE, CollectiveError, Communicator


def test_a_peer_many_slices_late_still_gives_the_right_sum():
    store, comms = gloo_pair()
    late = 30 * WAIT_SLICE.total_seconds()  # the early rank's wait runs through ~30 slices
    results: dict[int, torch.Tensor] = {}

    def side(rank: int) -> None:
        if rank == 1:
            time.sleep(late)
        t = torch.full((1000,), float(rank + 1))
        comms[rank].allreduce(t, timeout=30.0)
        results[rank] = t

    threads = [threading.Thread(target=side, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert set(results) == {0, 1}
    for t in results.values():
        assert torch.equal(t, torch.full((1000,), 3.0))


def test_an_abort_requested_mid_wait_ends_it():
    store, comms = gloo_pair()
    requested = threading.Event()
    threading.Timer(0.05, requested.set).start()
    error: list[BaseException] = []
    try:
        # rank 1 does not join until rank 0's wait has been aborted
        comms[0].allreduce(torch.ones(10), timeout=30.0,
                           should_abort=lambda: "new generation" if requested.is_set() else None)
    except CollectiveError as e:
        error.append(e)
    finally:
        comms[1].allreduce(torch.ones(10), timeout=30.0)  # let the abandoned operation finish
    assert error and "aborted: new generation" in str(error[0])


class _Work:
    """A stand-in for a backend work: each timed wait times out, and it has completed after `slices`."""

    def __init__(self, slices: int, error: str | None = None):
        self.slices, self.error, self.waits = slices, error, 0

    def is_completed(self) -> bool:
        return self.waits >= self.slices

    def wait(self, timeout=None) -> bool:
        if timeout is not None:
            self.waits += 1
            raise RuntimeError("Operation timed out!")  # even on the slice it completes in
        if self.error:
            raise RuntimeError(self.error)
        return True


def _comm() -> Communicator:
    return Communicator(pg=None, generation=4, rank=0, size=2, backend="gloo")


def test_a_slice_that_times_out_as_the_work_completes_is_a_success():
    work = _Work(slices=3)
    _comm()._wait(work, "allreduce", timeout=30.0, should_abort=None)
    assert work.waits == 3


def test_a_failed_work_is_a_collective_error_naming_it():
    work = _Work(slices=2, error="Connection closed by peer")
    try:
        _comm()._wait(work, "allreduce", timeout=30.0, should_abort=None)
    except CollectiveError as e:
        assert e.generation == 4 and "allreduce failed: Connection closed by peer" in str(e)
    else:
        raise AssertionError("a failed work returned normally")
