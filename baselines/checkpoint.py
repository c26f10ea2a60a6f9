"""DCP checkpoints that are either whole or never loaded: fresh temp dir, rename into place.

Contract:
- A checkpoint of step s holds the state *before* iteration s (model + AdamW, as
  torch.distributed.checkpoint writes them, + the LR schedule's state from
  `core.recipe.CommittedStep`): training resumes at step s, with step s's
  learning rate; a load whose schedule state disagrees with s or with this run's
  schedule raises. Complete
  checkpoints live in ROOT/step-<s:08d>; nothing else is ever loaded.
- A save never writes over a checkpoint. Every rank writes into the fresh
  ROOT/.tmp-step-<s:08d>; only when every rank has finished (DCP's own finish step
  has written .metadata and a barrier has passed) does rank 0 rename it to
  ROOT/step-<s:08d>. Why: a DCP save killed while overwriting an older checkpoint
  leaves the old .metadata beside half-new data, which looks whole and can load a
  mix of two saves (measured, DESIGN.md section 5). A rename is atomic, so a save
  killed at any point leaves at most a stray .tmp dir, and the previous complete
  checkpoint stays the latest.
- Synchronous (`dcp.save`) and asynchronous (`dcp.async_save`) saves take the same
  path. An async save is finished (renamed) at the first `poll()` after every rank's
  background save is done; one save is in flight at a time.
- The "checkpoint_save" fault point fires on each rank after its data files are
  written and before the checkpoint is complete, i.e. truly mid-save.
- DCP's collectives run on a process group of their own: an async save's
  background thread uses it while the training thread all-reduces on the training
  group, and two threads issuing collectives on one gloo group could interleave
  differently on different ranks.
"""
from __future__ import annotations

import os
import re
import shutil
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from recover.core.workload import Workload

_COMPLETE = re.compile(r"^step-(\d{8})$")


class CheckpointDir:
    """The checkpoint root: complete checkpoints and in-progress temp dirs."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def path(self, step: int) -> Path:
        return self.root / f"step-{step:08d}"

    def tmp_path(self, step: int) -> Path:
        return self.root / f".tmp-step-{step:08d}"

    def complete_steps(self) -> list[int]:
        """Steps of the complete checkpoints, ascending (a renamed dir with DCP metadata)."""
        if not self.root.is_dir():
            return []
        steps = []
        for p in self.root.iterdir():
            m = _COMPLETE.match(p.name)
            if m and (p / ".metadata").is_file():
                steps.append(int(m.group(1)))
        return sorted(steps)

    def latest(self) -> int | None:
        steps = self.complete_steps()
        return steps[-1] if steps else None

    def remove_temps(self) -> None:
        """Delete leftovers of killed saves (only when no save can be running)."""
        if self.root.is_dir():
            for p in self.root.glob(".tmp-step-*"):
                shutil.rmtree(p, ignore_errors=True)

    def prune(self, keep: int) -> None:
        for step in self.complete_steps()[:-keep]:
            shutil.rmtree(self.path(step), ignore_errors=True)


class _MidSaveWriter(dcp.FileSystemWriter):
    """A FileSystemWriter that calls `on_written` once this rank's data files are on disk."""

    def __init__(self, path: Path, on_written: Callable[[], None]):
        # overwrite=False: the temp dir is always fresh; refuse to mix saves if not.
        super().__init__(path, single_file_per_rank=True, sync_files=True, overwrite=False)
        self._on_written = on_written

    def write_data(self, plan, planner):
        fut = super().write_data(plan, planner)
        self._on_written()
        return fut


def _state_dict(work: Workload) -> dict:
    """Model, optimizer and schedule state keyed by parameter names (DCP's portable form)."""
    return {
        "model": get_model_state_dict(work.model),
        "optim": get_optimizer_state_dict(work.model, work.optimizer),
        "schedule": work.stepper.state_dict(),
    }


def _prime_optimizer(work: Workload) -> None:
    """Give a fresh AdamW its state tensors so a checkpoint can be loaded into them.

    torch's own initialiser skips optimizers whose parameters already have grads,
    and ours always do (views into the accumulator), so we take one step with zero
    gradients and lr 0 ourselves: weights and the accumulator are unchanged; the
    state it creates is overwritten by the load.
    """
    if work.optimizer.state:
        return
    work.discard()
    lrs = [g["lr"] for g in work.optimizer.param_groups]
    for g in work.optimizer.param_groups:
        g["lr"] = 0.0
    work.optimizer.step()
    for g, lr in zip(work.optimizer.param_groups, lrs):
        g["lr"] = lr


def load_checkpoint(work: Workload, path: Path, group) -> None:
    """Load a complete checkpoint into `work` (collective over `group`)."""
    _prime_optimizer(work)
    sd = _state_dict(work)
    dcp.load(sd, checkpoint_id=str(path), process_group=group)
    set_model_state_dict(work.model, sd["model"])
    set_optimizer_state_dict(work.model, work.optimizer, sd["optim"])
    work.stepper.load_state_dict(sd["schedule"])
    step = int(path.name.split("-")[-1])
    if work.stepper.committed != step:
        raise ValueError(f"checkpoint {path} holds schedule state of step {work.stepper.committed}, not {step}")
    work.discard()


@dataclass
class _Pending:
    """An async save whose background write may still be running."""

    step: int
    future: Future


class CheckpointSaver:
    """Saves checkpoints of one rank's workload, collectively with the other ranks.

    Every rank calls `save` and `poll` at the same points of the same iterations
    (they contain collectives).
    """

    def __init__(self, ckpts: CheckpointDir, work: Workload, group, rank: int, use_async: bool, keep: int,
                 on_mid_save: Callable[[int], None] = lambda step: None):
        self.ckpts = ckpts
        self.work = work
        self.group = group
        self.rank = rank
        self.use_async = use_async
        self.keep = keep
        self.on_mid_save = on_mid_save
        self.pending: _Pending | None = None

    def save(self, step: int, fault_step: int) -> None:
        """Checkpoint the state before iteration `step` (`fault_step`: the iteration just committed)."""
        if self.ckpts.path(step).exists():
            # A replayed iteration reached a step that is already checkpointed:
            # the checkpoint there is complete; never write over it.
            return
        self.wait()
        tmp = self.ckpts.tmp_path(step)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.parent.mkdir(parents=True, exist_ok=True)
        dist.barrier(group=self.group)  # nobody writes before a stale temp dir is gone
        writer = _MidSaveWriter(tmp, lambda: self.on_mid_save(fault_step))
        if self.use_async:
            # The writer stages (copies) the state before async_save returns, so
            # the optimizer may step while the background thread writes.
            fut = dcp.async_save(_state_dict(self.work), storage_writer=writer, process_group=self.group)
            self.pending = _Pending(step, fut)
        else:
            dcp.save(_state_dict(self.work), storage_writer=writer, process_group=self.group)
            self._complete(step)

    def poll(self) -> None:
        """Finish an async save if every rank's background write is done (collective)."""
        if self.pending is None:
            return
        done = torch.tensor([1 if self.pending.future.done() else 0], dtype=torch.int32)
        # On the training group: the checkpoint group may still be busy in the
        # background save's own collectives, and must not see ours interleaved.
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if int(done.item()):
            self._finish_pending()

    def wait(self) -> None:
        """Block until an in-flight async save is complete (collective)."""
        if self.pending is not None:
            self.pending.future.result()
            self._finish_pending()

    def _finish_pending(self) -> None:
        pending, self.pending = self.pending, None
        pending.future.result()  # re-raises a failed background save
        self._complete(pending.step)

    def _complete(self, step: int) -> None:
        dist.barrier(group=self.group)  # every rank's part is written
        if self.rank == 0:
            tmp = self.ckpts.tmp_path(step)
            os.rename(tmp, self.ckpts.path(step))
            fd = os.open(self.ckpts.root, os.O_RDONLY)
            try:
                os.fsync(fd)  # the rename itself must survive a crash
            finally:
                os.close(fd)
            self.ckpts.prune(self.keep)
