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

from .runlog import fault_notice_path  # noqa: E402
from .settings import load_settings  # noqa: E402
from .trainer import Incarnation, train  # noqa: E402


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


def main(argv: list[str] | None = None) -> int:
    args = worker_args(argv, "checkpoint-restart worker")
    cfg, hooks = begin(args.config, args.replica)
    settings = load_settings(args.config)
    t0 = run_start_time()
    members = [int(x) for x in os.environ[env_names.MEMBERS].split(",")]
    generation = int(os.environ.get(env_names.ATTEMPT, "0"))
    rank = members.index(args.replica)
    store = dist.PrefixStore(f"ckpt-restart/attempt{generation}/", connect_store())
    ckpt_group = init_groups(cfg.resolved_backend(), store, rank, len(members), cfg.collective_timeout)
    notice = fault_notice_path(cfg.out, generation)
    inc = Incarnation(generation, rank, len(members), args.replica, members, t0, _STARTED - t0)
    return train(cfg, settings, inc, hooks, ckpt_group, keep_global=True,
                 fault_notice=lambda: json.loads(notice.read_text()) if notice.exists() else {})


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
