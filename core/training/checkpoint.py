"""DCP checkpoints that are either whole or never loaded: fresh temp dir, rename into place.

The one implementation every checkpointing system uses (the checkpoint-restart and
elastic baselines, and `recover`).

Contract:
- A checkpoint of step s holds the state *before* iteration s: model + AdamW (as
  torch.distributed.checkpoint writes them), the LR schedule's state from
  `recipe.CommittedStep`, and the data position ("progress": the step, the next
  global microbatch id s*M, the seed and M). Data and per-microbatch randomness
  are functions of (seed, global microbatch id), so that is all the RNG state
  there is. A load whose schedule state or progress disagrees with s or with this
  run (another seed or M) raises. The keys are the whole model's parameter names
  whatever the layout: AdamW's state is flattened by name (DCP's
  `flatten_optimizer_state_dict`, its form for pipeline stages: each stage's optimizer
  holds other parameters, so its per-group lists would collide), and a pipeline
  stage renames its blocks to the model's (`TrainingState.global_name`), so the
  stages' shards of one checkpoint never share a key. A checkpoint written before,
  with AdamW's per-group lists, still loads at the layouts that could write it (not
  into a pipeline stage: that raises, naming why). Complete checkpoints live in ROOT/step-<s:08d>
  (`checkpoint_dir.py`); nothing else is ever loaded.
- A save never writes over a checkpoint. Every writer writes into the fresh
  ROOT/.tmp-step-<s:08d>; only when every writer has finished (DCP's own finish
  step has written .metadata and, with several ranks, a barrier has passed) is it
  renamed to ROOT/step-<s:08d>, and the rename is fsynced. Why: a DCP save killed
  while overwriting an older checkpoint leaves the old .metadata beside half-new
  data, which looks whole and can load a mix of two saves (measured
  here with torch 2.13's DCP on CPU). A rename is atomic, so a save killed at any point leaves at most a
  stray .tmp dir, and the previous complete checkpoint stays the latest.
- Two ways to write, one path: collectively over a process group (`group` given:
  every rank of the group calls `save`/`poll`/`wait` at the same points; rank 0
  renames, and every rank learns whether its rename succeeded, so all of them
  report the same outcome of each save; a replica of many ranks writes this way,
  each rank its own shards of the model and optimizer state),
  or by a single writer holding the whole state (`group=None`: recover's replicas
  hold identical weights after a commit, so one of them writes, with DCP's
  `no_dist`, and no other replica waits for it).
- Synchronous (`dcp.save`) and asynchronous (`dcp.async_save`) saves take the same
  path. `async_save` stages (copies) the state before it returns, so the optimizer
  may step while the background thread writes; one save is in flight at a time.
  With a group the save is finished (renamed, collectively) at the first `poll()`
  after every rank's background write is done; a single writer renames from the
  background thread as soon as its write is done, so the checkpoint is complete
  even if the training thread never reaches another `poll()`. `on_complete(step)`
  runs once each checkpoint is renamed into place. `last_stall_seconds` is how
  long the training thread was held by the last `save` (for async: the staging).
- A save that fails (a full disk, a lost mount: the background write, the rename, or
  the staging) raises its error from the `save`/`poll`/`wait` that sees it, once, and
  leaves nothing behind: its temp dir is removed (the space it held is freed for the
  next try), no checkpoint is pruned, and the saver is ready for the next save. The
  caller decides what a failure means (core/training/resilient.py records it and goes on).
- The "checkpoint_save" fault point fires on each writer after its data files are
  written and before the checkpoint is complete, i.e. truly mid-save.
- A group's DCP collectives run on a process group of their own: an async save's
  background thread uses it while the training thread all-reduces on the training
  group (`poll_group`: the default group unless given; a gloo group when the default
  one cannot all-reduce a CPU tensor, e.g. NCCL), and two threads issuing
  collectives on one gloo group could interleave differently on different ranks.
"""
from __future__ import annotations

import os
from collections import deque
import shutil
import threading
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from recover.core.contract.iteration import iteration_range
from recover.core.worker.accumulator_interface import Accumulator
from recover.core.storage.checkpoint_dir import CheckpointDir
from recover.core.worker.recipe import CommittedStep

if TYPE_CHECKING:
    from recover.core.training.workload import Workload

__all__ = ["CheckpointDir", "CheckpointSaver", "TrainingState", "load_checkpoint"]


@dataclass
class TrainingState:
    """What a checkpoint saves and restores of one replica."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    stepper: CommittedStep  # the committed step count and LR schedule state
    acc: Accumulator  # emptied around a load (its .grad views must stay attached)
    seed: int  # the run's seed: with M, fixes data order and per-microbatch randomness
    microbatches: int  # M: iteration s starts at global microbatch id s*M
    # this model's parameter name -> the whole model's (a pipeline stage's: core/parallel/pp.py
    # GPTStage.global_name); None: the model is whole and its names are the model's already
    global_name: Callable[[str], str] | None = None
    # a whole-model name of AdamW state ("<param>.<field>") -> where a checkpoint lacking it holds the
    # same state (a pipeline stage's: GPTStage.optimizer_fallback, the tied weight's copy); None: nowhere
    optimizer_fallback: Callable[[str], str | None] | None = None

    @classmethod
    def of(cls, work: "Workload", stepper: CommittedStep | None = None) -> "TrainingState":
        """A workload's state; `stepper` if the loop steps through another CommittedStep (a Replica's)."""
        return cls(work.model, work.optimizer, stepper or work.stepper, work.acc, work.cfg.seed,
                   work.cfg.microbatches, global_name=getattr(work.model, "global_name", None),
                   optimizer_fallback=getattr(work.model, "optimizer_fallback", None))


class _MidSaveWriter(dcp.FileSystemWriter):
    """A FileSystemWriter that calls `on_written` once this writer's data files are on disk."""

    def __init__(self, path: Path, on_written: Callable[[], None]):
        # overwrite=False: the temp dir is always fresh; refuse to mix saves if not.
        super().__init__(path, single_file_per_rank=True, sync_files=True, overwrite=False)
        self._on_written = on_written

    def write_data(self, plan, planner):
        fut = super().write_data(plan, planner)
        self._on_written()
        return fut


def _progress(state: TrainingState, step: int) -> dict:
    return {"step": step, "next_microbatch_id": iteration_range(step, state.microbatches)[0], "seed": state.seed,
            "microbatches": state.microbatches}


# AdamW's state keyed "state.<param>.<field>" and "param_groups.<param>.<field>": by parameter name
# alone, so the stages of a pipeline (each with its own parameters in its groups) never collide
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
# how checkpoints written before that keyed it: AdamW's own state dict ("param_groups" a list of groups,
# each listing its parameters); still loaded, at the layouts that wrote them (no pipeline stage did)
_LISTED_GROUPS = StateDictOptions()
_LISTED_GROUPS_KEY = "optim.param_groups.0.params"


def _state_dict(state: TrainingState, step: int, options: StateDictOptions = _OPTIONS) -> tuple[dict, dict[str, str]]:
    """Model, optimizer, schedule and data position, keyed by the whole model's parameter names
    (DCP's portable form), and each renamed key's local name (for the load to give it back)."""
    model = get_model_state_dict(state.model)
    optim = get_optimizer_state_dict(state.model, state.optimizer, options=options)
    local_of: dict[str, str] = {}
    if state.global_name is not None:
        name = state.global_name
        model = _renamed(model, name, local_of, "model")
        optim = _renamed(optim, lambda key: _optim_name(key, name), local_of, "optim")
    sd = {"model": model, "optim": optim, "schedule": state.stepper.state_dict(), "progress": _progress(state, step)}
    return sd, local_of


def _optim_name(key: str, global_name: Callable[[str], str]) -> str:
    """"state.<param>.<field>" with the whole model's <param> (the rename reads the name's head only)."""
    section, _, rest = key.partition(".")
    return f"{section}.{global_name(rest)}"


def _renamed(sd: dict, rename: Callable[[str], str], local_of: dict[str, str], part: str) -> dict:
    """`sd` under the renamed keys; `local_of` learns each one's own name (keyed "part/renamed")."""
    out = {}
    for k, v in sd.items():
        g = rename(k)
        out[g] = v
        local_of[f"{part}/{g}"] = k
    return out


def _fall_back(sd: dict, local_of: dict[str, str], fallback: Callable[[str], str | None], held) -> None:
    """Ask for AdamW state the checkpoint (its keys: `held`) lacks under the key it holds the same
    state at (if any): e.g. a one-stage model's checkpoint has the tied weight's state as "tok_emb.weight" only."""
    optim = sd["optim"]
    for key in list(optim):
        if f"optim.{key}" in held:
            continue
        section, _, rest = key.partition(".")
        if (other := fallback(rest)) is not None and f"optim.{section}.{other}" in held:
            alias = f"{section}.{other}"
            optim[alias] = optim.pop(key)
            local_of[f"optim/{alias}"] = local_of.pop(f"optim/{key}")


def _local(sd: dict, local_of: dict[str, str], part: str) -> dict:
    """A loaded part of the state dict under this model's own names again."""
    if not local_of:
        return sd
    return {local_of[f"{part}/{k}"]: v for k, v in sd.items()}


def _prime_optimizer(state: TrainingState) -> None:
    """Give a fresh AdamW its state tensors so a checkpoint can be loaded into them.

    torch's own initialiser skips optimizers whose parameters already have grads,
    and ours always do (views into the accumulator), so we take one step with zero
    gradients and lr 0 ourselves: weights and the accumulator are unchanged; the
    state it creates is overwritten by the load.
    """
    if state.optimizer.state:
        return
    state.acc.clear()
    lrs = [g["lr"] for g in state.optimizer.param_groups]
    for g in state.optimizer.param_groups:
        g["lr"] = 0.0
    state.optimizer.step()
    for g, lr in zip(state.optimizer.param_groups, lrs):
        g["lr"] = lr


def load_checkpoint(state: TrainingState, path: Path, group=None) -> None:
    """Load a complete checkpoint into `state` (collective over `group`; None: this process alone)."""
    step = CheckpointDir.step_of(path)
    _prime_optimizer(state)
    held = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    options = _LISTED_GROUPS if _LISTED_GROUPS_KEY in held else _OPTIONS
    if options is _LISTED_GROUPS and state.global_name is not None:
        raise ValueError(f"checkpoint {path} lists AdamW's parameters per group, as checkpoints written before "
                         f"--pp could checkpoint did: it loads at the layout that wrote it, not into a pipeline stage")
    sd, local_of = _state_dict(state, -1, options)
    if state.optimizer_fallback is not None:
        _fall_back(sd, local_of, state.optimizer_fallback, held)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # no_dist: DCP warns that no process group is set up
        dcp.load(sd, checkpoint_id=str(path), process_group=group, no_dist=group is None)
    set_model_state_dict(state.model, _local(sd["model"], local_of, "model"))
    set_optimizer_state_dict(state.model, state.optimizer, _local(sd["optim"], local_of, "optim"), options=options)
    state.stepper.load_state_dict(sd["schedule"])
    if state.stepper.committed != step:
        raise ValueError(f"checkpoint {path} holds schedule state of step {state.stepper.committed}, not {step}")
    if sd["progress"] != _progress(state, step):
        raise ValueError(f"checkpoint {path} was written at data position {sd['progress']}, "
                         f"this run would resume at {_progress(state, step)} (another --seed or --microbatches)")
    state.acc.clear()


@dataclass
class _Pending:
    """An async save whose background write may still be running."""

    step: int
    future: Future
    renamed: threading.Event | None = None  # single writer: set once the background thread renamed it
    error: BaseException | None = None  # single writer: the rename failed in the background thread


COMPLETED_KEPT = 16  # CheckpointSaver.completed keeps this many steps


class CheckpointSaver:
    """Saves checkpoints of one replica's state: collectively with a group's other ranks, or alone."""

    def __init__(self, ckpts: CheckpointDir, state: TrainingState, group, rank: int, use_async: bool, keep: int,
                 on_mid_save: Callable[[int], None] = lambda step: None,
                 on_complete: Callable[[int], None] = lambda step: None, poll_group=None):
        self.ckpts = ckpts
        self.poll_group = poll_group  # with a group: where the training thread asks "all written?"
        self.state = state
        self.group = group  # None: a single writer (no collectives, no barriers)
        self.rank = rank
        self.use_async = use_async
        self.keep = keep
        self.on_mid_save = on_mid_save
        self.on_complete = on_complete
        self.pending: _Pending | None = None
        self.last_stall_seconds = 0.0
        # the last steps this saver renamed into place, in order (bounded: a long run saves without end)
        self.completed: deque[int] = deque(maxlen=COMPLETED_KEPT)

    def save(self, step: int, fault_step: int) -> bool:
        """Checkpoint the state before iteration `step` (`fault_step`: the iteration just committed).

        False if a complete checkpoint of `step` is already there (never written over)."""
        self.wait()  # first: with a group, its background collectives must be over before ours below
        if self._agreed(self.ckpts.path(step).exists()):
            # A replayed iteration reached a step that is already checkpointed:
            # the checkpoint there is complete; never write over it.
            return False
        started = time.perf_counter()
        tmp = self.ckpts.tmp_path(step)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.parent.mkdir(parents=True, exist_ok=True)
        if self.group is not None:
            dist.barrier(group=self.group)  # nobody writes before a stale temp dir is gone
        writer = _MidSaveWriter(tmp, lambda: self.on_mid_save(fault_step))
        sd, _ = _state_dict(self.state, step)
        dist_kw = {"process_group": self.group} if self.group is not None else {"no_dist": True}
        try:
            self._start(step, sd, writer, dist_kw, started)
        except BaseException:
            self.pending = None
            self._discard(step)
            raise
        return True

    def _agreed(self, flag: bool) -> bool:
        """True on every rank of the group if `flag` is on any (alone: `flag`): the ranks must never
        part ways on a shared directory that another writer may change between their looks."""
        if self.group is None:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())

    def _start(self, step: int, sd: dict, writer: "_MidSaveWriter", dist_kw: dict, started: float) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            if self.use_async:
                fut = dcp.async_save(sd, storage_writer=writer, **dist_kw)
                self.last_stall_seconds = time.perf_counter() - started
                self.pending = _Pending(step, fut, None if self.group is not None else threading.Event())
                if self.group is None:
                    fut.add_done_callback(lambda f, p=self.pending: self._complete_alone(p))
            else:
                dcp.save(sd, storage_writer=writer, **dist_kw)
                self.last_stall_seconds = time.perf_counter() - started
                self._complete(step)

    def poll(self) -> None:
        """Finish an async save if every writer's background write is done (collective with a group)."""
        if self.pending is None:
            return
        if self.pending.renamed is not None:
            if self.pending.future.done() and self.pending.renamed.is_set():
                self._take_pending()
            return
        done = torch.tensor([1 if self.pending.future.done() else 0], dtype=torch.int32)
        if self.group is not None:
            # On the training group: the checkpoint group may still be busy in the
            # background save's own collectives, and must not see ours interleaved.
            dist.all_reduce(done, op=dist.ReduceOp.MIN, group=self.poll_group)
        if int(done.item()):
            self._finish_pending()

    def wait(self) -> None:
        """Block until an in-flight async save is complete (collective with a group)."""
        if self.pending is not None:
            self.pending.future.result()
            if self.pending.renamed is not None:
                self.pending.renamed.wait()
                self._take_pending()
            else:
                self._finish_pending()

    def _complete_alone(self, pending: _Pending) -> None:
        """A single writer's background write ended (in its thread): rename it if it succeeded."""
        try:
            if pending.future.exception() is None:
                self._complete(pending.step)
        except BaseException as e:  # noqa: BLE001 - the training thread re-raises it (`_take_pending`)
            pending.error = e
        finally:
            pending.renamed.set()

    def _take_pending(self) -> None:
        pending, self.pending = self.pending, None
        try:
            pending.future.result()  # re-raises a failed background save
            if pending.error is not None:
                raise pending.error
        except BaseException:
            self._discard(pending.step)
            raise

    def _finish_pending(self) -> None:
        pending, self.pending = self.pending, None
        try:
            pending.future.result()  # re-raises a failed background save
            self._complete(pending.step)
        except BaseException:
            self._discard(pending.step)
            raise

    def _discard(self, step: int) -> None:
        """A failed save's temp dir: removed (it is never loaded, and it holds space a full disk needs)."""
        if self.rank == 0:
            shutil.rmtree(self.ckpts.tmp_path(step), ignore_errors=True)

    def _complete(self, step: int) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)  # every rank's part is written
        failed: BaseException | None = None
        if self.rank == 0:
            try:
                os.rename(self.ckpts.tmp_path(step), self.ckpts.path(step))
                fd = os.open(self.ckpts.root, os.O_RDONLY)
                try:
                    os.fsync(fd)  # the rename itself must survive a crash
                finally:
                    os.close(fd)
            except Exception as e:  # noqa: BLE001 - raised below, after the others heard of it
                failed = e
        # Every rank raises if rank 0's rename failed: the ranks count failures in a row alike,
        # so all of them stop the run together (core/training/resilient.py).
        if self._agreed(failed is not None) and failed is None:
            raise OSError(f"rank 0 of the group could not rename the checkpoint of step {step} into place")
        if failed is not None:
            raise failed
        if self.rank == 0:
            self.ckpts.prune(self.keep)
        self.completed.append(step)
        self.on_complete(step)
