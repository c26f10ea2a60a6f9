"""The state-transfer benchmark (`recover bench transfer`): healing a newcomer against a bare broadcast.

Contract:
- Two processes (a donor and a newcomer) on this machine, one gloo
  `core.worker.comm.Communicator` between them over a TCPStore, as a run's heal group.
  For each model the donor builds the real workload and takes one AdamW step (so
  the optimizer holds its moments, as a live member's does); the newcomer builds
  a fresh one. Then, `--repeats` rounds after an untimed warm-up, interleaved in
  the same processes: `core.worker.state_transfer.transfer_state` (the whole call as the
  newcomer sees it: header, flat buffer, loading the optimizer, the fingerprint
  check), and a plain `broadcast` of one fp32 tensor of the same byte count.
- The figure is the throughput ratio, plain broadcast time / transfer time, of
  the medians (1.0: the transfer costs nothing beyond moving its bytes); the
  target is >= 0.5. Written to OUT/state_transfer.json with the bytes,
  the medians (also of the time the newcomer spent in the transfer's broadcasts,
  `wire`, which includes waiting for the donor to build the header and buffer;
  the rest is its own decoding, loading and fingerprint check)
  and MB/s, and printed. Nothing here is asserted on.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import socket
import statistics
import time
from datetime import timedelta
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _side(rank: int, port: int, models: list[str], repeats: int, threads: int, box) -> None:
    import torch
    import torch.distributed as dist

    from recover.core.worker.comm import Communicator
    from recover.core.config.train_config import TrainConfig
    from recover.core.worker.state_transfer import transfer_state
    from recover.core.training.workload import Workload

    torch.set_num_threads(threads)
    store = dist.TCPStore("127.0.0.1", port, world_size=2, is_master=rank == 0, timeout=timedelta(seconds=120))
    comm = Communicator.build(lambda: store, 0, rank, 2, "gloo", 120.0)
    sync = torch.zeros(1)
    rows = []
    for model in models:
        cfg = TrainConfig(model=model, steps=100, replicas=1, microbatches=1, corpus_bytes=200_000)
        work = Workload(cfg, "cpu")
        if rank == 0:  # the donor has trained: AdamW's moments exist
            work.fold(0)
            work.apply(work.pack(), 1, 0)
        # transfer: the whole call; wire: the time it spent in its broadcasts (stats.wire_seconds)
        times: dict[str, list[float]] = {"transfer": [], "wire": [], "broadcast": []}
        nbytes = 0
        for i in range(repeats + 1):
            comm.broadcast(sync, 0, 120.0)  # start together
            start = time.perf_counter()
            stats = transfer_state(comm, 0, work.acc, work.optimizer, work.stepper, 120.0)
            t_transfer = time.perf_counter() - start
            nbytes = stats.bytes
            plain = torch.ones(nbytes // 4) if rank == 0 else torch.empty(nbytes // 4)
            comm.broadcast(sync, 0, 120.0)
            start = time.perf_counter()
            comm.broadcast(plain, 0, 120.0)
            t_plain = time.perf_counter() - start
            if i:  # round 0 is the warm-up: first calls, allocations
                times["transfer"].append(t_transfer)
                times["wire"].append(stats.wire_seconds)
                times["broadcast"].append(t_plain)
        if rank == 1:
            tr, bc = statistics.median(times["transfer"]), statistics.median(times["broadcast"])
            rows.append({"model": model, "bytes": nbytes, "params": sum(p.numel() for p in work.acc.params),
                         "transfer_median_s": tr, "broadcast_median_s": bc,
                         "wire_median_s": statistics.median(times["wire"]),
                         "transfer_MBps": nbytes / tr / 1e6, "broadcast_MBps": nbytes / bc / 1e6,
                         "throughput_ratio": bc / tr, "samples": times})
    if rank == 1:
        box.put(rows)


def bench_transfer(args: argparse.Namespace) -> int:
    ctx = mp.get_context("spawn")
    box = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_side, args=(r, port, args.models, args.repeats, args.threads, box)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        rows = box.get(timeout=1800)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": "state_transfer", "backend": "gloo", "repeats": args.repeats, "threads": args.threads,
              "machine": platform.machine(), "python": platform.python_version(), "rows": rows,
              "command": "recover bench transfer " + " ".join(
                  ["--models", *args.models, "--repeats", str(args.repeats), "--threads", str(args.threads)])}
    path = out / "state_transfer.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"{'model':<10} {'bytes':>12} {'transfer s':>11} {'wire s':>8} {'bcast s':>9} {'transfer MB/s':>14} "
          f"{'ratio':>6}")
    for r in rows:
        print(f"{r['model']:<10} {r['bytes']:>12} {r['transfer_median_s']:>11.4f} {r['wire_median_s']:>8.4f} "
              f"{r['broadcast_median_s']:>9.4f} "
              f"{r['transfer_MBps']:>14.1f} {r['throughput_ratio']:>6.2f}")
    print(f"-> {path}")
    return 0
