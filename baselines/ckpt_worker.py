"""One replica of a checkpoint-restart job: `python -m recover.baselines.ckpt_worker --config C --replica R`.

Contract:
- The supervisor (`ckpt_restart.py`) starts one such process per member replica of
  an attempt, with RECOVER_MEMBERS (the attempt's replica ids, comma-separated),
  RECOVER_ATTEMPT (the attempt number) and RECOVER_STORE_ADDR (the attempt's store).
  Rank = position of --replica among the members, so a job restarted with the
  survivors keeps the replica ids a fault plan names.
- It trains one incarnation (`trainer.train`) with the global batch kept: the
  members fold all M ids of each iteration whatever their number.
- It has no fault tolerance of its own: any fault ends it (an exception, or a
  collective that times out after --collective-timeout), and the supervisor tears
  the whole job down and restarts it from the last complete checkpoint.
- A replica of many ranks (`--shard S`, `--tp T`): the supervisor starts S x T
  processes per member replica (RECOVER_LOCAL_RANK = the rank in the replica), all
  ended together. Each builds, over the attempt's store, recover's `ParallelContext`
  (the replica's default group and mesh, exactly as plain and recover build it), a
  gloo group of the replica for DCP, and its position's `Communicator` across the
  member replicas (as plain's "pos<i>"); `trainer.train` runs over that grid
  (`ReplicaGrid`): sharded DCP checkpoints, every rank writing and loading its shards.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from datetime import timedelta

_STARTED = time.time()  # before the heavy imports: a restart's cost includes them

import torch.distributed as dist  # noqa: E402

from recover.core.launch.startup import begin, connect_store, run_start_time, worker_args  # noqa: E402
from recover.core.contract import env_names
from recover.core.worker.comm import Communicator  # noqa: E402

from .runlog import fault_notice_path  # noqa: E402
from .settings import load_settings  # noqa: E402
from .trainer import Incarnation, ReplicaGrid, train  # noqa: E402


def init_groups(backend: str, store, rank: int, world: int, timeout: float):
    """The job's process group, plus a gloo group for DCP's collectives.

    A checkpoint-restart job never rebuilds its communicator: any fault ends
    every process, and the next attempt is new processes. So, like the jobs this
    baseline stands for, it uses torch's process-global default group, which is
    also what DCP's save/load expect to find.
    """
    pg_backend = "cpu:gloo,cuda:nccl" if backend == "nccl" else backend
    dist.init_process_group(pg_backend, store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout))
    # its own timeout: new_group does not inherit the default group's, and gloo's default is
    # 30 minutes, which a save whose peer died would wait out
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))


def replica_grid(cfg, replica: int, local: int, rank: int, members: list[int], generation: int):
    """This rank's grid inside its replica of many ranks, DCP's group of the replica, and its
    position's communicator across the member replicas (see the contract)."""
    from recover.core.parallel.args import ParallelismArgs
    from recover.core.parallel.context import ParallelContext

    def open_store() -> dist.Store:
        return dist.PrefixStore(f"ckpt-restart/attempt{generation}/", connect_store())

    store = open_store()
    layout = ParallelismArgs(cfg.replicas, cfg.shard, cfg.tp, cfg.pp, cfg.pp_schedule)
    ctx = ParallelContext(store, replica, local, layout, backend="gloo", timeout=cfg.collective_timeout)
    # collective over the replica (the default group now): DCP's own group, with its own timeout as above
    ckpt_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.collective_timeout))
    cross = Communicator.build(open_store, 0, rank, len(members), cfg.resolved_backend(), cfg.collective_timeout,
                               namespace=f"pos{local}/")
    return ReplicaGrid(ctx, cross, store, cfg.collective_timeout), ckpt_group


def main(argv: list[str] | None = None) -> int:
    args = worker_args(argv, "checkpoint-restart worker")
    local = int(os.environ.get(env_names.LOCAL_RANK, "0"))  # the rank in a replica of many
    cfg, hooks = begin(args.config, args.replica, rank=local)
    settings = load_settings(args.config)
    t0 = run_start_time()
    members = [int(x) for x in os.environ[env_names.MEMBERS].split(",")]
    generation = int(os.environ.get(env_names.ATTEMPT, "0"))
    rank = members.index(args.replica)
    grid = None
    if cfg.ranks_per_replica > 1:
        grid, ckpt_group = replica_grid(cfg, args.replica, local, rank, members, generation)
    else:
        store = dist.PrefixStore(f"ckpt-restart/attempt{generation}/", connect_store())
        ckpt_group = init_groups(cfg.resolved_backend(), store, rank, len(members), cfg.collective_timeout)
    notice = fault_notice_path(cfg.out, generation)
    inc = Incarnation(generation, rank, len(members), args.replica, members, t0, _STARTED - t0)
    return train(cfg, settings, inc, hooks, ckpt_group, keep_global=True,
                 fault_notice=lambda: json.loads(notice.read_text()) if notice.exists() else {}, grid=grid)


if __name__ == "__main__":
    # os._exit: a backend thread must not hold the process open after the last
    # step, nor after a failure (the supervisor must see this exit at once).
    try:
        code = main()
    except BaseException:  # noqa: BLE001 - CheckpointException is a BaseException
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
