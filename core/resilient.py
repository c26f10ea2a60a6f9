"""`recover train --system recover`: the resilient trainer's worker process.

Contract: the same workload, data and optimizer as the plain trainer, driven
through the public `Replica` API, so every iteration folds exactly the M ids of
the failure-free run and commits the same gradient up to summation order,
whatever replicas die. Exit codes: 0 when the run completes, 1 when it is stopped
(no replica left, coordinator gone), 3 when this replica was fenced out (with
--no-rejoin, or fenced on evidence; by default a fenced replica rejoins).

Run as `python -m recover.core.resilient --config DIR/config.json --replica r`
with RECOVER_STORE_ADDR and RECOVER_CONTROL_ADDR set by the launcher.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import sys

from .fold import fold_quota
from .replica import Replica, RunEnded
from .results import write_final
from .startup import begin, env_addr, worker_args
from .workload import Workload

EXIT_FENCED = 3


def main(argv: list[str] | None = None) -> int:
    args = worker_args(argv, "resilient (recover) worker")
    # `kill -USR1 <pid>` writes every thread's stack to the replica's log.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    cfg, hooks = begin(args.config, args.replica)
    work = Workload(cfg, cfg.resolved_device())
    replica = Replica(
        work.acc, work.optimizer, replica=args.replica,
        control_addr=env_addr("RECOVER_CONTROL_ADDR"), store_addr=env_addr("RECOVER_STORE_ADDR"),
        backend=cfg.resolved_backend(), collective_timeout=cfg.collective_timeout,
        heartbeat_interval=cfg.heartbeat_interval, grad_clip=cfg.grad_clip,
        lr_schedule=work.schedule,
        tokens_per_microbatch=work.tokens_per_microbatch, hooks=hooks, digest_every=cfg.digest_every,
        rejoin=cfg.rejoin,
    )
    try:
        while not replica.done:
            # k counts on from what this replica folded before a recovery handed it more
            fold_quota(replica.step, replica.quota(), work.forward_backward, hooks,
                       first=len(replica.ledger), after=replica.fold)
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
