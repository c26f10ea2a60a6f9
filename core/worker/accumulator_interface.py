"""The accumulator interface: what a replica's handles (core/worker/replica.py `Replica`,
core/parallel/follower.py `ReplicaFollower`) and the training loops hold a gradient
accumulator by, so that none of them ever asks an accumulator which kind it is.

Contract:
- Every accumulator keeps `Accumulator` whole: core/worker/accumulator.py's
  `GradAccumulator`, core/worker/exact.py's `ExactAccumulator`, core/parallel/fsdp.py's
  `ShardedAccumulator` and `ExactShardedAccumulator`. Where they differ, the
  difference is a declared answer of the interface (`wide_needed`,
  `grad_norm_clipper`, `out_of_range`), never a method one kind has and another
  lacks: a caller that probed (`hasattr`) would silently take another branch on a
  new kind, and the ranks of one replica must all take the same one (a rank on the
  other branch hangs its replica's collectives).
- The capabilities, as declared:
  - wide sums: `wide_needed(reduced)` says whether the step needs its second, wide
    all-reduce of `pack_wide()`; always False for an fp32 accumulator (which has no
    wide sums: its `pack_wide` refuses), read alike by every replica of an exact one.
  - the loss collective: `load_mean` returns the replica's mean loss, which at a
    replica of many ranks sums the ranks' loss parts over the replica's group (one
    collective); `load_shard_mean` sets the same gradients with no collective at all,
    for a rank whose replica has its loss already. Every accumulator has both.
  - clipping: `grad_norm_clipper` is None where torch's `clip_grad_norm_` over
    `params` is right, else the clipper the committed step must use instead
    (tensor parallelism: a replica-wide norm over a mix of meshes).
  - a range: `out_of_range` maps each folded id whose gradient was not summed to why
    (--exact's fixed-point range); always empty for an fp32 accumulator.
- Nothing here runs; this module only states the interface (it imports torch for the
  tensor type alone).
"""
from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

import torch


@runtime_checkable
class Accumulator(Protocol):
    """A replica's (or one rank's) gradient accumulator and its ledger (see the module's contract)."""

    params: list  # the trainable parameters, in order; each `.grad` views `buffer`
    buffer: torch.Tensor  # the flat fp32 buffer the backward writes into; its last slot is the loss (part)
    ledger: list  # the ids folded this iteration, in order (core/worker/accumulator.py `Ledger`)
    out_of_range: dict  # id -> why its gradient was not summed (--exact's fixed-point range); else empty
    grad_norm_clipper: Callable | None  # None: torch's clip_grad_norm_ is right; else the one to use

    def has(self, mb_id: int) -> bool:
        """Whether `mb_id` is in the ledger (O(1))."""
        ...

    def fold(self, mb_id: int, loss: float) -> None:
        """Record that `mb_id`'s backward (loss, or this rank's part of it) is in the accumulator;
        an id folded twice raises with nothing changed."""
        ...

    def pack(self) -> torch.Tensor:
        """A fresh buffer for the cross-replica all-reduce: a failed reduction never touches the accumulator."""
        ...

    def wide_needed(self, reduced: torch.Tensor) -> bool:
        """Whether a reduced `pack()` says the step needs the wide sums all-reduced too (the same on every replica)."""
        ...

    def pack_wide(self) -> torch.Tensor:
        """A fresh buffer of the wide sums; called only where `wide_needed` said so."""
        ...

    def reduced_loss_sum(self, reduced: torch.Tensor) -> float:
        """The loss sum (a rank of many: its part) a reduced `pack()` holds; NaN when it cannot commit."""
        ...

    def load_mean(self, reduced: torch.Tensor, microbatches: int, wide: torch.Tensor | None = None) -> float:
        """Set every .grad to the step's mean over `microbatches`; return the mean loss (a rank of
        many: over the replica, one collective of its group). `wide`: the reduced `pack_wide()`."""
        ...

    def load_shard_mean(self, reduced: torch.Tensor, microbatches: int, wide: torch.Tensor | None = None) -> None:
        """`load_mean`'s gradients, with no collective: for a rank whose replica has its loss already."""
        ...

    def clear(self) -> None:
        """Empty the accumulator and the ledger (the next iteration starts); `.grad` stays attached."""
        ...

    def detached(self) -> list[int]:
        """Indices (in `params`) of the parameters whose .grad no longer views the buffer."""
        ...

    def reattach(self) -> None:
        """Point each .grad at its view of the buffer again."""
        ...

    def weights_digest(self) -> str:
        """sha256 of the weights (a rank of many: its local shards): equal digests, equal weights."""
        ...

    def weights_fingerprint(self) -> str:
        """The cheap on-device digest of the same weights, blind to swapped weights, never to a flipped bit."""
        ...

    def weights_bit_sums(self) -> torch.Tensor:
        """The int64 bit sum of each weight (what the fingerprint hashes; a replica's ranks add theirs)."""
        ...

    def flip_bit(self, bit: int = 22) -> str:
        """Flip one bit of the largest-magnitude weight in place (silent data corruption); say which."""
        ...
