"""The local gradient accumulator and ledger of one replica (layer 2's state).

Contract:
- The accumulator is one flat fp32 tensor; each parameter's `.grad` is a view into
  it, so `backward()` accumulates in place (no copy per microbatch) and packing
  for communication is one copy. Its last slot holds the sum of the folded
  microbatches' losses, so one all-reduce carries gradient and loss together.
- The ledger lists, in order, the microbatch ids whose gradients are in the
  accumulator; `fold` is the only way in, `load_mean`/`clear` the only ways out.
  A set beside the list answers `has(id)` in O(1), so folding a quota of q ids
  costs O(q), not O(q^2) (a list scan per fold was a sizable part of a second
  per step at q = 4,096).
- `pack()` returns a fresh buffer: a reduction that fails, or is abandoned while
  the backend still runs it, can only write into that copy. The accumulator is
  never touched by communication, which is what lets a survivor keep its work
  across a failed all-reduce.
- `weights_digest()` names the parameters' values (equal digests, equal weights);
  `weights_fingerprint()` is its cheap on-device form, blind to weights swapped
  but never to a flipped bit;
  `flip_bit(bit)` corrupts one bit of the largest weight in place, as a silent data
  corruption would (the bitflip fault kind's action, reached through the hooks).
- Every accumulator keeps core/worker/accumulator_interface.py's `Accumulator`: this
  module's `GradAccumulator`, `core.worker.exact.ExactAccumulator` (one of them),
  `core.parallel.fsdp.ShardedAccumulator` and its exact form `ExactShardedAccumulator`,
  so nothing asks an accumulator which kind it is. What they share (the flat buffer's
  loss slot, the ledger, packing, loading without a collective, clearing, and the
  answers of an fp32 accumulator: no wide sums, no out-of-range ids, torch's clipping)
  is written once, in `FlatLedgerBuffer`.
- Nothing here talks to other processes.
"""
from __future__ import annotations

import hashlib
from typing import Callable, Iterable

import numpy as np
import torch


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A flat view of `t`'s storage as signed integers of its width (int16 for bf16/fp16, int32 for fp32)."""
    return t.reshape(-1).view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def weights_digest(tensors: Iterable[torch.Tensor]) -> str:
    """sha256 of the tensors' values, in order, on the host (the plain version)."""
    h = hashlib.sha256()
    with torch.no_grad():
        for t in tensors:
            h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def weights_bit_sums(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """Per tensor, the sum of its raw bits read as signed integers, exactly, in int64 (on the host).

    What `weights_fingerprint` hashes, as a vector of one int64 per tensor (an empty
    tensor sums to 0). Integer sums are exact and order-free, and the sum of several
    tensors' sums (wrapping mod 2^64) is the sum over all their elements: so a
    replica of many ranks adds its ranks' vectors (core/parallel/replica_link.py) and
    gets the sums of the whole parameters, whatever their split.
    """
    ts = [t.detach() for t in tensors]
    if not ts:
        return torch.zeros(0, dtype=torch.int64)
    if all(t.device.type == "cpu" for t in ts):
        # NumPy's widening sum: the same exact integers as torch's `sum(dtype=torch.int64)` (both
        # wrap mod 2^64), measured here 7x faster on one thread (a 172 MB fp32 tensor: 0.022 s
        # against 0.16 s), and one tensor built at the end rather than one per sum. Why it
        # matters: every vote reads every weight, and a healing newcomer's check reads its whole
        # shard while the rest of the state still travels.
        return torch.tensor([int(np.add.reduce(_bits(t).numpy(), dtype=np.int64)) for t in ts], dtype=torch.int64)
    with torch.no_grad():  # on a device torch's own sum reads the weights where they live
        return torch.stack([_bits(t).sum(dtype=torch.int64) for t in ts]).cpu()


def fingerprint_of(sums: torch.Tensor) -> str:
    """sha256 of an int64 vector of bit sums (`weights_bit_sums`, or a replica's sum of its ranks')."""
    return hashlib.sha256(sums.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()


def weights_fingerprint(tensors: Iterable[torch.Tensor]) -> str:
    """A digest of the tensors computed where they live: `fingerprint_of(weights_bit_sums(tensors))`.

    Per tensor, the sum of its raw bits read as integers (int16/int32 for 16/32-bit
    floats), accumulated exactly in int64; then sha256 over those few sums. Integer
    sums are exact and order-free, so equal weights give equal fingerprints on any
    device and thread count, and one flipped bit b of any weight moves its tensor's
    sum by 2^b: always seen. `weights_digest` (the plain version: sha256 of every
    byte, done on the host) also sees any two weights swapped, but copies the whole
    model off the device each time; this reads each weight once on its device and
    moves a few bytes per tensor. Used on a replica's parameters (GradAccumulator)
    and on a rank's local shards (core/parallel's ShardedAccumulator).
    """
    return fingerprint_of(weights_bit_sums(tensors))


def flip_largest_bit(tensors: list[torch.Tensor], bit: int = 22) -> str:
    """Flip bit `bit` of the largest-magnitude element among `tensors`, in place; say which.

    The default, bit 22 of an fp32 weight, is the top mantissa bit: the weight
    moves by up to half its value, never to inf or NaN, so nothing fails and the
    loss only drifts; a weight of the largest magnitude (a norm's gain, typically)
    is used by every token, so the drift is real. Only a digest of the weights sees it.
    Empty tensors (a rank's empty shard of a small parameter) are passed over."""
    with torch.no_grad():
        where, best = -1, -1.0
        for i, p in enumerate(tensors):
            m = float(p.detach().abs().max()) if p.numel() else -1.0
            if m > best:
                where, best = i, m
        if where < 0:
            raise ValueError("no weight to flip: every tensor is empty")
        p = tensors[where]
        width = p.element_size() * 8
        if not 0 <= bit < width - 1:  # the top bit of a signed int view has no positive mask
            raise ValueError(f"bit must be in [0, {width - 1}) for a {p.dtype} weight, got {bit}")
        k = int(p.detach().abs().reshape(-1).argmax())
        before = float(p.detach().reshape(-1)[k])
        _bits(p.data.view(-1))[k : k + 1].bitwise_xor_(1 << bit)  # view(-1): in place, never a copy
        after = float(p.detach().reshape(-1)[k])
    return f"bit {bit} of element {k} of parameter {where} (shape {tuple(p.shape)}): {before:g} -> {after:g}"


class Ledger(list):
    """The microbatch ids folded in this iteration, in order (a list, for every reader),
    with O(1) membership: `in` reads a set kept beside it. `append` refuses an id already
    there (ValueError, nothing changed), so no id is ever counted twice; `clear` empties
    both. Shared by GradAccumulator and core/parallel's ShardedAccumulator."""

    def __init__(self) -> None:
        super().__init__()
        self._ids: set[int] = set()

    def __contains__(self, mb_id: object) -> bool:
        return mb_id in self._ids

    def append(self, mb_id: int) -> None:
        if mb_id in self._ids:
            raise ValueError(f"microbatch {mb_id} folded twice in one iteration")
        super().append(mb_id)
        self._ids.add(mb_id)

    def clear(self) -> None:
        super().clear()
        self._ids.clear()


def _no_wide_sums(acc: object, wide: torch.Tensor | None) -> None:
    """Refuse reduced wide sums given to an accumulator that has none (a caller's bug, said loudly)."""
    if wide is not None:
        raise ValueError(f"{type(acc).__name__} has no wide sums: wide_needed() is always False")


class FlatLedgerBuffer:
    """What every accumulator here shares: a flat fp32 `buffer` whose last slot is the (part of
    the) folded loss sum, beside the `ledger` of folded ids. Subclasses build both, and fold
    and load their own way (a replica's whole gradient, or one rank's shard of it)."""

    buffer: torch.Tensor
    ledger: Ledger
    out_of_range: dict = {}  # never written here: every fp32 gradient is summed (read-only, shared)
    grad_norm_clipper: Callable | None = None  # torch's clip_grad_norm_ is right (a TP rank's sets its own)

    def has(self, mb_id: int) -> bool:
        """Whether `mb_id` is in the ledger (O(1))."""
        return mb_id in self.ledger

    @property
    def loss_sum(self) -> float:
        """The folded microbatches' loss sum (a rank of many: its part of it)."""
        return float(self.buffer[-1])

    def pack(self) -> torch.Tensor:
        """A fresh communication buffer: [gradient sum (or this rank's shard of it) ..., loss sum]."""
        return self.buffer.clone()

    def reduced_loss_sum(self, reduced: torch.Tensor) -> float:
        """The loss sum a reduced buffer (a `pack()` summed over replicas) holds (a rank of many:
        its part; the leader combines the parts)."""
        return float(reduced[-1])

    def wide_needed(self, reduced: torch.Tensor) -> bool:
        """Whether the step needs a second, wide reduction (only --exact's spikes do)."""
        return False

    def pack_wide(self) -> torch.Tensor:
        """Refused: an fp32 accumulator has no wide sums (`wide_needed` is always False)."""
        raise RuntimeError(f"{type(self).__name__} has no wide sums: wide_needed() is always False")

    def load_shard_mean(self, reduced: torch.Tensor, microbatches: int, wide: torch.Tensor | None = None) -> None:
        """Set the buffer (every .grad, or this rank's shard of it) to reduced/M, with no collective:
        for a rank that has the replica's loss already (a resilient replica's combine,
        core/parallel/replica_link.py), so its commit has one synchronisation of the replica's
        ranks fewer. `wide`: never given (no wide sums here)."""
        _no_wide_sums(self, wide)
        self.buffer.copy_(reduced)
        self.buffer.div_(microbatches)

    def clear(self) -> None:
        """Empty the accumulator and the ledger (the next iteration starts)."""
        self.buffer.zero_()
        self.ledger.clear()


class GradAccumulator(FlatLedgerBuffer):
    """Flat gradient accumulator (+ loss sum) with a ledger of folded microbatch ids."""

    def __init__(self, params: Iterable[torch.nn.Parameter]):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("no trainable parameters")
        device = self.params[0].device
        n = sum(p.numel() for p in self.params)
        self.buffer = torch.zeros(n + 1, dtype=torch.float32, device=device)
        offset = 0
        for p in self.params:
            if p.dtype != torch.float32:
                raise TypeError(f"parameters must be fp32 (got {p.dtype}); keep a fp32 master copy")
            p.grad = self.buffer[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        self.ledger = Ledger()

    def fold(self, mb_id: int, loss: float) -> None:
        """Record that microbatch `mb_id`'s backward (loss `loss`) is now in the accumulator."""
        self.ledger.append(mb_id)  # raises, with nothing changed, on an id folded twice
        self.buffer[-1] += float(loss)

    def load_mean(self, reduced: torch.Tensor, microbatches: int, wide: torch.Tensor | None = None) -> float:
        """Set every .grad to reduced/M; return the iteration's mean microbatch loss. `wide`: never
        given (no wide sums here)."""
        _no_wide_sums(self, wide)
        self.buffer.copy_(reduced)
        self.buffer.div_(microbatches)
        return float(self.buffer[-1])

    def detached(self) -> list[int]:
        """Indices (in `params`) of the parameters whose .grad no longer views the buffer.

        `optimizer.zero_grad()` (set_to_none, torch's default) or a DDP wrapper (its
        own gradient buckets) replaces .grad; a backward after that accumulates into
        the new tensor, which no reduction ever sees.
        """
        out, offset = [], 0
        for i, p in enumerate(self.params):
            g = p.grad
            if p.numel() and (g is None or g.data_ptr() != self.buffer[offset:].data_ptr() or g.shape != p.shape):
                out.append(i)
            offset += p.numel()
        return out

    def weights_digest(self) -> str:
        """sha256 of the parameters' values, in order: equal digests, equal weights."""
        return weights_digest(self.params)

    def weights_fingerprint(self) -> str:
        """A digest of the weights computed where they live: what each vote carries
        (`weights_fingerprint(tensors)`, below)."""
        return weights_fingerprint(self.params)

    def weights_bit_sums(self) -> torch.Tensor:
        """The int64 bit sum of each parameter (`weights_bit_sums`): what the fingerprint hashes."""
        return weights_bit_sums(self.params)

    def flip_bit(self, bit: int = 22) -> str:
        """Flip bit `bit` of the model's largest-magnitude weight, in place; say which
        (`flip_largest_bit`: the bitflip fault kind's silent data corruption)."""
        return flip_largest_bit(self.params, bit)

    def reattach(self) -> None:
        """Re-point each .grad at the flat buffer (after code that replaced .grad)."""
        offset = 0
        for p in self.params:
            if p.grad is None or p.grad.data_ptr() != self.buffer[offset:].data_ptr():
                p.grad = self.buffer[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
