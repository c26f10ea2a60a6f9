"""One process's place in the job's rank grid, and the groups it talks over.

Contract:
- A `ParallelContext` is built for one process from (its replica r, its local rank
  inside the replica, the layout, a store client, a backend). It creates no
  module-level state of its own; the one global it sets is the one FSDP2 and
  DTensor need: the process's *default* process group, which is its replica. That
  group is `init_process_group(backend, store=PrefixStore("replica<r>/", store),
  rank=local_rank, world_size=ranks_per_replica)`, so no key of one replica's
  rendezvous can meet another's (a replacement of replica r, its n-th, uses
  "replica<r>/i<n>/": `replica_prefix`), and `fully_shard`, DTensor and (later) tensor and
  pipeline parallelism run inside the replica unmodified: to them the replica is
  the whole world.
- The intra-replica group and the `mesh` over it live as long as the replica. With
  T = 1 the mesh is 1-D, ("shard",) of S ranks, exactly as HSDP built it; with
  T > 1 it is 2-D, ("shard", "tp") of S x T ranks (S may be 1): `tp_mesh` is what
  tensor parallelism splits over, `shard_mesh` what FSDP2 shards over.
  `shard_index` picks the rows of a microbatch (the T ranks of one shard position
  see the same rows), `tp_index` the slice of each split layer. With P > 1
  (pipeline parallelism) the mesh is 3-D, ("pp", "shard", "tp"), whatever S and T
  (a dimension may have size 1): `pp_mesh` is what the pipeline's stages talk
  over, `pp_index` this rank's stage; and `tie_group` joins the first and the last
  stage of this rank's (shard, tp) position (the pp group itself when P = 2), over
  which the tied token embedding and output head sum their gradients
  (core/parallel/pp.py). Any rank of a replica dying takes the replica out (the
  failure domain), so nothing here ever rebuilds them.
- The cross-replica groups are one per position in the replica: the ranks at local
  rank i of every live replica form group "pos<i>". They change with membership,
  so `cross_replica(...)` builds one for a generation, as a `core.worker.comm.Communicator`
  (deadline-bound, abortable) under "pos<i>/gen<g>/" of the store; the caller
  drops it (to a Graveyard) when the generation ends, exactly as a one-rank replica
  does with its communicator today.
- `close()` destroys the default group; a context is not reusable after it.

The rank grid. nanotron orders its grid (pp, dp, tp), data parallel in the middle.
Here the outermost dimension is the replica, because replicas are what come and go;
inside a replica the ranks form a pp x shard x tp grid, tp innermost and pp
outermost as in nanotron: local rank = (pp_index * S + shard_index) * T + tp_index,
so the T ranks splitting one layer are neighbours, and a stage's S x T ranks are
contiguous. The job-wide rank of (r, i) is
r * ranks_per_replica + i: the ranks of one replica are contiguous, the launcher can
start and end them together, and the ranks at position i of all replicas are the
ones a cross-replica group joins.
"""
from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from recover.core.worker.comm import AbortCheck, Communicator, OpenStore
from recover.core.parallel.args import ParallelismArgs


def replica_prefix(replica: int, incarnation: int = 0) -> str:
    """The store prefix of one process set of replica r: "replica<r>/" for the first, "replica<r>/i<n>/"
    for its n-th replacement, whose rendezvous must not read the keys of the set it replaces."""
    return f"replica{replica}/" if incarnation == 0 else f"replica{replica}/i{incarnation}/"


class ParallelContext:
    """The groups of one rank: its replica (default group + mesh), and per-generation cross-replica ones."""

    def __init__(self, store: dist.Store, replica: int, local_rank: int, args: ParallelismArgs,
                 backend: str = "gloo", device_type: str = "cpu", timeout: float = 60.0, incarnation: int = 0):
        args.validate()
        if not 0 <= local_rank < args.ranks_per_replica:
            raise ValueError(f"local rank {local_rank} is outside a replica of {args.ranks_per_replica} ranks")
        if replica < 0:
            raise ValueError(f"replica id must be >= 0, got {replica}")
        if dist.is_initialized():
            # The default group is the replica; a second context in one process would
            # silently share (or clobber) it.
            raise RuntimeError("this process already has a default process group: one ParallelContext per process")
        self.args = args
        self.replica = replica
        self.local_rank = local_rank
        self.backend = backend
        self.timeout = timedelta(seconds=timeout)  # every group's: new_group does not inherit it
        dist.init_process_group(backend, store=dist.PrefixStore(replica_prefix(replica, incarnation), store),
                                rank=local_rank, world_size=args.ranks_per_replica, timeout=self.timeout)
        self.group = dist.group.WORLD
        self.tie_group = None
        if args.pp > 1:  # row-major: local rank = (pp_index * S + shard_index) * T + tp_index
            self.mesh: DeviceMesh = init_device_mesh(device_type, (args.pp, args.shard, args.tp),
                                                     mesh_dim_names=("pp", "shard", "tp"))
            self.tie_group = self.mesh["pp"].get_group() if args.pp == 2 else self._tie_groups(args)
        elif args.tp == 1:  # HSDP's mesh, unchanged
            self.mesh = init_device_mesh(device_type, (args.shard,), mesh_dim_names=("shard",))
        else:  # row-major: local rank = shard_index * T + tp_index
            self.mesh = init_device_mesh(device_type, (args.shard, args.tp), mesh_dim_names=("shard", "tp"))

    def _tie_groups(self, args: ParallelismArgs):
        """The {first stage, last stage} group of this rank's (shard, tp) position (P > 2). Every rank
        of the replica takes part in building every such group (torch's new_group is collective)."""
        per_stage = args.shard * args.tp
        mine = None
        for pos in range(per_stage):
            ranks = [pos, (args.pp - 1) * per_stage + pos]
            group = dist.new_group(ranks=ranks, backend=self.backend, timeout=self.timeout)
            if self.local_rank in ranks:
                mine = group
        return mine

    @property
    def shard_index(self) -> int:
        """This rank's shard position (which rows of a microbatch it takes): (local rank // T) % S."""
        return (self.local_rank // self.args.tp) % self.args.shard

    @property
    def pp_index(self) -> int:
        """This rank's pipeline stage: local rank // (S x T)."""
        return self.local_rank // (self.args.shard * self.args.tp)

    @property
    def pp_mesh(self) -> DeviceMesh | None:
        """The 1-D mesh of this rank's (shard, tp) position over the stages (None when P = 1)."""
        return None if self.args.pp == 1 else self.mesh["pp"]

    @property
    def tp_index(self) -> int:
        """This rank's slice of every tensor-parallel layer: local rank % T."""
        return self.local_rank % self.args.tp

    @property
    def shard_mesh(self) -> DeviceMesh:
        """The 1-D mesh FSDP2 shards over: the ranks of this rank's tp index."""
        return self.mesh if self.mesh.ndim == 1 else self.mesh["shard"]

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        """The 1-D mesh tensor parallelism splits over (None when T = 1)."""
        return None if self.args.tp == 1 else self.mesh["tp"]  # (a size-1 "tp" of a pp grid: None too)

    @property
    def global_rank(self) -> int:
        """This rank's place in the job: replica-major (see the module docstring)."""
        return self.replica * self.args.ranks_per_replica + self.local_rank

    @property
    def position(self) -> str:
        """The name of this rank's cross-replica group (and its store namespace)."""
        return f"pos{self.local_rank}"

    def cross_replica(self, open_store: OpenStore, generation: int, rank_among_members: int, n_members: int,
                      timeout: float = 30.0, should_abort: AbortCheck | None = None) -> Communicator:
        """The communicator of this position's ranks across the live replicas of `generation`.

        `rank_among_members` is this replica's index among the generation's members
        (the same for every rank of the replica), `n_members` their number. Built
        under "pos<i>/gen<g>/", so positions and generations never share a key.
        """
        return Communicator.build(open_store, generation, rank_among_members, n_members, self.backend, timeout,
                                  should_abort, namespace=f"{self.position}/")

    def close(self) -> None:
        """Destroy the replica's group (the process's default group)."""
        if dist.is_initialized():
            dist.destroy_process_group()
