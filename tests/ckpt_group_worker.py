"""One rank of a two-rank checkpoint group, for tests/test_checkpoint_group.py (a plain script).

    ckpt_group_worker.py PORT ROOT RANK

Saves a tiny model's state collectively (CheckpointSaver with a gloo group) three times:
step 2 while rank 0's rename into place fails (a lost mount, patched in), then steps 4
and 6 normally (6 asynchronously, finished by a collective `wait`). Writes
ROOT/rank<RANK>.json: for each save, whether it raised and what, and the steps this
rank saw completed.
"""
from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from recover.core.training import checkpoint as ck
from recover.core.training.checkpoint import CheckpointDir, CheckpointSaver, TrainingState
from recover.core.worker.accumulator import GradAccumulator
from recover.core.worker.recipe import CommittedStep

port, root, rank = int(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
group = dist.new_group(backend="gloo")
torch.manual_seed(0)
model = torch.nn.Linear(4, 4)
acc = GradAccumulator(model.parameters())
opt = torch.optim.AdamW(acc.params, lr=1e-3)
state = TrainingState(model, opt, CommittedStep(opt, acc.params), acc, seed=0, microbatches=2)
saver = CheckpointSaver(CheckpointDir(root / "ckpts"), state, group, rank, use_async=False, keep=5)


class _LostMount:
    """The checkpoint module's `os`, whose rename fails (DCP's own renames keep the real one)."""

    def __getattr__(self, name):
        return getattr(os, name)

    @staticmethod
    def rename(src, dst):
        raise OSError(5, "Input/output error (the mount is gone)")


outcomes = []
for step, use_async in ((2, False), (4, False), (6, True)):
    saver.use_async = use_async
    if rank == 0:
        ck.os = _LostMount() if step == 2 else os
    try:
        saver.save(step, fault_step=step - 1)
        saver.wait()
        outcomes.append({"step": step, "error": None})
    except OSError as e:
        outcomes.append({"step": step, "error": str(e)})
(root / f"rank{rank}.json").write_text(json.dumps({"outcomes": outcomes, "completed": list(saver.completed)}))
dist.destroy_process_group()
