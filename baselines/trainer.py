"""The restartable data-parallel loop that checkpoint-restart and elastic workers run.

Contract:
- One call of `train` is one *incarnation* of the job: a fixed group of ranks that
  resumes from the latest complete checkpoint (or step 0), trains until the last
  step, and checkpoints every K iterations (`core/training/checkpoint.py`, the one
  implementation every checkpointing system shares). Any fault ends the
  incarnation with an exception or a signal; whoever restarts the job (our
  supervisor, or TorchElastic) starts the next one.
- The same workload as every other system: `core.training.workload.Workload` (model, AdamW,
  flat accumulator, fold/pack/apply), iteration t owns the global ids
  `iteration_ids(t, M)`, split over the ranks by `core.contract.policy.assign_quotas`, one
  all-reduce per iteration. With `keep_global` the group folds all M ids whatever
  its size (the failure-free gradient); otherwise a group of n ranks folds only
  the ids that n of the original R replicas would have folded (the global batch
  shrinks, as most elastic set-ups do) and the gradient is their mean.
- Rank 0 keeps metrics.jsonl to each iteration once: on start it drops the lines
  of steps >= the resume step (they are redone), and appends each committed step.
  On the first commit after a restart it appends the restart's record to
  events.jsonl (fault, detected_at, resumed_at, work lost); at the end it writes
  DIR/baseline/final.json with the weights' checksum and sha256 digest.
- With `--exact` (core/worker/exact.py) a restarted group of any size commits the same
  bits as the failure-free run (keep_global: the same M ids per step).
- A replica of many ranks (`--shard S`, `--tp T`: a `ReplicaGrid`) is partitioned
  exactly as plain's and recover's are: recover's `ParallelContext` (the default
  group is the replica; FSDP2, after TP, over its ranks), each rank folding its part
  of every microbatch of its replica's quota, and the ranks at one position of
  every member replica summing their parts over a `Communicator` of that position.
  Ranks, quotas and the work log are then per replica (`Incarnation.rank`/`world`
  count replicas); the job's rank 0 (local rank 0 of the replica of rank 0) keeps the
  books above and hands its plan to the others through the attempt's store. The
  checkpoint is sharded: the S x T ranks of the replica of rank 0 write it
  collectively (each its own shards, over a gloo group of the replica), and it is
  complete only once every one of them has written (`CheckpointSaver` with a group):
  after a commit every replica holds the same shards at each position, as DCP's own
  de-duplication of an HSDP save would keep one copy. Every replica loads it, each
  rank its own shards.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from recover.core.training.checkpoint import CheckpointDir, CheckpointSaver, TrainingState, load_checkpoint
from recover.core.config.train_config import TrainConfig
from recover.core.components.data import iteration_ids
from recover.core.worker.fold import fold_quota
from recover.core.launch.hooks import WorkerHooks
from recover.core.contract.policy import assign_quotas, quota_sizes
from recover.core.storage.results import JsonlWriter, metric_record, truncate_metrics
from recover.core.training.workload import Workload
from recover.core.worker.comm import Communicator

from .runlog import (
    WorkLog,
    baseline_dir,
    furthest_step_begun,
    microbatches_begun,
    record_detection,
)
from .settings import BaselineConfig


@dataclass
class Incarnation:
    """Who trains in one start of the job."""

    generation: int  # the start's number: 0 first, +1 per restart
    rank: int  # this process's rank in the group
    world: int  # ranks in the group
    replica: int  # this process's replica id: the fault plan's target, its work-log name
    members: list[int]  # replica id of every rank, by rank
    t0: float  # the run's start on the time.time() clock
    started_at: float  # when this process started, seconds since t0


@dataclass
class ReplicaGrid:
    """A replica of many ranks: this rank's grid inside it, and what joins it to the others."""

    ctx: Any  # recover's ParallelContext: the replica's default group and FSDP2/TP mesh
    cross: Communicator  # this rank's position across the incarnation's member replicas
    store: dist.Store  # the incarnation's own store: the job's rank 0 hands its plan through it
    timeout: float  # how long a collective of the step may take

    @property
    def local_rank(self) -> int:
        return self.ctx.local_rank


PLAN_KEY = "trainer/plan"


def checkpoint_dir(out: str) -> CheckpointDir:
    return CheckpointDir(baseline_dir(out) / "checkpoints")


def step_ids(step: int, cfg: TrainConfig, world: int, keep_global: bool) -> list[int]:
    """The microbatch ids a group of `world` ranks folds in iteration `step`."""
    ids = iteration_ids(step, cfg.microbatches)
    if keep_global or world >= cfg.replicas:
        return ids
    # The share the first `world` of the original R replicas would have done.
    sizes = quota_sizes(cfg.microbatches, list(range(cfg.replicas)))
    return ids[: sum(sizes[r] for r in range(world))]


def _broadcast(obj: Any, group) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _share_plan(plan: dict, grid: ReplicaGrid | None, ckpt_group, lead: bool) -> dict:
    """The job's rank 0's plan, on every rank: a broadcast over the job's group, or (a grid, whose
    default group is only its replica) through the store. That wait is bounded by rank 0's liveness:
    any rank that exits ends the attempt, every process of it killed by PID (the supervisor's launcher)."""
    if grid is None:
        return _broadcast(plan, ckpt_group)
    if lead:
        grid.store.set(PLAN_KEY, json.dumps(plan))
        return plan
    return json.loads(grid.store.get(PLAN_KEY))


class _NoLog:
    def begin(self, step: int, mb_id: int) -> None:
        pass

    def close(self) -> None:
        pass


def train(
    cfg: TrainConfig,
    settings: BaselineConfig,
    inc: Incarnation,
    hooks: WorkerHooks,
    ckpt_group,
    keep_global: bool = True,
    fault_notice: Callable[[], dict] = dict,
    grid: ReplicaGrid | None = None,
) -> int:
    """Run one incarnation; `ckpt_group` carries DCP's collectives.

    Without `grid` the default process group is the job's (one rank per replica); with one,
    it is this rank's replica, and the step's sum goes over `grid.cross`."""
    out = Path(cfg.out)
    ckpts = checkpoint_dir(cfg.out)
    local = grid.local_rank if grid is not None else 0
    lead = inc.rank == 0 and local == 0  # the job's rank 0: keeps the books
    writes = inc.rank == 0 or grid is None  # whose ranks write the checkpoint (see the contract)
    work = Workload(cfg, cfg.resolved_device(), ctx=grid.ctx if grid is not None else None)
    hooks.attach_weights(work.acc)  # a bitflip fault corrupts these (and nothing here notices)
    plan: dict[str, Any] = {}
    restart: dict[str, Any] | None = None
    if lead:
        # Every process of the last incarnation is gone by now, so the files are still.
        ckpts.remove_temps()
        start = ckpts.latest() or 0
        furthest = furthest_step_begun(out)
        dropped = truncate_metrics(out, start)
        if inc.generation > 0:
            restart = {
                "kind": "restart", "generation": inc.generation, **fault_notice(),
                "started_at": inc.started_at, "from_step": start, "furthest_step": furthest,
                # A step begun in the failed incarnation proves every step before it finished its
                # all-reduce on every member: those steps were done and are redone even when rank 0
                # was torn down before it wrote their lines (a race the recorded lines alone lose).
                "work_lost_steps": max(len(dropped), furthest_step_begun(out, inc.generation - 1) - start),
                "work_lost_microbatches": microbatches_begun(out, inc.generation - 1, start),
                "members": sorted(inc.members), "world": inc.world,
            }
        plan = {"start": start}
    plan = _share_plan(plan, grid, ckpt_group, lead)
    start = plan["start"]
    if start > 0:  # (a grid: every replica loads, each rank its own shards, over its replica's group)
        load_checkpoint(TrainingState.of(work), ckpts.path(start), ckpt_group)
    saver = None
    if writes:
        saver = CheckpointSaver(ckpts, TrainingState.of(work), ckpt_group, local if grid is not None else inc.rank,
                                settings.ckpt_async, settings.ckpt_keep,
                                on_mid_save=lambda step: hooks.at(step, "checkpoint_save"))
    # one work log per replica: its rank 0 logs the microbatches (every rank folds its part of each)
    log = WorkLog(out, inc.replica, inc.generation) if local == 0 else _NoLog()
    metrics = JsonlWriter(out / "metrics.jsonl") if lead else None
    events = JsonlWriter(out / "events.jsonl") if restart else None
    try:
        for step in range(start, cfg.steps):
            ids = step_ids(step, cfg, inc.world, keep_global)
            quota = assign_quotas(ids, list(range(inc.world)))[inc.rank]
            fold_quota(step, quota, work.fold, hooks, before=lambda mb: log.begin(step, mb))
            buf = work.pack()
            if grid is not None:  # this position's parts, across the replicas (deadline-bound, polled)
                grid.cross.allreduce(buf, grid.timeout, while_in_flight=lambda: hooks.at(step, "allreduce"))
            else:
                handle = dist.all_reduce(buf, async_op=True)
                hooks.at(step, "allreduce")
                # Poll instead of wait(): a blocking wait would hold off Python signal
                # handlers (a TorchElastic agent stopping this worker) until the
                # collective ends or times out.
                while not handle.is_completed():
                    time.sleep(0.0005)
                handle.wait()
            if (wide := work.wide_after(buf)) is not None:  # --exact, a spike in the step (core/worker/exact.py)
                dist.all_reduce(wide)  # (--exact refuses a replica of many ranks: the default group is the job's)
            hooks.at(step, "vote")
            hooks.at(step, "commit")
            hooks.at(step, "optimizer_step")
            loss, lr = work.apply(buf, len(ids), step, wide)
            if metrics is not None:
                rec = metric_record(step, loss, len(ids) * work.tokens_per_microbatch, ids, inc.generation,
                                    inc.members, inc.t0, lr=lr)
                metrics.write(rec)
                if events is not None:
                    restart["step"], restart["resumed_at"] = step, rec["wall_time"]
                    if restart.get("detected_at") is not None:
                        restart["restart_seconds"] = rec["wall_time"] - restart["detected_at"]
                    # Unknown values are left out rather than written as null.
                    events.write({k: v for k, v in restart.items() if v is not None})
                    events.close()
                    events = None
            if saver is not None:
                saver.poll()
                if (step + 1) % settings.ckpt_every == 0 and step + 1 < cfg.steps:
                    saver.save(step + 1, fault_step=step)
        if saver is not None:
            saver.wait()
    except BaseException as e:  # CheckpointException is a BaseException; SystemExit from a SIGTERM handler too
        record_detection(out, inc.generation, inc.replica, inc.t0, f"{type(e).__name__}: {e}")
        raise
    finally:
        log.close()
    # a grid's checksum is a collective of the replica's ranks: every rank takes part
    checksum = work.state_checksum() if grid is not None or metrics is not None else None
    if metrics is not None:
        metrics.close()
        final = {"step": cfg.steps, "weights_checksum": checksum, "generation": inc.generation,
                 "weights_digest": work.acc.weights_digest() if grid is None else None}
        (baseline_dir(out) / "final.json").write_text(json.dumps(final))
    return 0
