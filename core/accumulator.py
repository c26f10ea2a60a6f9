"""The local gradient accumulator and ledger of one replica (layer 2's state).

Contract:
- The accumulator is one flat fp32 tensor; each parameter's `.grad` is a view into
  it, so `backward()` accumulates in place (no copy per microbatch) and packing
  for communication is one copy. Its last slot holds the sum of the folded
  microbatches' losses, so one all-reduce carries gradient and loss together.
- The ledger lists, in order, the microbatch ids whose gradients are in the
  accumulator; `fold` is the only way in, `load_mean`/`clear` the only ways out.
- `pack()` returns a fresh buffer: a reduction that fails, or is abandoned while
  the backend still runs it, can only write into that copy. The accumulator is
  never touched by communication, which is what lets a survivor keep its work
  across a failed all-reduce.
- Nothing here talks to other processes.
"""
from __future__ import annotations

import hashlib
from typing import Iterable

import torch


class GradAccumulator:
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
        self.ledger: list[int] = []

    def fold(self, mb_id: int, loss: float) -> None:
        """Record that microbatch `mb_id`'s backward (loss `loss`) is now in the accumulator."""
        if mb_id in self.ledger:
            raise ValueError(f"microbatch {mb_id} folded twice in one iteration")
        self.buffer[-1] += float(loss)
        self.ledger.append(mb_id)

    @property
    def loss_sum(self) -> float:
        return float(self.buffer[-1])

    def pack(self) -> torch.Tensor:
        """A fresh communication buffer: [gradient sum ..., loss sum]."""
        return self.buffer.clone()

    def load_mean(self, reduced: torch.Tensor, microbatches: int) -> float:
        """Set every .grad to reduced/M; return the iteration's mean microbatch loss."""
        self.buffer.copy_(reduced)
        self.buffer.div_(microbatches)
        return float(self.buffer[-1])

    def clear(self) -> None:
        """Empty the accumulator and the ledger (the next iteration starts)."""
        self.buffer.zero_()
        self.ledger.clear()

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
        h = hashlib.sha256()
        with torch.no_grad():
            for p in self.params:
                h.update(p.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
        return h.hexdigest()

    def reattach(self) -> None:
        """Re-point each .grad at the flat buffer (after code that replaced .grad)."""
        offset = 0
        for p in self.params:
            if p.grad is None or p.grad.data_ptr() != self.buffer[offset:].data_ptr():
                p.grad = self.buffer[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
