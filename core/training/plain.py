"""The plain data-parallel trainer: the failure-free reference and the "plain DDP" baseline.

Contract:
- Iteration t folds the M ids of `iteration_ids(t, M)`, split over the R replicas
  by the quota policy (equal speeds), sums gradients and losses with exactly one
  all-reduce, divides by M and steps AdamW by the shared recipe (core/worker/recipe.py). With the same seed, any R gives the
  same loss at every step up to floating-point summation order.
- With `--exact` (core/worker/exact.py) the sum depends only on the set of ids: any R
  gives the same bits at every step; a microbatch outside the fixed-point range
  ends the run (exit 1) with a line naming the step, on every replica.
- It has no fault tolerance: a fault anywhere ends the job (the launcher runs it
  fail-fast). Replica 0 writes metrics.jsonl.
- It is run as one process per replica: `python -m recover.core.training.plain --config
  DIR/config.json --replica r`, with RECOVER_STORE_ADDR naming the store.
- With `--shard S`, `--tp T` and `--pp P` (the failure-free reference of recover's
  replicas of many ranks) a replica is P x S x T processes (RECOVER_LOCAL_RANK),
  partitioned exactly as recover partitions its replicas, from the same building
  blocks (core/parallel/: ParallelContext's rank grid, TP's split heads and MLP,
  PP's stages and schedule, FSDP2's shards; none of recover's relay, beats or
  votes): each rank folds its part of every microbatch of its replica's quota
  (with P > 1 the quota's ids run through one run of the schedule, as
  `fold_pipelined` runs recover's), and the ranks at one position of every replica
  all-reduce their local parts ("plain/pos<i>/"). So at the same R x (S, T, P)
  plain's losses are recover's failure-free ones up to float summation order: the
  same ids per replica (the quota policy at equal speeds), the same partition, the
  same schedule. Rank 0 of replica 0 writes metrics.jsonl.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from recover.core.worker.comm import Communicator
from recover.core.components.data import iteration_ids
from recover.core.worker.exact import ExactRangeError
from recover.core.worker.fold import fold_pipelined, fold_quota
from recover.core.contract.policy import assign_quotas
from recover.core.storage.results import JsonlWriter, metric_record, write_final
from recover.core.launch.startup import begin, connect_store, run_start_time, worker_args
from recover.core.training.workload import Workload
from recover.core.contract import env_names


def main(argv: list[str] | None = None) -> int:
    args = worker_args(argv, "plain data-parallel worker")
    local = int(os.environ.get(env_names.LOCAL_RANK, "0"))
    cfg, hooks = begin(args.config, args.replica, rank=local)
    t0 = run_start_time()
    replica, R, M = args.replica, cfg.replicas, cfg.microbatches
    ctx = None
    if cfg.ranks_per_replica > 1:  # the replica's rank grid: the same ParallelContext recover's replicas build
        from recover.core.parallel.args import ParallelismArgs
        from recover.core.parallel.context import ParallelContext
        layout = ParallelismArgs(R, cfg.shard, cfg.tp, cfg.pp, cfg.pp_schedule)
        ctx = ParallelContext(connect_store(), replica, local, layout, backend="gloo", timeout=cfg.collective_timeout)
    work = Workload(cfg, cfg.resolved_device(), ctx=ctx)
    hooks.attach_weights(work.acc)  # a bitflip fault corrupts these (and nothing here notices)
    comm = Communicator.build(connect_store, 0, replica, R, cfg.resolved_backend(), cfg.collective_timeout,
                              namespace="plain/" if ctx is None else f"plain/pos{local}/")
    metrics = JsonlWriter(Path(cfg.out) / "metrics.jsonl") if replica == 0 and local == 0 else None
    members = list(range(R))
    for step in range(cfg.steps):
        quota = assign_quotas(iteration_ids(step, M), members)[replica]
        if work.pipeline is None:
            fold_quota(step, quota, work.fold, hooks)
        else:  # --pp: the quota's ids through one run of the schedule, as recover's replicas run them
            fold_pipelined(step, quota, work.fold_many, hooks)
        buf = work.pack()
        comm.allreduce(buf, cfg.collective_timeout, while_in_flight=lambda: hooks.at(step, "allreduce"))
        if (wide := work.wide_after(buf)) is not None:  # --exact, a spike in the step: every replica reads it
            comm.allreduce(wide, cfg.collective_timeout)
        hooks.at(step, "vote")
        hooks.at(step, "commit")
        hooks.at(step, "optimizer_step")
        try:
            loss, lr = work.apply(buf, M, step, wide)
        except ExactRangeError as e:  # --exact: every replica sees the same count, and stops here
            print(f"plain replica {replica}: step {step}: {e}", file=sys.stderr, flush=True)
            if metrics is not None:
                metrics.close()
            return 1
        if metrics is not None:
            metrics.write(
                metric_record(step, loss, M * work.tokens_per_microbatch, iteration_ids(step, M), 0, members, t0,
                              lr=lr)
            )
    if metrics is not None:
        metrics.close()
    checksum = work.state_checksum()  # (a collective of a replica's ranks when it has many)
    shards = work.shard_digests()  # likewise
    if local == 0:
        write_final(cfg.out, replica, cfg.steps, checksum, digest=work.acc.weights_digest() if ctx is None else None,
                    shard_digests=shards)
    return 0


if __name__ == "__main__":
    # os._exit: a backend thread must not hold the process open after the last step.
    code = main()
    sys.stdout.flush()
    os._exit(code)
