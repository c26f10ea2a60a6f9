"""Your own FSDP2 training loop as a replica of many ranks (HSDP): the entry point.

    ctx = ReplicaContext.from_env()                   # under `recover launch --shard S`
    model = shard_model(build_model(), ctx.mesh)       # FSDP2 over this replica's ranks (sum reductions)
    acc = ShardedAccumulator(model)                    # .grad views one flat buffer of this rank's shard
    optimizer = torch.optim.AdamW(acc.params, lr=1e-3)
    replica = ctx.join(acc, optimizer, grad_clip=1.0)  # the same API on every rank
    while not replica.done:
        for mb in replica.quota():                     # global microbatch ids, the same on every rank
            x, y, share = ctx.part(*batch(mb))         # this rank's rows of the microbatch, their share
            loss = loss_fn(model(x), y) * share
            loss.backward()
            replica.fold(mb, loss.item())
        replica.commit()
    replica.close()

Contract:
- `ReplicaContext.from_env()` reads what the launcher sets (RECOVER_REPLICA,
  RECOVER_LOCAL_RANK, RECOVER_RANKS_PER_REPLICA, RECOVER_TP, RECOVER_PP, RECOVER_PP_SCHEDULE,
  RECOVER_STORE_ADDR; the deadlines from
  RECOVER_COLLECTIVE_TIMEOUT, RECOVER_HEARTBEAT_INTERVAL and
  RECOVER_HEARTBEAT_TIMEOUT when set) and builds, for this rank: its replica's
  groups (`parallel`, a ParallelContext: the replica is the process's default
  group, `mesh` the 1-D mesh FSDP2 shards over), the leader's relay (`link`) and
  the ranks' beats to their leader (core/parallel/rank_beats.py: a rank frozen or
  gone ends the replica, with exit code 5).
- `join(acc, optimizer, **kw)` returns the replica handle: `core.worker.replica.Replica`
  on the leader (local rank 0, the only rank that talks to the coordinator; `kw`
  are its keyword arguments), `ReplicaFollower` on the others (which use `grad_clip`,
  `lr_schedule` and `hooks` of them). Both have `done`, `step`, `quota()`,
  `fold()`, `commit()`, `close()`, and raise `core.worker.replica.RunEnded` when the run
  ends for them. `close()` after the loop says goodbye to the leader's watch, so the
  ranks may then exit in any order.
- `part(x, y)` is this rank's rows of a microbatch and their share of its rows:
  scale the loss by the share, and the ranks' gradients sum to the microbatch's.
  The rows follow the shard index: the `tp` ranks of one shard position (tensor
  parallelism, `from_env(tp=T)` or RECOVER_TP: RECOVER_RANKS_PER_REPLICA counts all S x T ranks of the
  replica) take the same rows. Likewise `from_env(tp=T, pp=P, pp_schedule=...)` (or
  RECOVER_PP, RECOVER_PP_SCHEDULE: `recover launch --pp P --pp-schedule ...`):
  RECOVER_RANKS_PER_REPLICA counts P x S x T ranks, on the ("pp", "shard", "tp") grid;
  `parallel.pp_index` is this rank's stage, `parallel.pp_mesh` its stages' group
  (examples/pp_loop.py runs torch's pipelining over it).
- With T > 1, `join` has the committed step clip with the accumulator's
  `clip_grad_norm_` (torch's refuses a model split over two meshes and plain tensors).
- Bit-identical runs (what `recover train --exact` does at --shard, --tp and --pp): call
  `recover.core.deterministic_kernels()` and pass
  `ExactShardedAccumulator(model, M, range_bits, mesh=ctx.mesh)` (core/parallel/fsdp.py)
  instead; every rank must fold every id (its band is agreed over the replica in `fold`).
  With a pipeline (P > 1) it is `ExactPipelineAccumulator`, whose `take(id, loss)` every
  stage calls right after a schedule run of that id alone (core/parallel/pp.py's
  `Pipeline(take=...)`), before `fold`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from recover.core.contract import worker_exit
from recover.core.launch.startup import connect_store, env_addr
from recover.core.parallel.args import ParallelismArgs
from recover.core.parallel.context import ParallelContext, replica_prefix
from recover.core.parallel.fsdp import microbatch_part
from recover.core.parallel.rank_beats import RankBeats, local_address
from recover.core.parallel.replica_link import LINK_TIMEOUT, ReplicaLink
from recover.core.worker.accumulator_interface import Accumulator
from recover.core.contract import env_names

if TYPE_CHECKING:  # join's return type only: the leader's import of replica stays lazy (see join)
    from recover.core.parallel.follower import ReplicaFollower
    from recover.core.worker.replica import Replica


def _env_float(name: str, default: float) -> float:
    return float(os.environ[name]) if os.environ.get(name) else default


@dataclass
class ReplicaContext:
    """One rank's place in its replica, its relay and its beats (see the module docstring)."""

    replica: int  # the replica id (the failure domain)
    local_rank: int  # this rank inside the replica; 0 is the leader
    shard: int  # ranks in the replica (S x T; S when T = 1)
    parallel: ParallelContext  # the replica's groups (the process's default group) and its mesh
    link: ReplicaLink  # the leader's relay to the other ranks
    beats: RankBeats  # every rank beats to the leader; a silent one ends the replica
    collective_timeout: float  # seconds, from go, for a cross-replica all-reduce

    @classmethod
    def from_env(cls, collective_timeout: float | None = None, heartbeat_interval: float | None = None,
                 heartbeat_timeout: float | None = None, tp: int | None = None, pp: int | None = None,
                 pp_schedule: str | None = None) -> "ReplicaContext":
        """This rank's context in a job started by the launcher (`recover launch --shard S`); a
        deadline not given comes from the environment, else its default (30 s, 0.1 s, 3 s). With
        `tp` = T > 1 (default: RECOVER_TP, else 1) and `pp` = P (default: RECOVER_PP, else 1) the
        launcher's RECOVER_RANKS_PER_REPLICA ranks per replica are P x S x T (tp innermost); the
        schedule's name defaults to RECOVER_PP_SCHEDULE, else 1f1b.

        Args:
            collective_timeout: seconds a cross-replica all-reduce may take; None:
                RECOVER_COLLECTIVE_TIMEOUT, else 30.
            heartbeat_interval: seconds between a rank's beats to its leader; None:
                RECOVER_HEARTBEAT_INTERVAL, else 0.1.
            heartbeat_timeout: seconds of a rank's silence that end its replica (exit code 5);
                None: RECOVER_HEARTBEAT_TIMEOUT, else 3.
            tp: T, the tensor-parallel ranks of one shard position; None: RECOVER_TP, else 1.
            pp: P, the pipeline stages; None: RECOVER_PP, else 1.
            pp_schedule: the pipeline schedule's name ("1f1b", or "afab": GPipe); None:
                RECOVER_PP_SCHEDULE, else "1f1b".

        Returns:
            This rank's context: its replica's groups and mesh built, its beats started.

        Raises:
            ValueError: T or P below 1, a deadline or interval not above 0, or T x P not
                dividing the replica's RECOVER_RANKS_PER_REPLICA ranks (before any group is built).
        """
        r = int(os.environ[env_names.REPLICA])
        local = int(os.environ.get(env_names.LOCAL_RANK, "0"))
        shard = int(os.environ.get(env_names.RANKS_PER_REPLICA, "1"))  # the replica's ranks
        # (`is None`, not `or`: a 0 given is a mistake to name, not a wish for the default)
        tp = int(os.environ.get(env_names.TP, "1")) if tp is None else tp
        pp = int(os.environ.get(env_names.PP, "1")) if pp is None else pp
        pp_schedule = pp_schedule or os.environ.get(env_names.PP_SCHEDULE) or "1f1b"
        collective = _env_float(env_names.COLLECTIVE_TIMEOUT, 30.0) if collective_timeout is None else collective_timeout
        interval = _env_float(env_names.HEARTBEAT_INTERVAL, 0.1) if heartbeat_interval is None else heartbeat_interval
        hb_timeout = _env_float(env_names.HEARTBEAT_TIMEOUT, 3.0) if heartbeat_timeout is None else heartbeat_timeout
        if tp < 1 or pp < 1:
            raise ValueError(f"tp and pp must be >= 1, got tp={tp}, pp={pp}")
        for name, v in (("collective_timeout", collective), ("heartbeat_interval", interval),
                        ("heartbeat_timeout", hb_timeout)):
            if not v > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {v}")
        if shard % (tp * pp):
            raise ValueError(f"--tp {tp} x --pp {pp} does not divide the replica's {shard} ranks")
        replicas = int(os.environ.get(env_names.REPLICAS, r + 1))
        incarnation = int(os.environ.get(env_names.INCARNATION, "0"))  # a replacement's own store keys
        parallel = ParallelContext(connect_store(), r, local, ParallelismArgs(max(replicas, r + 1), shard // (tp * pp), tp, pp, pp_schedule),
                                   backend="gloo", timeout=LINK_TIMEOUT.total_seconds(), incarnation=incarnation)
        link = ReplicaLink(local, shard, open_store=connect_store)
        # until the leader's first commit a rank pays one-time costs holding the GIL: the collective
        # timeout then, as the coordinator allows its workers before their first vote
        cold = max(hb_timeout, collective)

        def lost(rank: int, silent: float) -> None:
            worker_exit.exit_now(worker_exit.EXIT_RANK_LOST, f"[replica {r}] rank {rank} silent for {silent:.1f}s (frozen or "
                                                 f"gone): this replica is lost; exiting so that its ranks end together")

        def leader_gone() -> None:
            worker_exit.exit_now(worker_exit.EXIT_RANK_LOST, f"[replica {r} rank {local}] the leader is gone: this replica "
                                                 f"is lost")

        store_host = env_addr(env_names.STORE_ADDR)[0]
        beats = RankBeats(connect_store(), r, local, shard, interval,
                          limit=lambda: hb_timeout if link.committed_once else cold,
                          on_silent=lost, on_leader_gone=leader_gone, host=local_address(store_host),
                          prefix=replica_prefix(r, incarnation))
        link.beats = beats
        beats.start()
        return cls(r, local, shard, parallel, link, beats, collective)

    @property
    def leader(self) -> bool:
        """True on the replica's leader (local rank 0), the only rank that talks to the coordinator."""
        return self.local_rank == 0

    @property
    def mesh(self):
        """The replica's DeviceMesh: ("shard",) of S ranks, ("shard", "tp") with T > 1, ("pp", "shard", "tp") with P > 1."""
        return self.parallel.mesh

    def part(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        """This rank's rows of one microbatch, and their share of its rows (scale the loss by it).

        Args:
            x: the whole microbatch's inputs (rows first).
            y: its targets, row for row.

        Returns:
            (x rows, y rows, share): this rank's rows (the tp ranks of a shard position take the
            same ones) and their fraction of the microbatch's rows.
        """
        return microbatch_part(x, y, self.parallel.shard_index, self.parallel.args.shard)

    def join(self, acc: Accumulator, optimizer: torch.optim.Optimizer, **kw) -> Replica | ReplicaFollower:
        """The replica handle for this rank: `Replica` on the leader, `ReplicaFollower` elsewhere.

        Args:
            acc: this rank's accumulator (`ShardedAccumulator`, or an exact one) over its part of the model.
            optimizer: the optimizer over `acc.params`; stepped only when a step commits.
            **kw: `Replica`'s keyword arguments (`lr_schedule`, `grad_clip`, `hooks`, ...);
                `collective_timeout` defaults to this context's. A follower uses `backend`,
                `collective_timeout`, `grad_clip`, `lr_schedule` and `hooks` of them.

        Returns:
            The handle the loop drives (`done`, `quota()`, `fold()`, `commit()`, `close()`), the same
            API on every rank.

        Raises:
            RunEnded: the run ended for this replica before it began (the leader's `Replica`).
        """
        kw.setdefault("collective_timeout", self.collective_timeout)
        if self.leader:
            from recover.core.worker.replica import Replica
            handle = Replica(acc, optimizer, replica=self.replica, control_addr=env_addr(env_names.CONTROL_ADDR),
                             store_addr=env_addr(env_names.STORE_ADDR), link=self.link, **kw)
        else:
            from recover.core.parallel.follower import ReplicaFollower
            handle = ReplicaFollower(acc, optimizer, replica=self.replica, local_rank=self.local_rank,
                                     link=self.link, open_store=connect_store, backend=kw.get("backend", "gloo"),
                                     collective_timeout=kw["collective_timeout"], grad_clip=kw.get("grad_clip", 0.0),
                                     lr_schedule=kw.get("lr_schedule"), hooks=kw.get("hooks"))
        clipper = acc.grad_norm_clipper
        if clipper is not None:  # tensor parallelism: see the contract
            handle.stepper.clip_grad_norm = clipper
        return handle
