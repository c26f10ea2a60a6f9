"""FSDP2 inside a replica: the sharded model, and the sharded gradient accumulator + ledger.

Contract (the sharded form of core/worker/accumulator.py's, same interface):
- `shard_model(model, mesh)` wraps each layer, then the root, with `fully_shard`
  over the replica's 1-D mesh, and sets every FSDP module to reduce-scatter
  gradients as a plain SUM. FSDP2 averages over its group by default; here the
  replica's S ranks each take a part of one microbatch's rows and scale their loss
  by their share of its rows (`microbatch_part`), so the parts' gradients *sum* to
  the microbatch's gradient, exactly, even when S does not divide the batch.
- `ShardedAccumulator(model)` is one flat fp32 tensor holding this rank's shard of
  the replica's gradient sum, then one slot for this rank's part of the loss sum.
  Each parameter's `.grad` is a DTensor whose local tensor is a view into it, and
  FSDP2 adds each backward's reduce-scattered shard into an existing `.grad` in
  place, so a microbatch is folded with no copy, as in `GradAccumulator`.
- `fold(id, part_loss)` records `id` in the ledger (all ranks of a replica fold
  the same ids: the replica's ledger); `pack()` returns a fresh
  [local shard ..., loss part] buffer for the cross-replica all-reduce of this
  rank's position, which therefore never touches the accumulator; `load_mean(reduced,
  M)` sets every local shard to reduced/M (M global) and returns the iteration's
  mean microbatch loss, summing the loss parts of the replica's ranks over the
  replica's group (the one collective here; it runs once per step, after the
  cross-replica reduction succeeded); `load_shard_mean(reduced, M)` is the same
  without that collective (a resilient replica has its loss from the vote's
  combine already); `clear()` empties both. `absorb_detached()`
  adds a `.grad` that code replaced (torch's pipeline stage setup sets FSDP
  modules' to None: core/parallel/pp.py) into its view and points `.grad` back.
- `weights_digest()`/`weights_fingerprint()` name this rank's local shards: equal
  for the ranks at one position of all replicas, not across positions.
  `weights_bit_sums()` is the int64 vector the fingerprint hashes; a replica's
  ranks add theirs (core/parallel/replica_link.py) so that its vote's fingerprint
  covers every rank's shard. `flip_bit(bit)` corrupts one bit of this rank's
  largest local weight (the bitflip fault kind, at any rank).
- Tensor parallelism (core/parallel/tp.py; `mesh`, the replica's ("shard", "tp")
  grid, given): a parameter may be a DTensor on the 2-D grid (split by TP, and by
  FSDP2 when S > 1), a DTensor on the shard mesh only (FSDP2 over S, whole on each
  tp rank), or, with S = 1, a plain tensor (whole on each tp rank); `.grad` views
  its local tensor the same way in every case. The T ranks of one shard position
  fold the same rows and compute the same loss, so only tp index 0 adds its loss
  part to the slot (the others add 0): the replica's loss sum (`ReplicaLink.combine`,
  `load_mean`) counts each microbatch once, exactly, with no division. Likewise
  `clip_grad_norm_` (what the committed step clips with under TP: torch's own
  refuses a mix of meshes and plain tensors) counts each parameter's local part on
  one rank of the grid dimensions it is whole along, and sums over the replica.
- Pipeline parallelism (core/parallel/pp.py; `mesh`, the replica's ("pp", "shard",
  "tp") grid, given): this rank holds its stage's parameters only, so "pp" always
  counts as split (stages hold different parameters: each counts its own, a
  DTensor of the "tp" sub-mesh too), and
  only the last stage adds loss parts (it alone computes them). `duplicates`
  are parameters counted on another rank (the last stage's copy of the tied
  embedding), never here.
- `--exact` (`ExactShardedAccumulator`; `ExactPipelineAccumulator` with --pp, which
  takes each id's stage gradient from the pipeline right after that id's own schedule
  run, and whose `fold` only records the id): int64 fixed-point sums of this rank's
  shard of each microbatch's gradient, the same bits in every replica of the layout.
- Dropout: every part of microbatch `id` reseeds from (seed, id) as a one-rank
  replica does, but draws masks only for its own rows, so with dropout > 0 an
  HSDP run matches a one-rank replica in distribution, not bit for bit.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from recover.core.worker.exact import DEFAULT_RANGE, ExactSums
from recover.core.worker.accumulator import (FlatLedgerBuffer, Ledger, flip_largest_bit, weights_bit_sums,
                                             weights_digest, weights_fingerprint)


def shard_model(model: nn.Module, mesh: DeviceMesh, layers: Iterable[nn.Module] | None = None) -> nn.Module:
    """`fully_shard` each of `layers` (default: `model.blocks`), then `model`; SUM reductions. Returns model.

    Args:
        model: the fp32 model every rank of the replica built alike; sharded in place.
        mesh: the mesh FSDP2 shards over (`ReplicaContext.mesh`, the replica's ranks).
        layers: the submodules to shard one by one before the root; None: `model.blocks`, else none.

    Returns:
        `model`, now an FSDP module whose gradients reduce-scatter as a plain SUM.
    """
    if layers is None:
        layers = getattr(model, "blocks", ())
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            # A divide factor of 1 with sum-only comms: FSDP2 then issues a SUM
            # reduce-scatter and divides by nothing (gloo has no PREMUL_SUM, so the
            # factor alone would not do).
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    return model


def microbatch_part(x: torch.Tensor, y: torch.Tensor, local_rank: int, parts: int
                    ) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Part `local_rank`'s rows of one microbatch, and their share of its rows (the loss scale).

    `local_rank` is the rank's shard index and `parts` is S: with tensor parallelism
    the T ranks of one shard position take the same part (ParallelContext.shard_index).
    Rows are split as `tensor_split` does (the first B % S parts get one row more);
    the mean loss over a part times its share, summed over the parts, is the mean
    over the microbatch (every row has the same number of tokens).
    """
    rows = x.shape[0]
    if rows < parts:
        raise ValueError(f"a microbatch of {rows} rows cannot be split over {parts} ranks")
    xs, ys = torch.tensor_split(x, parts), torch.tensor_split(y, parts)
    return xs[local_rank], ys[local_rank], xs[local_rank].shape[0] / rows


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local part, a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _views_buffer(grad, view: torch.Tensor, dtensor: bool) -> bool:
    if grad is None or isinstance(grad, DTensor) != dtensor:
        return False
    return _local(grad).data_ptr() == view.data_ptr()


def _counted_here(p: torch.Tensor, grid: DeviceMesh) -> bool:
    """Whether this rank counts `p`'s local part in a sum over the replica: on each grid dimension
    along which `p` is whole (not on its mesh, or Replicate there), only the rank at index 0 does.
    "pp" is always split: each stage holds parameters of its own."""
    split: set[str] = {"pp"}
    if isinstance(p, DTensor):
        names = p.device_mesh.mesh_dim_names or ()
        split |= {n for n, pl in zip(names, p.placements) if not pl.is_replicate()}
    return all(grid.get_local_rank(n) == 0 for n in grid.mesh_dim_names if n not in split)


class ShardedAccumulator(FlatLedgerBuffer):
    """This rank's shard of the replica's gradient sum (+ its loss part) with the replica's ledger
    (a `core.worker.accumulator_interface.Accumulator`; with --exact: `ExactShardedAccumulator`, below)."""

    def __init__(self, model: nn.Module, group=None, mesh: DeviceMesh | None = None,
                 duplicates: Iterable[torch.Tensor] = ()):
        """Point every trainable parameter's `.grad` at its view of one flat fp32 buffer.

        Args:
            model: this rank's part of the model, fp32: sharded by `shard_model` (every parameter a
                DTensor), or split by TP or PP on `mesh`.
            group: the replica's process group, for the loss sum and the norm; None: the default
                group (the replica, under `recover launch`).
            mesh: the replica's grid (`ReplicaContext.mesh`), needed with TP or PP (it says which
                rank counts a loss or a parameter's norm); None: FSDP2 alone.
            duplicates: parameters another rank counts (the last stage's copy of a tied
                embedding); default: none.

        Raises:
            ValueError: the model has no trainable parameter.
            TypeError: a parameter is not fp32, or (FSDP2 alone) not a DTensor.
        """
        self.group = group  # the replica's group, for the loss; None: the default group (the replica)
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("no trainable parameters")
        names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
        tp = "tp" in names  # a grid beyond ("shard",): TP and/or PP (plain tensors allowed, our own norm)
        if not tp and not all(isinstance(p, DTensor) for p in self.params):
            raise TypeError("every parameter must be a DTensor: wrap the model with shard_model() first")
        for p in self.params:
            if p.dtype != torch.float32:
                raise TypeError(f"parameters must be fp32 (got {p.dtype}); keep a fp32 master copy")
        # which rank adds the loss, and each parameter's part of the norm (see the contract)
        self.counts_loss = not tp or mesh.get_local_rank("tp") == 0
        if "pp" in names:  # only the last stage computes losses
            self.counts_loss = self.counts_loss and mesh.get_local_rank("pp") == mesh.size(names.index("pp")) - 1
        dup = {id(p) for p in duplicates}
        self._counted = [True] * len(self.params) if not tp else [_counted_here(p, mesh) for p in self.params]
        self._counted = [c and id(p) not in dup for c, p in zip(self._counted, self.params)]
        self.grad_norm_clipper = self.clip_grad_norm_ if tp else None  # None: torch's clip_grad_norm_ is right
        locals_ = [_local(p) for p in self.params]
        self.buffer = torch.zeros(sum(t.numel() for t in locals_) + 1, dtype=torch.float32,
                                  device=locals_[0].device)
        self._views: list[torch.Tensor] = []
        offset = 0
        for p, t in zip(self.params, locals_):
            view = self.buffer[offset: offset + t.numel()].view(t.shape)
            self._views.append(view)
            offset += t.numel()
        self.reattach()
        self.ledger = Ledger()  # the replica's ledger (every rank folds the same ids)

    def fold(self, mb_id: int, loss: float) -> None:
        """Record that microbatch `mb_id`'s backward is in the accumulator; `loss` is this rank's part of its loss."""
        self.ledger.append(mb_id)  # raises, with nothing changed, on an id folded twice
        if self.counts_loss:
            self.buffer[-1] += float(loss)

    def load_mean(self, reduced: torch.Tensor, microbatches: int, wide: torch.Tensor | None = None) -> float:
        """Set every local .grad shard to reduced/M; return the iteration's mean microbatch loss.
        `wide`: never given (no wide sums here). Without the loss's collective: `load_shard_mean`."""
        self.load_shard_mean(reduced, microbatches, wide)
        loss = self.buffer[-1:].clone()
        torch.distributed.all_reduce(loss, group=self.group)  # the parts of the replica's ranks
        return float(loss)

    @property
    def counted(self) -> list[bool]:
        """Per parameter: whether this rank counts its local part in a sum over the replica (see the contract)."""
        return list(self._counted)

    def local_weights(self) -> list[torch.Tensor]:
        """This rank's local part of each parameter, in `params` order."""
        return [_local(p) for p in self.params]

    def clip_grad_norm_(self, params=None, max_norm: float = 1.0) -> torch.Tensor:
        """Scale every .grad so that the replica's whole gradient has norm <= max_norm, as torch's
        clip_grad_norm_ does (coefficient max_norm / (norm + 1e-6), at most 1); returns the norm.
        `params` must be this accumulator's (the signature is torch's); a collective of the replica.

        Args:
            params: this accumulator's `params` (or None, the same).
            max_norm: the norm the replica's whole gradient is clipped to.

        Returns:
            The replica's whole gradient norm before clipping (a 0-dim fp32 tensor).

        Raises:
            ValueError: `params` are not this accumulator's.
        """
        if params is not None and [id(p) for p in params] != [id(p) for p in self.params]:
            raise ValueError("clip_grad_norm_ of a ShardedAccumulator clips its own parameters")
        sq = torch.zeros(1, dtype=torch.float64, device=self.buffer.device)
        for view, counted in zip(self._views, self._counted):
            if counted and view.numel():
                sq += view.double().pow(2).sum()
        torch.distributed.all_reduce(sq, group=self.group)
        norm = sq.sqrt().to(torch.float32)
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in self.params:
            _local(p.grad).mul_(coef)
        return norm[0]

    def reattach(self) -> None:
        """Point each .grad at its view of the buffer (at start, or after code replaced .grad)."""
        for p, view in zip(self.params, self._views):
            if _views_buffer(p.grad, view, isinstance(p, DTensor)):
                continue
            if isinstance(p, DTensor):
                p.grad = DTensor.from_local(view, p.device_mesh, p.placements, run_check=False,
                                            shape=p.shape, stride=p.stride())
            else:
                p.grad = view

    def absorb_detached(self) -> None:
        """Add each .grad that no longer views the buffer into its view, then point .grad back at it.
        For code that set .grad to None and let a backward make a fresh one holding only what it
        added (torch's pipeline stage setup does so to FSDP modules: core/parallel/pp.py)."""
        for i in self.detached():
            p, view = self.params[i], self._views[i]
            if p.grad is not None:
                view.add_(_local(p.grad))
        self.reattach()

    def detached(self) -> list[int]:
        """Indices (in `params`) of the parameters whose local .grad no longer views the buffer."""
        out = []
        for i, (p, view) in enumerate(zip(self.params, self._views)):
            if not view.numel():
                continue
            if not _views_buffer(p.grad, view, isinstance(p, DTensor)):
                out.append(i)
        return out

    def weights_digest(self) -> str:
        """sha256 of this rank's local shards, in order: equal digests, equal shards."""
        return weights_digest(_local(p) for p in self.params)

    def weights_fingerprint(self) -> str:
        """The cheap on-device digest of this rank's local shards (accumulator.weights_fingerprint)."""
        return weights_fingerprint([_local(p) for p in self.params])

    def weights_bit_sums(self) -> torch.Tensor:
        """The int64 bit sum of each of this rank's local shards, in `params` order (an empty shard: 0)."""
        return weights_bit_sums([_local(p) for p in self.params])

    def flip_bit(self, bit: int = 22) -> str:
        """Flip bit `bit` of this rank's largest-magnitude local weight, in place; say which
        (`core.worker.accumulator.flip_largest_bit`: silent data corruption in this rank's shard)."""
        return flip_largest_bit([_local(p) for p in self.params], bit)


class ExactShardedAccumulator(ExactSums, ShardedAccumulator):
    """`--exact` at a replica of many ranks: this rank's shard of each microbatch's gradient (what
    FSDP2's SUM reduce-scatter, and TP's collectives, leave in its view of the buffer) is converted,
    alone, into int64 fixed-point sums, as core/worker/exact.py's ExactAccumulator converts a whole
    gradient; the cross-replica all-reduce of each position sums int64, exactly.

    Why that is exact: inside a replica nothing is ever rebuilt (its groups live as long as it
    does) and the kernels are deterministic, so the shard a rank at position i holds for microbatch
    `id` is the same bits in every replica of the layout; the committed sum is then a function of
    the set of ids alone. Not across layouts: the reduce-scatter sums the ranks' fp32 parts in
    floating point, so 3 x S2 and 1 x S1 commit different bits.

    The replica agrees (collectives of its group, `group`, every rank in the same order): each
    fold takes the largest band (full, wide, out of range) of the ranks' parts (one all-reduce of
    one int64 per microbatch), so every rank sums a microbatch in the same band, reads the same
    wide and bad counts after its position's all-reduce, and so takes the same path (a wide
    all-reduce, a non-finite loss naming the id, a refused commit) as its leader; `load_mean` sums
    the ranks' int64 loss parts over the group, exactly, before converting (only `counts_loss`
    ranks hold one); `load_shard_mean` is its gradients alone, for ranks whose combine carried
    the loss (every rank of a replica takes the same one of the two). A replica split by --pp
    takes `ExactPipelineAccumulator` (below): its schedule runs many microbatches into one `.grad`."""

    pipelined = False  # whether this accumulator takes a pipeline's gradients (ExactPipelineAccumulator)

    def __init__(self, model: nn.Module, microbatches: int, range_bits: int = DEFAULT_RANGE, group=None,
                 mesh: DeviceMesh | None = None, duplicates: Iterable[torch.Tensor] = ()):
        """A `ShardedAccumulator` whose sums are int64 fixed point.

        Args:
            model: as `ShardedAccumulator`'s.
            microbatches: M, the run's microbatches per step (the fixed point's headroom).
            range_bits: the normal range: gradient elements below 2^range_bits (--exact-range).
            group: as `ShardedAccumulator`'s (the replica agrees on bands over it).
            mesh: as `ShardedAccumulator`'s.
            duplicates: as `ShardedAccumulator`'s.

        Raises:
            ValueError: `mesh` has a "pp" dimension (take `ExactPipelineAccumulator`), or
                `range_bits` with M leaves no valid fixed-point shift; else as `ShardedAccumulator`'s.
            TypeError: as `ShardedAccumulator`'s.
        """
        if not self.pipelined and mesh is not None and "pp" in (mesh.mesh_dim_names or ()):
            raise ValueError("a replica split by --pp takes ExactPipelineAccumulator: a schedule of many "
                             "microbatches leaves their gradients summed in fp32")
        ShardedAccumulator.__init__(self, model, group=group, mesh=mesh, duplicates=duplicates)
        self._init_exact(microbatches, range_bits)

    def _agree(self, band: int) -> int:
        t = torch.tensor([band], dtype=torch.int64, device=self.buffer.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return int(t)

    def _loss_total(self, part: int) -> int:
        t = torch.tensor([part], dtype=torch.int64, device=self.buffer.device)
        torch.distributed.all_reduce(t, group=self.group)  # int64: exact, whatever the order
        return int(t)


class ExactPipelineAccumulator(ExactShardedAccumulator):
    """`--exact` at a replica split by --pp (stages, with or without --shard and --tp inside them).

    A schedule over many microbatches leaves in `.grad` their fp32 sum, whose bits depend on
    which ids this replica ran (and FSDP2 inside a pipeline reduce-scatters only after the
    schedule's last backward), so no per-id gradient is ever there to convert. So each id runs
    through a schedule of its own (core/parallel/pp.py, `Pipeline(take=...)`), and right after
    that run `take(id, loss)` converts what it left in `.grad` (this stage's shard of the id's
    gradient alone) into the int64 sums, as `fold` does elsewhere: the replica agrees on its
    band, the last stage's loss part goes into the loss slot, `.grad` is zeroed. `fold(id, loss)`,
    called by the loop once the pipeline has run all of its ids, then only records the id in
    the ledger; it refuses an id that was not taken. An id taken and never folded stays in the
    sums without a ledger entry: that happens only when the run raised, which ends the
    replica. `clear()` forgets the taken ids with the sums."""

    pipelined = True

    def __init__(self, model: nn.Module, microbatches: int, range_bits: int = DEFAULT_RANGE, group=None,
                 mesh: DeviceMesh | None = None, duplicates: Iterable[torch.Tensor] = ()):
        """An `ExactShardedAccumulator` for one stage of a pipeline.

        Args:
            model: this rank's stage of the model (fp32).
            microbatches: M, the run's microbatches per step.
            range_bits: the normal range: gradient elements below 2^range_bits (--exact-range).
            group: the replica's process group; None: the default group.
            mesh: the replica's ("pp", "shard", "tp") grid (`ReplicaContext.mesh`).
            duplicates: parameters another stage counts (a tied embedding's copy); default: none.
        """
        super().__init__(model, microbatches, range_bits, group=group, mesh=mesh, duplicates=duplicates)
        self._taken: set[int] = set()  # ids whose gradient is in the sums, waiting for their ledger entry

    def take(self, mb_id: int, loss: float) -> None:
        """Convert the gradient one schedule run of `mb_id` alone left in `.grad` into the sums.

        Args:
            mb_id: the global microbatch id the schedule just ran, alone.
            loss: the id's loss as this stage has it (only the last stage's goes into the loss sum).

        Raises:
            ValueError: `mb_id` was taken or folded already in this iteration.
        """
        if mb_id in self._taken or mb_id in self.ledger:
            raise ValueError(f"microbatch {mb_id} folded twice in one iteration")
        self._sum_microbatch(mb_id, loss)
        self._taken.add(mb_id)

    def fold(self, mb_id: int, loss: float) -> None:
        """Record `mb_id`, taken already, in the ledger (its gradient and loss are in the sums)."""
        if mb_id not in self._taken:
            raise ValueError(f"microbatch {mb_id} was not taken after a schedule run of its own: its gradient "
                             f"is not in the exact sums")
        self.ledger.append(mb_id)
        self._taken.discard(mb_id)

    def clear(self) -> None:
        super().clear()
        self._taken.clear()
