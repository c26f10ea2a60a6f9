"""`recover train --system recover`: the resilient trainer's worker process.

Contract: the same workload, data and optimizer as the plain trainer, driven
through the public `Replica` API, so every iteration folds exactly the M ids of
the failure-free run and commits the same gradient up to summation order,
whatever replicas die. Exit codes: 0 when the run completes, 1 when it is stopped
(no replica left, coordinator gone), 3 when this replica was fenced out.

Run as `python -m recover.core.resilient --config DIR/config.json --replica r`
with RECOVER_STORE_ADDR and RECOVER_CONTROL_ADDR set by the launcher.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time

import torch

from .config import TrainConfig
from .hooks import load_hooks
from .plain import worker_args
from .replica import Replica, RunEnded, _addr
from .results import write_final
from .workload import Workload

EXIT_FENCED = 3


def main(argv: list[str] | None = None) -> int:
    args = worker_args(argv, "resilient (recover) worker")
    # `kill -USR1 <pid>` writes every thread's stack to the replica's log.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    cfg = TrainConfig.load(args.config)
    torch.set_num_threads(cfg.threads)
    hooks = load_hooks(cfg.hooks, cfg, args.replica)
    device = cfg.resolved_device()
    if device == "cuda":
        torch.cuda.set_device(args.replica % torch.cuda.device_count())
    work = Workload(cfg, device)
    replica = Replica(
        work.acc, work.optimizer, replica=args.replica,
        control_addr=_addr("RECOVER_CONTROL_ADDR"), store_addr=_addr("RECOVER_STORE_ADDR"),
        backend=cfg.resolved_backend(), collective_timeout=cfg.collective_timeout,
        heartbeat_interval=cfg.heartbeat_interval, grad_clip=cfg.grad_clip,
        tokens_per_microbatch=work.tokens_per_microbatch, hooks=hooks,
    )
    try:
        while not replica.done:
            step = replica.step
            for mb in replica.quota():
                k = len(replica.ledger)  # index of this microbatch within the step, across recoveries
                if k:
                    hooks.at(step, "between_microbatches", k)
                start = time.perf_counter()
                loss = work.forward_backward(mb, lambda phase, i: hooks.at(step, phase, i))
                hooks.microbatch_done(step, k, time.perf_counter() - start)
                replica.fold(mb, loss)
            replica.commit()
        write_final(cfg.out, args.replica, replica.step, work.state_checksum())
    except RunEnded as e:
        print(f"replica {args.replica}: {e.reason}", file=sys.stderr, flush=True)
        if e.fenced:
            return EXIT_FENCED
        return 0 if replica.done else 1
    finally:
        replica.close()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # backend threads of abandoned communicators must not hold the process
