"""The plain data-parallel trainer: the failure-free reference and the "plain DDP" baseline.

Contract:
- Iteration t folds the M ids of `iteration_ids(t, M)`, split over the R replicas
  by the quota policy (equal speeds), sums gradients and losses with exactly one
  all-reduce, divides by M and steps AdamW. With the same seed, any R gives the
  same loss at every step up to floating-point summation order.
- It has no fault tolerance: a fault anywhere ends the job (the launcher runs it
  fail-fast). Replica 0 writes metrics.jsonl.
- It is run as one process per replica: `python -m recover.core.plain --config
  DIR/config.json --replica r`, with RECOVER_STORE_ADDR naming the store.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from .comm import Communicator
from .config import TrainConfig
from .data import iteration_ids
from .hooks import load_hooks
from .policy import assign_quotas
from .results import JsonlWriter, metric_record, write_final
from .workload import Workload


def connect_store(timeout: float = 60.0) -> dist.TCPStore:
    """A client of the coordinator's store, from RECOVER_STORE_ADDR=host:port."""
    host, port = os.environ["RECOVER_STORE_ADDR"].rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout))


def worker_args(argv: list[str] | None, description: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--config", required=True)
    ap.add_argument("--replica", type=int, required=True)
    return ap.parse_args(argv)


def run_start_time() -> float:
    """The run's start on the time.time() clock (set by the launcher)."""
    return float(os.environ.get("RECOVER_T0", time.time()))


def main(argv: list[str] | None = None) -> int:
    args = worker_args(argv, "plain data-parallel worker")
    cfg = TrainConfig.load(args.config)
    torch.set_num_threads(cfg.threads)
    t0 = run_start_time()
    replica, R, M = args.replica, cfg.replicas, cfg.microbatches
    hooks = load_hooks(cfg.hooks, cfg, replica)
    device = cfg.resolved_device()
    if device == "cuda":
        torch.cuda.set_device(replica % torch.cuda.device_count())
    work = Workload(cfg, device)
    store = connect_store()
    comm = Communicator.build(store, 0, replica, R, cfg.resolved_backend(), cfg.collective_timeout, namespace="plain/")
    metrics = JsonlWriter(Path(cfg.out) / "metrics.jsonl") if replica == 0 else None
    members = list(range(R))
    for step in range(cfg.steps):
        quota = assign_quotas(iteration_ids(step, M), members)[replica]
        for k, mb in enumerate(quota):
            if k:
                hooks.at(step, "between_microbatches", k)
            start = time.perf_counter()
            work.fold(mb, lambda phase, i: hooks.at(step, phase, i))
            hooks.microbatch_done(step, k, time.perf_counter() - start)
        buf = work.pack()
        comm.allreduce(buf, cfg.collective_timeout, while_in_flight=lambda: hooks.at(step, "allreduce"))
        hooks.at(step, "commit")
        hooks.at(step, "optimizer_step")
        loss = work.apply(buf, M)
        if metrics is not None:
            metrics.write(
                metric_record(step, loss, M * work.tokens_per_microbatch, iteration_ids(step, M), 0, members, t0)
            )
    if metrics is not None:
        metrics.close()
    write_final(cfg.out, replica, cfg.steps, work.state_checksum())
    return 0


if __name__ == "__main__":
    # os._exit: a backend thread must not hold the process open after the last step.
    code = main()
    sys.stdout.flush()
    os._exit(code)
