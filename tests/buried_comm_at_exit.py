"""A process that ends normally while its graveyard destroys a communicator (tests/test_backend_threads.py).

Two gloo ranks of one generation on two threads; rank 0 issues a broadcast from rank 1,
which never joins it, and buries its communicator with the broadcast in flight: the
reaper's destructor waits out the 1 s backend timeout. The script then ends at once. An
object whose `__del__` sleeps 2 s keeps the interpreter finalizing while the destructor
returns, which is when a daemon thread taking the GIL back is ended inside C++.
With the argument `unlisted`, backend_threads' atexit wait is unregistered first: the
behaviour before it.
"""
import atexit
import sys
import time

import torch

from conftest import gloo_pair  # (this script's folder is tests/, first on sys.path)

from recover.core.worker import backend_threads
from recover.core.worker.comm import Graveyard

TIMEOUT = 2.0  # s; the margin for the main module's end to reach finalization under load

store, comms = gloo_pair(TIMEOUT)  # (the store stays referenced to the end)

work = comms[0].pg.broadcast(torch.zeros(4), 1)  # rank 1 never joins: in flight until the timeout
graveyard = Graveyard()
buried_at = time.monotonic()
graveyard.bury(comms.pop(0))
del work
assert backend_threads.listed(), "the buried communicator is listed"


class FinalizesSlowly:
    def __del__(self) -> None:
        time.sleep(max(0.0, buried_at + TIMEOUT + 1.5 - time.monotonic()))


slow = FinalizesSlowly()
if sys.argv[1:] == ["unlisted"]:
    atexit.unregister(backend_threads._wait_at_exit)
print("main module done", flush=True)
