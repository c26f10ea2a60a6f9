"""`recover train --system recover`: the resilient trainer's worker process.

Contract: the same workload, data and optimizer as the plain trainer, driven
through the public `Replica` API, so every iteration folds exactly the M ids of
the failure-free run and commits the same gradient up to summation order,
whatever replicas die. Exit codes (core/contract/worker_exit.py): 0 when the run completes,
1 when the coordinator stops it (no replica left, no progress, a non-finite loss),
3 when this replica was fenced out (with --no-rejoin, or fenced on evidence; by
default a fenced replica rejoins), 4 when the coordinator is gone, 5 when a replica
of many ranks lost one of its ranks (frozen or gone: core/parallel/rank_beats.py),
6 when its checkpoint saves kept failing (below; the launcher then stops the run).
Every ending is one line in the replica's log and an `os._exit` after flushing (the
module says why): no traceback, no C++ terminate at teardown. An exception that is
a bug still prints its traceback, then exits 1 the same way.

Checkpoints (`--checkpoint-every K`): after the commit of every step s-1 with s a
multiple of K (and s < --steps), the lowest-numbered member of the generation that
committed it writes the state before step s, asynchronously and alone. That
generation is `Replica.committed_members`, and the writer decides in the replica's
`after_step` callback, right after its optimizer step: before an admitting
generation switches `members` (a newcomer that becomes the lowest member holds no
committed step of its own to write) and before a state transfer can fence the
donor (its `commit()` then returns False, but it did step and must still write)
(`checkpoint.CheckpointSaver` with no group: every member holds the same weights
after a commit, so one copy is the whole state, and no other replica waits). A
writer that dies mid-save leaves only a temp dir; the next multiple of K is written
by whoever is then the lowest member. Each completed save is a line of
DIR/checkpoints.jsonl (step, path, writer, the training thread's stall).
A failed save (a full disk, a lost mount) is a line there too, {"step", "writer",
"failed": true, "error", "in_a_row"} (the last one also "stops_run", "reason"), and training goes on: every member still holds
the committed state in memory, the failed save's temp dir is removed, and older
complete checkpoints stay. checkpoints.jsonl is the record, not events.jsonl: that
file is the coordinator's, and carrying the failure to it needs a protocol message
(left for the protocol's owner). After `--checkpoint-failures N` failures in a row
(default 3) the writer ends with code 6 and a line naming the error, and the
launcher stops the run (exit 1, its reason the same line's error: core/launch/end_policy.py,
experiments/run.py). What was committed stays recorded (metrics.jsonl) and the last
complete checkpoint stays on disk; nothing more could be saved.
A run stopped for a non-finite loss at step t (--on-nonfinite stop) keeps what it
committed: the stop says every member still holds the state before t, untouched,
and the lowest member writes it as the checkpoint of step t (synchronously, before
it exits) unless one is there already, so the checkpoint directory ends with the
last committed state, not the last multiple of K. Any save in flight is awaited
before a worker exits, whatever ended the run.
With `resume_from` set (`recover train --resume`), every replica loads that
checkpoint before its hello, so all start from its weights at its step.

A replica of many ranks (`--shard S`, HSDP; `--tp T`, tensor parallelism; `--pp P`,
pipeline stages): the launcher starts P x S x T processes per replica, with RECOVER_LOCAL_RANK; rank 0 is the
leader (`Replica`, the only one talking to the coordinator), the others run
`ReplicaFollower` in the same loop; TP splits each block over the "tp" ranks and
FSDP2 shards the model over the "shard" ranks (core/parallel/). With P > 1
each rank holds one stage; the loop collects the quota's ids, then runs them
through one pipeline schedule (under --exact, one schedule per id) and folds them (`fold.fold_pipelined`). Only the leader writes the
replica's final file. At any layout, every
rank of the writing replica checkpoints its own shards, collectively over a gloo group
of the replica's own: followers learn the committing generation's members (and a stop's
committed count) from the leader's relay and call `after_step` where it does, so all
ranks save the same step; the save is async, and is renamed into place (rank 0, after a
barrier) at the first step end at which every rank's write is done, or at the next
save or the run's end: a replica that dies before then leaves a temp dir only. A failed
save fails on every rank alike (core/training/checkpoint.py), so all ranks count it and
end together with code 6; the leader alone writes checkpoints.jsonl and stops the run.
`--resume` loads each rank's shards collectively over the replica's link group (a pipeline
stage's under the whole model's names: core/training/checkpoint.py).

Run as `python -m recover.core.training.resilient --config DIR/config.json --replica r`
with RECOVER_STORE_ADDR and RECOVER_CONTROL_ADDR set by the launcher.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
from pathlib import Path

from recover.core.contract import worker_exit
from torch.distributed.checkpoint.api import CheckpointException

from recover.core.training.checkpoint import CheckpointDir, CheckpointSaver, TrainingState, load_checkpoint
from recover.core.worker.fold import fold_pipelined, fold_quota
from recover.core.worker.replica import Replica, RunEnded
from recover.core.storage.results import JsonlWriter, write_final
from recover.core.launch.startup import begin, env_addr, worker_args
from recover.core.training.workload import Workload
from recover.core.contract import env_names

EXIT_FENCED = worker_exit.EXIT_FENCED


class CheckpointsFailing(RuntimeError):
    """`--checkpoint-failures` saves failed in a row: this writer ends the run (exit code 6)."""

    code = worker_exit.EXIT_CHECKPOINTS_FAILED

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


# What a failed save raises: torch.distributed.checkpoint's CheckpointException is a BaseException
_SAVE_ERRORS = (Exception, CheckpointException)


def _describe(e: BaseException) -> str:
    """A failed save's error in one line: the cause DCP wraps (its str is a whole traceback)."""
    while isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]
    return " ".join(f"{type(e).__name__}: {e}".split())[:300]


class _Checkpointer:
    """This replica's checkpoint writer: it writes only while it is the lowest member."""

    def __init__(self, cfg, state: TrainingState, hooks, replica_id: int, group=None, rank: int = 0,
                 poll_group=None):
        self.replica_id = replica_id
        self.leader = rank == 0  # the leader alone writes checkpoints.jsonl (the record is the replica's)
        self.every = cfg.checkpoint_every
        self.steps = cfg.steps
        self.max_failures = cfg.checkpoint_failures
        self.failures = 0  # saves failed in a row (a completed save resets it)
        self.last_error = ""
        self.log = Path(cfg.out) / "checkpoints.jsonl"
        self.started: dict[int, tuple[float, float]] = {}  # step -> (perf_counter at save, its stall)
        self.saver = CheckpointSaver(CheckpointDir(cfg.checkpoint_root()), state, group, rank, use_async=True,
                                     keep=cfg.checkpoint_keep,
                                     on_mid_save=lambda step: hooks.at(step, "checkpoint_save"),
                                     on_complete=self._record, poll_group=poll_group)

    def after_step(self, replica: Replica) -> None:
        """Right after this replica's optimizer step (`Replica.after_step`): write if due."""
        self._poll()
        s = replica.step  # the step about to start: the checkpoint holds the state before it
        # the generation that committed step s-1, not `members`, which an admission switches next
        if s % self.every == 0 and s < self.steps and replica.replica == min(replica.committed_members):
            self._save(s)

    def check(self) -> None:
        """Raise CheckpointsFailing once `--checkpoint-failures` saves failed in a row."""
        if self.failures >= self.max_failures:
            raise CheckpointsFailing(self._stop_reason())

    def _stop_reason(self) -> str:
        latest = self.saver.ckpts.latest()
        return (f"{self.failures} checkpoint saves in a row failed, the last: {self.last_error}; the run stops "
                f"(--checkpoint-failures {self.max_failures}); committed steps are recorded, the last complete "
                f"checkpoint is {'none' if latest is None else self.saver.ckpts.path(latest)}")

    def finish(self) -> None:
        self._wait()

    def save_stopped(self, replica: Replica, committed: int | None) -> None:
        """A stop that says every member holds the state after `committed` steps (a non-finite
        loss): the lowest member writes it as step `committed`'s checkpoint, and waits for it."""
        self._wait()  # a save in flight first (its step is older)
        if committed is None or committed != replica.step or committed >= self.steps or committed <= 0 \
                or replica.generation < 0 or not replica.members or replica.replica != min(replica.members):
            return
        if self._save(committed):
            self._wait()

    def _save(self, step: int) -> bool:
        self._wait()  # a save still in flight: its failure is its own step's
        if self.failures >= self.max_failures:
            # that failure was the last one allowed: the run stops at the next check(), and no
            # save starts before it (on a slow machine the loop reaches the next save first)
            return False
        # no save is in flight now, so no entry is still owed a record: one entry at most, however long the run
        self.started.clear()
        self.started[step] = (time.perf_counter(), 0.0)
        try:
            saved = self.saver.save(step, fault_step=step - 1)
        except _SAVE_ERRORS as e:
            self._failed(step, e)
            return False
        if not saved:
            del self.started[step]  # the checkpoint of that step is there already
        return saved

    def _poll(self) -> None:
        pending = self.saver.pending
        try:
            self.saver.poll()
        except _SAVE_ERRORS as e:
            self._failed(pending.step, e)

    def _wait(self) -> None:
        pending = self.saver.pending
        try:
            self.saver.wait()
        except _SAVE_ERRORS as e:
            self._failed(pending.step, e)

    def _failed(self, step: int, e: BaseException) -> None:
        """A save that failed: a line of checkpoints.jsonl and of the log; training goes on."""
        self.started.pop(step, None)
        self.failures += 1
        self.last_error = _describe(e)
        print(f"[replica {self.replica_id}] checkpoint of step {step} failed ({self.failures} in a row, the run "
              f"stops at {self.max_failures}): {self.last_error}; training goes on", file=sys.stderr, flush=True)
        rec = {"step": step, "writer": self.replica_id, "failed": True, "error": self.last_error,
               "in_a_row": self.failures}
        if self.failures >= self.max_failures:  # check() ends the run: the launcher's summary takes this reason
            rec.update(stops_run=True, reason=self._stop_reason())
        if not self.leader:
            return
        log = JsonlWriter(self.log)
        log.write(rec)
        log.close()

    def _record(self, step: int) -> None:
        """checkpoints.jsonl: one line per checkpoint renamed into place (the background thread's)."""
        self.failures = 0
        t, _ = self.started.pop(step, (time.perf_counter(), 0.0))
        if not self.leader:
            return
        log = JsonlWriter(self.log)
        log.write({"step": step, "path": str(self.saver.ckpts.path(step)), "writer": self.replica_id,
                   # async_save returns after staging: the stall is set before its write can end
                   "stall_seconds": self.saver.last_stall_seconds, "write_seconds": time.perf_counter() - t})
        log.close()


def main(argv: list[str] | None = None) -> int:
    args = worker_args(argv, "resilient (recover) worker")
    # `kill -USR1 <pid>` writes every thread's stack to the replica's log.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    local_rank = int(os.environ.get(env_names.LOCAL_RANK, "0"))
    cfg, hooks = begin(args.config, args.replica, rank=local_rank)
    rctx = None
    if cfg.ranks_per_replica > 1:  # a replica of many ranks: its groups, the leader's relay, the ranks' beats
        from recover.core.parallel.join import ReplicaContext
        rctx = ReplicaContext.from_env(cfg.collective_timeout, cfg.heartbeat_interval, cfg.heartbeat_timeout,
                                       tp=cfg.tp, pp=cfg.pp, pp_schedule=cfg.pp_schedule)
    ckpt_group = None
    if rctx is not None and cfg.checkpoint_every:
        # the replica's collective saves: a gloo group of their own, which the async save's
        # background thread uses while the training thread runs the link's and FSDP2's; it waits as
        # long as the link (a slow rank's write is no fault; a dead rank ends the replica anyway)
        import torch.distributed as dist
        from recover.core.parallel.replica_link import LINK_TIMEOUT
        ckpt_group = dist.new_group(backend="gloo", timeout=LINK_TIMEOUT)
    work = Workload(cfg, cfg.resolved_device(), ctx=None if rctx is None else rctx.parallel)
    if cfg.resume_from:
        # before the hello: its weights digest must be the checkpoint's on every replica;
        # a replica of many ranks loads collectively, each rank its shards (the link is idle yet)
        load_checkpoint(TrainingState.of(work), Path(cfg.resume_from), None if rctx is None else rctx.link.group)
    kw = dict(backend=cfg.resolved_backend(), collective_timeout=cfg.collective_timeout,
              heartbeat_interval=cfg.heartbeat_interval, grad_clip=cfg.grad_clip, lr_schedule=work.schedule,
              tokens_per_microbatch=work.tokens_per_microbatch, hooks=hooks, digest_every=cfg.digest_every,
              rejoin=cfg.rejoin, coordinator_timeout=cfg.coordinator_timeout, reconnect_timeout=cfg.reconnect_timeout)
    if rctx is None:
        replica = Replica(work.acc, work.optimizer, replica=args.replica, control_addr=env_addr(env_names.CONTROL_ADDR),
                          store_addr=env_addr(env_names.STORE_ADDR), **kw)
    else:  # the same loop on every rank: Replica on the leader, ReplicaFollower on the others
        replica = rctx.join(work.acc, work.optimizer, **kw)
    leader = rctx is None or rctx.leader
    who = f"replica {args.replica}" + ("" if leader else f" rank {local_rank}")
    if not replica.healed:  # a newcomer already holds its donor's committed count, newer than any checkpoint
        replica.adopt_committed_count(work.stepper.state_dict())  # the committed count the checkpoint holds
    saver = None
    if cfg.checkpoint_every:
        saver = _Checkpointer(cfg, TrainingState.of(work, replica.stepper), hooks, args.replica, group=ckpt_group,
                              rank=local_rank if rctx is not None else 0,
                              poll_group=None if rctx is None else rctx.link.group)
    if saver is not None:
        replica.after_step = saver.after_step  # decided from the generation that committed the step
    try:
        while not replica.done:
            # k counts on from what this replica folded before a recovery handed it more
            if work.pipeline is None:
                fold_quota(replica.step, replica.quota(), work.forward_backward, hooks,
                           first=len(replica.ledger), after=replica.fold)
            else:  # the quota's ids, then one run of the schedule over them (core/worker/fold.py)
                fold_pipelined(replica.step, replica.quota(), work.forward_backward_many, hooks,
                               first=len(replica.ledger), after=replica.fold, progress=replica.progress)
            replica.commit()
            if saver is not None:
                saver.check()
        if rctx is not None:
            rctx.link.close()  # the loop is over: the ranks may now end in any order
        if saver is not None:
            saver.finish()
        checksum = work.state_checksum()  # (a collective of a replica's ranks when it has many)
        shards = work.shard_digests()  # likewise
        if leader:
            write_final(cfg.out, args.replica, replica.step, checksum,
                        digest=work.acc.weights_digest() if rctx is None else None, shard_digests=shards)
    except CheckpointsFailing as e:
        # every rank of the replica counted the same failures (core/training/checkpoint.py): all are here
        if leader:
            replica.stop_run(e.reason)  # before the exit closes the connection: a stop, not a lost replica
        if rctx is not None:
            import torch.distributed as dist
            dist.barrier(group=rctx.link.group)  # no rank exits (and so kills the replica) before the stop is sent
        print(worker_exit.line_of(who, e), file=sys.stderr, flush=True)
        return e.code
    except RunEnded as e:
        if saver is not None:
            saver.save_stopped(replica, e.committed)
        code = worker_exit.EXIT_COMPLETE if replica.done and not e.fenced else e.code
        print(worker_exit.line_of(who, e) if code == e.code
              else f"{who} exits with code {code}: every step committed ({e.reason})",
              file=sys.stderr, flush=True)
        return code
    finally:
        replica.close()
    print(f"{who} exits with code 0: run complete", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except RunEnded as e:  # raised before the loop (the constructor: the coordinator is gone)
        worker_exit.exit_now(e.code, worker_exit.line_of("replica", e))
    except Exception:  # a bug: its traceback is the thing to read, then the same explicit end
        import traceback
        traceback.print_exc()
        worker_exit.exit_now(worker_exit.EXIT_STOPPED)
    worker_exit.exit_now(code)  # after flushing: see core/contract/worker_exit.py for why os._exit
