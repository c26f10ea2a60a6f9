"""One rank of a one-replica TP grid, for tests/test_tp_grid.py (a plain script, started by Popen).

    tp_worker.py PORT OUT LOCAL SHARD TP

Builds a ParallelContext (1 replica of SHARD x TP ranks) over the TCPStore at
127.0.0.1:PORT and a Workload of the tiny model on it (TP over "tp", FSDP2 over "shard"
when SHARD > 1), folds microbatches 5, 2 and 9, and writes OUT/rank<local>.json: its grid
coordinates, the local gradient of every parameter that is whole on each tp rank
(layer norms, embeddings), this rank's slice of the first block's qkv and fc gradients,
the loss part it folded and the replica's loss sum, then (after one committed step with
clipping) the replica's loss and weights checksum.
"""
from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from recover.core.config.train_config import TrainConfig
from recover.core.parallel.args import ParallelismArgs
from recover.core.parallel.context import ParallelContext
from recover.core.training.workload import Workload

IDS = [5, 2, 9]


def config() -> TrainConfig:
    return TrainConfig(replicas=1, microbatches=len(IDS), steps=2, corpus_bytes=200_000)


def main() -> None:
    port, out, local, shard, tp = int(sys.argv[1]), Path(sys.argv[2]), *map(int, sys.argv[3:6])
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    ctx = ParallelContext(store, 0, local, ParallelismArgs(1, shard, tp), timeout=120)
    work = Workload(config(), ctx=ctx)
    for i in IDS:
        work.fold(i)
    named = dict(work.model.named_parameters())
    local_of = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    whole = {n: local_of(p.grad).reshape(-1).tolist() for n, p in named.items()
             if not (isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ()))}
    split = {k: local_of(named[f"blocks.0.{k}.weight"].grad).reshape(-1).tolist() if shard == 1 else None
             for k in ("attn.qkv", "mlp.fc")}  # (before the step: apply turns the sum into the mean)
    loss_part = work.acc.loss_sum
    total = torch.tensor([loss_part])
    dist.all_reduce(total)
    mean, _ = work.apply(work.pack(), len(IDS), 0)
    rec = {
        "shard_index": ctx.shard_index, "tp_index": ctx.tp_index,
        "mesh_tp": ctx.mesh.get_local_rank("tp") if tp > 1 else 0,
        "mesh_shard": ctx.mesh.get_local_rank("shard"),
        "whole_grads": whole,
        "qkv_grad": split["attn.qkv"], "fc_grad": split["mlp.fc"],
        "loss_part": loss_part, "replica_loss_sum": float(total), "mean_loss": mean,
        "detached": work.acc.detached(), "checksum": work.state_checksum(),
    }
    (out / f"rank{local}.json").write_text(json.dumps(rec))
    ctx.close()


if __name__ == "__main__":
    main()
