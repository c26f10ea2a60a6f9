"""One rank of a one-replica pipeline (PP) grid, for tests/test_pp_grid.py (a plain script, started by Popen).

    pp_worker.py PORT OUT LOCAL PP SCHEDULE [TP [SHARD]]

Builds a ParallelContext (1 replica of PP stages, each of SHARD x TP ranks, default 1 x 1) over the TCPStore at
127.0.0.1:PORT and
a Workload of the tiny model on it, folds microbatches 5, 2 and 9 in two schedule runs
([5, 2], then [9]: a quota and its redo), and writes OUT/rank<local>.json: its stage, the
losses each run returned, the replica's gradient norm (before the step) and, after one
committed step, the mean loss and the replica's weights checksum.
"""
from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from recover.core.config.train_config import TrainConfig
from recover.core.parallel.args import ParallelismArgs
from recover.core.parallel.context import ParallelContext
from recover.core.training.workload import Workload

RUNS = [[5, 2], [9]]


def config(schedule: str = "1f1b") -> TrainConfig:
    return TrainConfig(replicas=1, microbatches=3, steps=2, corpus_bytes=200_000, pp_schedule=schedule)


def main() -> None:
    port, out, local, pp, schedule = int(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    tp = int(sys.argv[6]) if len(sys.argv) > 6 else 1
    shard = int(sys.argv[7]) if len(sys.argv) > 7 else 1
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    ctx = ParallelContext(store, 0, local, ParallelismArgs(1, shard, tp, pp, schedule), timeout=120)
    work = Workload(config(schedule), ctx=ctx)
    phases = []
    losses = [work.fold_many(ids, at=lambda phase, k: phases.append([phase, k])) for ids in RUNS]
    norm = float(work.acc.clip_grad_norm_(max_norm=1e9))
    ids = [i for run in RUNS for i in run]
    mean, _ = work.apply(work.pack(), len(ids), 0)
    rec = {"stage": ctx.pp_index, "tp_index": ctx.tp_index, "shard_index": ctx.shard_index, "losses": losses, "ledger": ids, "norm": norm, "mean_loss": mean,
           "phases": phases, "detached": work.acc.detached(), "checksum": work.state_checksum(),
           "params": [n for n, _ in work.model.named_parameters()]}
    (out / f"rank{local}.json").write_text(json.dumps(rec))
    ctx.close()


if __name__ == "__main__":
    main()
