"""One rank of a failure-free HSDP run, for tests/test_hsdp_grid.py (a plain script, started by Popen).

    hsdp_worker.py PORT OUT REPLICA LOCAL REPLICAS SHARD MICROBATCHES STEPS [--check-fold]

Builds a ParallelContext over the TCPStore at 127.0.0.1:PORT and a ShardedAccumulator over
the tiny model. Each step, replica REPLICA folds its equal share of the step's global ids
(this rank takes its rows of each), all-reduces pack() with the ranks at its position in
the other replicas, load_mean(M), and steps AdamW by the shared recipe. It writes
OUT/rank<replica>_<local>.json: per step the mean loss, the ledger and this rank's weights
fingerprint. With --check-fold it instead folds a few ids in one replica and writes how far
pack() is from the local shards of a single-process model's summed gradients.
"""
from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from recover.core.worker.accumulator import GradAccumulator
from recover.core.components.data import MicrobatchSource, iteration_ids, load_tokens
from recover.core.components.model import GPT
from recover.core.parallel.args import ParallelismArgs
from recover.core.parallel.context import ParallelContext
from recover.core.parallel.fsdp import ShardedAccumulator, microbatch_part, shard_model
from recover.core.contract.policy import assign_quotas
from recover.core.worker.recipe import CommittedStep, build_adamw
from recover.core.config.shapes import GPTConfig

# BATCH 3 over 2 ranks: parts of 2 and 1 rows, so the loss shares (2/3, 1/3) are exercised.
SEED, BATCH, CORPUS, LR, WD, CLIP = 0, 3, 200_000, 1e-3, 0.1, 1.0
TIMEOUT = 120.0


def source() -> MicrobatchSource:
    return MicrobatchSource(load_tokens("", CORPUS), BATCH, GPTConfig().block_size, SEED)


def fresh_model() -> GPT:
    torch.manual_seed(SEED)  # every rank and the reference start from the same weights
    return GPT(GPTConfig())


def fold_part(model, acc: ShardedAccumulator, src: MicrobatchSource, mb_id: int, ctx: ParallelContext) -> None:
    x, y = src.get(mb_id)
    xp, yp, share = microbatch_part(x, y, ctx.local_rank, ctx.args.shard)
    _, loss = model(xp, yp)
    (loss * share).backward()
    acc.fold(mb_id, float(loss.detach()) * share)


def check_fold(ctx: ParallelContext, out: Path) -> None:
    src, ids = source(), [5, 2, 9]
    ref = fresh_model()
    ref_acc = GradAccumulator(ref.parameters())
    model = shard_model(fresh_model(), ctx.mesh)
    acc = ShardedAccumulator(model)
    for i in ids:
        x, y = src.get(i)
        _, loss = ref(x, y)
        loss.backward()
        ref_acc.fold(i, float(loss.detach()))
        fold_part(model, acc, src, i, ctx)
    packed = acc.pack()
    expected = []
    S, i = ctx.args.shard, ctx.local_rank
    for p in ref_acc.params:  # FSDP2's dim-0 chunks: ceil(dim0 / S) rows each
        rows = -(-p.shape[0] // S)
        expected.append(p.grad[i * rows:(i + 1) * rows].reshape(-1))
    exp = torch.cat(expected)
    diff = float((packed[:-1] - exp).abs().max())
    loss_parts = torch.tensor([acc.loss_sum])
    dist.all_reduce(loss_parts)
    (out / f"fold{ctx.local_rank}.json").write_text(json.dumps({
        "numel": packed.numel() - 1, "expected_numel": exp.numel(), "max_abs": diff,
        "max_rel": diff / float(exp.abs().max()), "detached": acc.detached(), "ledger": acc.ledger,
        "loss_sum": float(loss_parts), "ref_loss_sum": ref_acc.loss_sum,
        "buffer_untouched_by_pack": bool(acc.pack().data_ptr() != acc.buffer.data_ptr()),
    }))


def train(ctx: ParallelContext, out: Path, M: int, steps: int, port: int) -> None:
    src = source()
    model = shard_model(fresh_model(), ctx.mesh)
    acc = ShardedAccumulator(model)
    opt = build_adamw(acc.params, LR, WD)
    stepper = CommittedStep(opt, acc.params, grad_clip=CLIP)
    R, r = ctx.args.replicas, ctx.replica
    comm = ctx.cross_replica(lambda: dist.TCPStore("127.0.0.1", port, is_master=False,
                                                   timeout=timedelta(seconds=TIMEOUT)),
                             generation=0, rank_among_members=r, n_members=R, timeout=TIMEOUT)
    record = {"losses": [], "ledgers": [], "fingerprints": []}
    for step in range(steps):
        quota = assign_quotas(iteration_ids(step, M), list(range(R)))[r]
        for mb in quota:
            fold_part(model, acc, src, mb, ctx)
        record["ledgers"].append(list(acc.ledger))
        buf = acc.pack()
        comm.allreduce(buf, TIMEOUT)
        record["losses"].append(acc.load_mean(buf, M))
        stepper(step)
        acc.clear()
        record["fingerprints"].append(acc.weights_fingerprint())
    (out / f"rank{r}_{ctx.local_rank}.json").write_text(json.dumps(record))


def main(argv: list[str]) -> int:
    port, out = int(argv[0]), Path(argv[1])
    replica, local, R, S, M, steps = (int(a) for a in argv[2:8])
    torch.set_num_threads(1)  # R x S ranks share this machine's cores
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=TIMEOUT))
    ctx = ParallelContext(store, replica, local, ParallelismArgs(R, S), timeout=TIMEOUT)
    try:
        if "--check-fold" in argv:
            check_fold(ctx, out)
        else:
            train(ctx, out, M, steps, port)
    finally:
        ctx.close()
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    import os
    os._exit(code)  # no backend thread may hold the process open
