"""`recover train --system recover`: the resilient trainer's worker process.

Contract: the same workload, data and optimizer as the plain trainer, driven
through the public `Replica` API, so every iteration folds exactly the M ids of
the failure-free run and commits the same gradient up to summation order,
whatever replicas die. Exit codes (core/worker_exit.py): 0 when the run completes,
1 when the coordinator stops it (no replica left, no progress, a non-finite loss),
3 when this replica was fenced out (with --no-rejoin, or fenced on evidence; by
default a fenced replica rejoins), 4 when the coordinator is gone, 5 when a replica
of many ranks lost one of its ranks (frozen or gone: core/parallel/rank_beats.py).
Every ending is one line in the replica's log and an `os._exit` after flushing (the
module says why): no traceback, no C++ terminate at teardown. An exception that is
a bug still prints its traceback, then exits 1 the same way.

Checkpoints (`--checkpoint-every K`): after the commit of every step s-1 with s a
multiple of K (and s < --steps), the lowest-numbered member of the generation that
committed it writes the state before step s, asynchronously and alone
(`checkpoint.CheckpointSaver` with no group: every member holds the same weights
after a commit, so one copy is the whole state, and no other replica waits). A
writer that dies mid-save leaves only a temp dir; the next multiple of K is written
by whoever is then the lowest member. Each completed save is a line of
DIR/checkpoints.jsonl (step, path, writer, the training thread's stall).
A run stopped for a non-finite loss at step t (--on-nonfinite stop) keeps what it
committed: the stop says every member still holds the state before t, untouched,
and the lowest member writes it as the checkpoint of step t (synchronously, before
it exits) unless one is there already, so the checkpoint directory ends with the
last committed state, not the last multiple of K. Any save in flight is awaited
before a worker exits, whatever ended the run.
With `resume_from` set (`recover train --resume`), every replica loads that
checkpoint before its hello, so all start from its weights at its step.

A replica of many ranks (`--shard S`, HSDP; `--tp T`, tensor parallelism): the
launcher starts S x T processes per replica, with RECOVER_LOCAL_RANK; rank 0 is the
leader (`Replica`, the only one talking to the coordinator), the others run
`ReplicaFollower` in the same loop; TP splits each block over the "tp" ranks and
FSDP2 shards the model over the "shard" ranks (core/parallel/). Only the leader writes the
replica's final file; checkpoints are refused for it by the config, for now.

Run as `python -m recover.core.resilient --config DIR/config.json --replica r`
with RECOVER_STORE_ADDR and RECOVER_CONTROL_ADDR set by the launcher.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
from pathlib import Path

from . import worker_exit
from .checkpoint import CheckpointDir, CheckpointSaver, TrainingState, load_checkpoint
from .fold import fold_quota
from .replica import Replica, RunEnded
from .results import JsonlWriter, write_final
from .startup import begin, env_addr, worker_args
from .workload import Workload

EXIT_FENCED = worker_exit.EXIT_FENCED


class _Checkpointer:
    """This replica's checkpoint writer: it writes only while it is the lowest member."""

    def __init__(self, cfg, state: TrainingState, hooks, replica_id: int):
        self.replica_id = replica_id
        self.every = cfg.checkpoint_every
        self.steps = cfg.steps
        self.log = Path(cfg.out) / "checkpoints.jsonl"
        self.started: dict[int, tuple[float, float]] = {}  # step -> (perf_counter at save, its stall)
        self.saver = CheckpointSaver(CheckpointDir(cfg.checkpoint_root()), state, None, 0, use_async=True,
                                     keep=cfg.checkpoint_keep,
                                     on_mid_save=lambda step: hooks.at(step, "checkpoint_save"),
                                     on_complete=self._record)

    def after_commit(self, replica: Replica) -> None:
        self.saver.poll()  # re-raises a failed background save
        s = replica.step  # the step about to start: the checkpoint holds the state before it
        if s % self.every == 0 and s < self.steps and replica.replica == min(replica.members):
            t = time.perf_counter()
            self.started[s] = (t, 0.0)
            if not self.saver.save(s, fault_step=s - 1):
                del self.started[s]

    def finish(self) -> None:
        self.saver.wait()

    def save_stopped(self, replica: Replica, committed: int | None) -> None:
        """A stop that says every member holds the state after `committed` steps (a non-finite
        loss): the lowest member writes it as step `committed`'s checkpoint, and waits for it."""
        self.saver.wait()  # a save in flight first (its step is older)
        if committed is None or committed != replica.step or committed >= self.steps or committed <= 0 \
                or replica.generation < 0 or replica.replica != min(replica.members):
            return
        t = time.perf_counter()
        self.started[committed] = (t, 0.0)
        if self.saver.save(committed, fault_step=committed - 1):
            self.saver.wait()
        else:
            del self.started[committed]  # the checkpoint of that step is there already

    def _record(self, step: int) -> None:
        """checkpoints.jsonl: one line per checkpoint renamed into place (the background thread's)."""
        t, _ = self.started.get(step, (time.perf_counter(), 0.0))
        log = JsonlWriter(self.log)
        log.write({"step": step, "path": str(self.saver.ckpts.path(step)), "writer": self.replica_id,
                   # async_save returns after staging: the stall is set before its write can end
                   "stall_seconds": self.saver.last_stall_seconds, "write_seconds": time.perf_counter() - t})
        log.close()


def main(argv: list[str] | None = None) -> int:
    args = worker_args(argv, "resilient (recover) worker")
    # `kill -USR1 <pid>` writes every thread's stack to the replica's log.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    local_rank = int(os.environ.get("RECOVER_LOCAL_RANK", "0"))
    cfg, hooks = begin(args.config, args.replica, rank=local_rank)
    rctx = None
    if cfg.ranks_per_replica > 1:  # a replica of many ranks: its groups, the leader's relay, the ranks' beats
        from .parallel.join import ReplicaContext
        rctx = ReplicaContext.from_env(cfg.collective_timeout, cfg.heartbeat_interval, cfg.heartbeat_timeout,
                                       tp=cfg.tp)
    work = Workload(cfg, cfg.resolved_device(), ctx=None if rctx is None else rctx.parallel)
    if cfg.resume_from:
        # before the hello: its weights digest must be the checkpoint's on every replica
        load_checkpoint(TrainingState.of(work), Path(cfg.resume_from))
    kw = dict(backend=cfg.resolved_backend(), collective_timeout=cfg.collective_timeout,
              heartbeat_interval=cfg.heartbeat_interval, grad_clip=cfg.grad_clip, lr_schedule=work.schedule,
              tokens_per_microbatch=work.tokens_per_microbatch, hooks=hooks, digest_every=cfg.digest_every,
              rejoin=cfg.rejoin, coordinator_timeout=cfg.coordinator_timeout, reconnect_timeout=cfg.reconnect_timeout)
    if rctx is None:
        replica = Replica(work.acc, work.optimizer, replica=args.replica, control_addr=env_addr("RECOVER_CONTROL_ADDR"),
                          store_addr=env_addr("RECOVER_STORE_ADDR"), **kw)
    else:  # the same loop on every rank: Replica on the leader, ReplicaFollower on the others
        replica = rctx.join(work.acc, work.optimizer, **kw)
    leader = rctx is None or rctx.leader
    who = f"replica {args.replica}" + ("" if leader else f" rank {local_rank}")
    if not replica.healed:  # a newcomer already holds its donor's committed count, newer than any checkpoint
        replica.stepper.load_state_dict(work.stepper.state_dict())  # the committed count the checkpoint holds
    saver = _Checkpointer(cfg, TrainingState.of(work, replica.stepper), hooks, args.replica) if cfg.checkpoint_every else None
    try:
        while not replica.done:
            # k counts on from what this replica folded before a recovery handed it more
            fold_quota(replica.step, replica.quota(), work.forward_backward, hooks,
                       first=len(replica.ledger), after=replica.fold)
            if replica.commit() and saver is not None:
                saver.after_commit(replica)
        if rctx is not None:
            rctx.link.close()  # the loop is over: the ranks may now end in any order
        if saver is not None:
            saver.finish()
        checksum = work.state_checksum()  # (a collective of a replica's ranks when it has many)
        if leader:
            write_final(cfg.out, args.replica, replica.step, checksum)
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
    worker_exit.exit_now(code)  # after flushing: see core/worker_exit.py for why os._exit
