"""The coordinator process: the rendezvous store, and (for `recover`) the membership.

Contract:
- It hosts the c10d `TCPStore` server that every communicator rendezvous over, and
  it is never a worker: killing any worker, replica 0 included, leaves the store up.
- Its first line on stdout is one JSON object {"host", "store_port",
  "control_port"} (ports chosen by the OS: port 0), which the launcher - or, on a
  cluster, the job script - hands to the workers. The run's join token is
  RECOVER_JOIN_TOKEN from its environment (the launcher sets it); when that is
  unset, `--mode recover` generates one and adds it to that line as "join_token".
- In `--mode recover` the advertised store port is a `StoreGuard` (core/contract/store_guard.py): the
  store itself listens on 127.0.0.1 only, and the guard forwards only requests whose keys lie in
  the run's namespace, derived from the join token (workers key theirs with
  `core.launch.startup.keyed_store`). A peer without the token can neither list, read, write nor delete
  a key of the run.
- `--mode store`: only the store, unguarded (the baselines' rendezvous: torchrun's agents cannot
  key theirs); it runs until SIGTERM/SIGINT and exits 0.
- `--mode recover`: also the membership service of `coordinator_service.py` (heartbeats,
  generations, the commit vote, metrics.jsonl); it exits 0 when the run's last
  iteration is committed and non-zero when it cannot go on (no replica left).
- `--rebuild` (with `--mode recover`): a restart of a coordinator that died while
  the workers run, on the same `--store-port` and `--control-port`. The store
  starts empty (every communicator the workers build from now on rendezvous
  under a new generation's prefix), and the service rebuilds membership, step and
  generation from the workers' reports; `--expect` names the replicas whose
  processes are running (the launcher knows), so it need not wait for the others.
- Once `main` returns (every record written and flushed), the process leaves by
  `os._exit` unless a non-daemon thread is still running: the interpreter's own
  teardown with torch loaded costs ~0.6 s of CPU, and every job end waits for it.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from datetime import timedelta

import torch.distributed as dist


def host_store(host: str, port: int = 0) -> dist.TCPStore:
    """A TCPStore server on (host, port); port 0 lets the OS choose."""
    return dist.TCPStore(
        host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300), multi_tenant=True
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="recover coordinator", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="the run's config.json")
    ap.add_argument("--mode", choices=["store", "recover"], default="store")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind and advertise")
    ap.add_argument("--store-port", type=int, default=0)
    ap.add_argument("--control-port", type=int, default=0)
    ap.add_argument("--rebuild", action="store_true",
                    help="a restarted coordinator: rebuild the running job from its workers' reports")
    ap.add_argument("--expect", default=None, metavar="R,R,...",
                    help="with --rebuild: the replicas whose processes are running (default: all)")
    args = ap.parse_args(argv)
    if args.rebuild and args.mode != "recover":
        ap.error("--rebuild needs --mode recover")
    expect = None
    if args.expect is not None:
        try:
            expect = {int(r) for r in args.expect.split(",") if r.strip()}
        except ValueError:
            ap.error(f"--expect: not a comma-separated list of replica ids: {args.expect!r}")

    store = host_store(args.host, args.store_port) if args.mode == "store" else None
    stop = threading.Event()

    def on_signal(signum, frame):
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    if args.mode == "store":
        print(json.dumps({"host": args.host, "store_port": store.port, "control_port": 0}), flush=True)
        while not stop.wait(0.5):
            pass
        return 0

    from recover.core.config.train_config import TrainConfig
    from recover.core.coordinator.gc_pacing import take_over
    from recover.core.coordinator.service import CoordinatorService
    from recover.core.launch.startup import JOIN_TOKEN_ENV
    from recover.core.contract.store_guard import StoreGuard, host_local_store, store_namespace

    cfg = TrainConfig.load(args.config)
    service = CoordinatorService(cfg, host=args.host, port=args.control_port, stop=stop, rebuild=args.rebuild,
                                expect=expect)
    store = host_local_store()
    guard = StoreGuard(args.host, args.store_port, store.port, store_namespace(service.join_token))
    # accepts_exits: the launcher may tell it of worker exits (core/launch/exit_notices.py)
    info = {"host": args.host, "store_port": guard.port, "control_port": service.port, "accepts_exits": True}
    if not os.environ.get(JOIN_TOKEN_ENV):
        info["join_token"] = service.join_token
    print(json.dumps(info), flush=True)
    take_over()  # this process is the coordinator: collections at its settles, off the vote-to-commit path
    return service.serve()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)  # a thread may still be writing: the ordinary exit joins it
    os._exit(code)
