"""The rank-to-rank state-transfer benchmark (`recover bench transfer --shard S`): healing a replica
of S ranks, each position against a bare broadcast of its bytes between the same two processes.

Contract:
- 2 x S processes on this machine: a donor replica and a newcomer replica of S ranks each,
  every replica its own default process group with the model FSDP2-sharded over it (the
  real workload, `core.parallel.ParallelContext`, as a run builds it). Position i's
  donor rank and newcomer rank share one gloo `core.worker.comm.Communicator`, as a
  run's "heal/pos<i>/" group. The donor takes one AdamW step on a zero gradient before
  the rounds (its optimizer then holds its moments, the bytes a live member sends;
  their values do not change what moves).
- A warm-up round, then `--repeats` rounds, interleaved in the same processes, each
  started together on all 2 x S processes (a barrier of theirs): every position's
  `core.worker.state_transfer.transfer_state` at once (the whole call as the newcomer's
  rank sees it: header, buffer, loading the optimizer, the fingerprint check), then every
  position's plain `broadcast` of one fp32 tensor of that position's byte count at once
  (the same pairs, the same concurrency, so the ratio is the transfer's own overhead),
  then the same broadcast into a tensor the receiver allocates for it that round
  (`broadcast_fresh`: what fresh memory costs, which a transfer's receiver pays and a
  reused buffer does not).
- The warm-up round is the newcomer's first transfer, kept apart (`first_transfer_s`,
  beside that round's plain broadcast): its optimizer has never stepped, so the moments
  arrive in fresh memory, as in a replacement's first heal. In the later rounds it holds
  them, so they arrive in place, as in a woken replica's heal
  (core/worker/state_transfer.py).
- The figure, per position: plain broadcast median / transfer median (1.0: the
  transfer costs nothing beyond moving its bytes); the target is >= 0.9. Also the median
  of the per-round ratios (`throughput_ratio_paired`): on a machine shared with other
  work, the load changes from round to round, and a round's transfer and broadcast run
  back to back. Also the
  slowest position's transfer median (the replica's heal time). Written to
  OUT/state_transfer_s<S>.json with bytes, medians, MB/s and every sample, and printed.
  Nothing here is asserted on.
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

TIMEOUT = 600.0  # seconds for any one collective here: gpt2-124m's ~0.75 GB per position on a loaded machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(replica: int, local: int, shard: int, port: int, model: str, repeats: int, threads: int, box) -> None:
    import torch
    import torch.distributed as dist

    from recover.core.config.train_config import TrainConfig
    from recover.core.parallel.args import ParallelismArgs
    from recover.core.parallel.context import ParallelContext
    from recover.core.training.workload import Workload
    from recover.core.worker.comm import Communicator
    from recover.core.worker.state_transfer import transfer_state

    torch.set_num_threads(threads)
    store = dist.TCPStore("127.0.0.1", port, world_size=2 * shard, is_master=replica == 0 and local == 0,
                          timeout=timedelta(seconds=TIMEOUT))
    parallel = ParallelContext(store, replica, local, ParallelismArgs(2, shard, 1, 1, "1f1b"), backend="gloo",
                               timeout=TIMEOUT)
    cfg = TrainConfig(model=model, steps=100, replicas=2, microbatches=2, shard=shard, batch_size=max(4, shard),
                      corpus_bytes=200_000)
    work = Workload(cfg, "cpu", ctx=parallel)
    if replica == 0:  # the donor has stepped: AdamW's moments exist (see the contract)
        work.apply(work.pack(), 1, 0)
    everyone = Communicator.build(lambda: store, 0, replica * shard + local, 2 * shard, "gloo", TIMEOUT,
                                  namespace="all/")
    pair = Communicator.build(lambda: store, 0, replica, 2, "gloo", TIMEOUT, namespace=f"heal/pos{local}/")
    sync = torch.zeros(1)
    times: dict[str, list[float]] = {"transfer": [], "wire": [], "broadcast": [], "broadcast_fresh": []}
    nbytes, plain, first = 0, None, {}
    for i in range(repeats + 1):
        everyone.allreduce(sync, TIMEOUT)  # every position starts together
        start = time.perf_counter()
        stats = transfer_state(pair, 0, work.acc, work.optimizer, work.stepper, TIMEOUT)
        t_transfer = time.perf_counter() - start
        if plain is None or stats.bytes != nbytes:
            nbytes = stats.bytes
            plain = torch.ones(nbytes // 4) if replica == 0 else torch.empty(nbytes // 4)
        everyone.allreduce(sync, TIMEOUT)
        start = time.perf_counter()
        pair.broadcast(plain, 0, TIMEOUT)
        t_plain = time.perf_counter() - start
        everyone.allreduce(sync, TIMEOUT)
        start = time.perf_counter()
        # the same bytes into memory allocated for them, as a transfer's receiver must (its page faults)
        pair.broadcast(plain if replica == 0 else torch.empty(nbytes // 4), 0, TIMEOUT)
        t_fresh = time.perf_counter() - start
        if not i:  # round 0 is the warm-up: first calls, allocations, the newcomer's first heal
            first = {"first_transfer_s": t_transfer, "first_broadcast_s": t_plain}
        else:
            times["transfer"].append(t_transfer)
            times["wire"].append(stats.wire_seconds)
            times["broadcast"].append(t_plain)
            times["broadcast_fresh"].append(t_fresh)
    if replica == 1:  # the newcomer's rank: the transfer as the side that waits for it all
        tr, bc = statistics.median(times["transfer"]), statistics.median(times["broadcast"])
        box.put({"position": local, "bytes": nbytes, "transfer_median_s": tr, "broadcast_median_s": bc,
                 "wire_median_s": statistics.median(times["wire"]), "transfer_MBps": nbytes / tr / 1e6,
                 "broadcast_MBps": nbytes / bc / 1e6, "throughput_ratio": bc / tr,
                 # per round, then the median: each round's two figures share that moment's load
                 "throughput_ratio_paired": statistics.median(
                     b / t for b, t in zip(times["broadcast"], times["transfer"])),
                 "broadcast_fresh_median_s": statistics.median(times["broadcast_fresh"]),
                 "throughput_ratio_fresh": statistics.median(times["broadcast_fresh"]) / tr, **first,
                 "samples": times})
    everyone.allreduce(sync, TIMEOUT)  # no process leaves while another still uses the store it hosts


def bench_sharded_transfer(args: argparse.Namespace) -> int:
    ctx = mp.get_context("spawn")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    models = []
    for model in args.models:
        box = ctx.Queue()
        port = _free_port()
        procs = [ctx.Process(target=_rank, args=(r, i, args.shard, port, model, args.repeats, args.threads, box))
                 for r in (0, 1) for i in range(args.shard)]
        for p in procs:
            p.start()
        try:
            # each newcomer rank answers once its rounds are done; a process that died says so by its exit
            positions = []
            while len(positions) < args.shard:
                try:
                    positions.append(box.get(timeout=5))
                except Exception:  # noqa: BLE001 - queue.Empty: look at the processes
                    if any(p.exitcode not in (None, 0) for p in procs):
                        raise RuntimeError(f"a rank of the {model} benchmark died: exit codes "
                                           f"{[p.exitcode for p in procs]}") from None
        finally:
            for p in procs:
                p.join(60)
                if p.is_alive():
                    p.kill()
        positions.sort(key=lambda r: r["position"])
        models.append({"model": model, "positions": positions,
                       "replica_bytes": sum(r["bytes"] for r in positions),
                       "slowest_transfer_median_s": max(r["transfer_median_s"] for r in positions),
                       "min_throughput_ratio": min(r["throughput_ratio"] for r in positions)})
    result = {"benchmark": "state_transfer_rank_to_rank", "backend": "gloo", "shard": args.shard,
              "repeats": args.repeats, "threads": args.threads, "machine": platform.machine(),
              "python": platform.python_version(), "models": models,
              "command": "recover bench transfer " + " ".join(
                  ["--shard", str(args.shard), "--models", *args.models, "--repeats", str(args.repeats),
                   "--threads", str(args.threads)])}
    path = out / f"state_transfer_s{args.shard}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"{'model':<10} {'pos':>3} {'bytes':>12} {'transfer s':>11} {'wire s':>8} {'bcast s':>9} "
          f"{'fresh s':>8} {'transfer MB/s':>14} {'ratio':>6} {'paired':>6} {'fresh':>6} {'first s':>8}")
    for m in models:
        for r in m["positions"]:
            print(f"{m['model']:<10} {r['position']:>3} {r['bytes']:>12} {r['transfer_median_s']:>11.4f} "
                  f"{r['wire_median_s']:>8.4f} {r['broadcast_median_s']:>9.4f} {r['broadcast_fresh_median_s']:>8.4f} "
                  f"{r['transfer_MBps']:>14.1f} {r['throughput_ratio']:>6.2f} {r['throughput_ratio_paired']:>6.2f} "
                  f"{r['throughput_ratio_fresh']:>6.2f} "
                  f"{r['first_transfer_s']:>8.4f}")
    print(f"-> {path}")
    return 0
