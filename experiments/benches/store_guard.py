"""The store guard's cost (`recover bench store-guard`): a rendezvous through it against the bare store.

Contract:
- For each N in `--clients`, N store clients in one child process (one thread each, each keyed by
  the run's token as a worker's is: `core.launch.startup.keyed_store`) run a rendezvous's store traffic:
  each sets its own address key, then reads every client's (N sets and N^2 gets, the pattern of a
  full-mesh group's address exchange). Timed from the moment all N are connected to the last read,
  once straight to the store and once through a `StoreGuard` in front of it (the coordinator's
  set-up: store and guard in one process, the workers in others), `--repeats` times, interleaved.
- Writes OUT/NAME.json: per N the median seconds of each, their ratio, the requests the guard
  forwarded, and its per-request cost; prints a table. Nothing here is asserted on: on a shared
  machine the figures are ratios taken in one run.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from recover.core.contract.store_guard import StoreGuard, host_local_store, store_namespace

TOKEN = "bench-token"

# The child: N threads, each a worker's keyed client; prints the seconds from "all connected" to "all read".
CLIENTS = r"""
import sys, threading, time
from datetime import timedelta
import torch.distributed as dist
from recover.core.launch.startup import keyed_store
port, n, token = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
clients = [keyed_store(dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300)), token)
           for _ in range(n)]
start = threading.Barrier(n + 1)
def one(i, store):
    start.wait()
    store.set(f"bench/addr{i}", str(i).encode())
    for j in range(n):
        assert store.get(f"bench/addr{j}") == str(j).encode()
threads = [threading.Thread(target=one, args=(i, c)) for i, c in enumerate(clients)]
for t in threads:
    t.start()
start.wait()
t0 = time.perf_counter()
for t in threads:
    t.join()
print(time.perf_counter() - t0, flush=True)
"""


def _rendezvous(port: int, n: int) -> float:
    proc = subprocess.run([sys.executable, "-c", CLIENTS, str(port), str(n), TOKEN], capture_output=True, text=True,
                          timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"the clients failed:\n{proc.stderr[-2000:]}")
    return float(proc.stdout.strip().splitlines()[-1])


def bench_store_guard(args: argparse.Namespace) -> int:
    rows = []
    for n in args.clients:
        direct, guarded = [], []
        for rep in range(args.repeats):
            # a fresh store each time: the keys of one rendezvous are not the next one's
            for through_guard in ((False, True) if rep % 2 == 0 else (True, False)):
                store = host_local_store()
                guard = StoreGuard("127.0.0.1", 0, store.port, store_namespace(TOKEN)) if through_guard else None
                try:
                    (guarded if through_guard else direct).append(_rendezvous(guard.port if guard else store.port, n))
                finally:
                    if guard is not None:
                        guard.close()
                    del store
        d, g = statistics.median(direct), statistics.median(guarded)
        requests = n + n * n
        rows.append({"clients": n, "requests": requests, "direct_s": d, "guarded_s": g, "ratio": g / d,
                     "guard_us_per_request": (g - d) / requests * 1e6, "direct_runs": direct, "guarded_runs": guarded})
        print(f"N={n:5d}  {requests:8d} requests  direct {d * 1e3:8.1f} ms  guarded {g * 1e3:8.1f} ms  "
              f"x{g / d:5.2f}  (+{(g - d) / requests * 1e6:.1f} us/request)", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{args.name}.json"
    path.write_text(json.dumps({"bench": "store-guard", "repeats": args.repeats, "machine": platform.platform(),
                                "when": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows}, indent=1) + "\n")
    print(f"wrote {path}")
    return 0
