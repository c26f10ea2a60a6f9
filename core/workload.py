"""One replica's training state: model, optimizer, local gradient accumulator, ledger.

Contract:
- `fold(id)` runs forward and backward of microbatch `id` into the local gradient
  accumulator and appends `id` to the ledger; nothing else ever changes the
  accumulator except `apply` (which consumes it) and `discard` (which empties it).
- The accumulator is one flat fp32 tensor, and each parameter's `.grad` is a view
  into it, so `backward()` accumulates in place and `pack()` is a single copy.
  Its last slot holds the sum of the folded microbatches' losses, so one
  all-reduce carries both the gradient and the iteration's loss.
- `pack()` returns a *fresh* communication buffer: an abandoned reduction that is
  still running inside the backend can only ever write into that copy, never into
  the accumulator (layer 2's "a failed reduction never touches the accumulator").
- `apply(reduced, M)` divides the summed gradient by M (the iteration's fixed
  microbatch count, whatever failed), clips, steps AdamW, and empties the
  accumulator and ledger. It returns the iteration's mean microbatch loss.
"""
from __future__ import annotations

from typing import Callable

import torch

from .config import TrainConfig
from .data import MicrobatchSource, load_tokens, microbatch_seed
from .model import GPT

PhaseHook = Callable[[str, int], None]
"""hook(phase, k): called at 'forward' and 'backward' of the k-th microbatch folded this step."""


class Workload:
    """The model replica and its in-iteration state (accumulator + ledger)."""

    def __init__(self, cfg: TrainConfig, device: str = "cpu"):
        self.cfg = cfg
        self.device = torch.device(device)
        gcfg = cfg.gpt_config()
        tokens = load_tokens(cfg.data, cfg.corpus_bytes)
        if len(tokens) and int(tokens.max()) >= gcfg.vocab_size:
            raise ValueError(
                f"--vocab-size: data has token id {int(tokens.max())} but the vocabulary is {gcfg.vocab_size}"
            )
        self.source = MicrobatchSource(tokens, cfg.batch_size, gcfg.block_size, cfg.seed)
        # Identical seeding on every replica gives identical initial weights.
        torch.manual_seed(cfg.seed)
        self.model = GPT(gcfg).to(self.device)
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        n = sum(p.numel() for p in self.params)
        self.n_grad = n
        self.accumulator = torch.zeros(n + 1, dtype=torch.float32, device=self.device)
        offset = 0
        for p in self.params:
            p.grad = self.accumulator[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        self.optimizer = torch.optim.AdamW(
            self.params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95)
        )
        self.ledger: list[int] = []

    @property
    def tokens_per_microbatch(self) -> int:
        return self.source.tokens_per_microbatch

    def fold(self, mb_id: int, hook: PhaseHook | None = None) -> float:
        """Forward+backward of microbatch `mb_id` into the accumulator; returns its loss."""
        k = len(self.ledger)
        x, y = self.source.get(mb_id)
        x, y = x.to(self.device), y.to(self.device)
        # Per-microbatch randomness (dropout) is a function of (seed, id) only.
        torch.manual_seed(microbatch_seed(self.cfg.seed, mb_id))
        if hook:
            hook("forward", k)
        _, loss = self.model(x, y)
        if hook:
            hook("backward", k)
        loss.backward()
        value = float(loss.detach())
        self.accumulator[-1] += value
        self.ledger.append(mb_id)
        return value

    def pack(self) -> torch.Tensor:
        """A fresh communication buffer: [gradient sum ..., loss sum]."""
        return self.accumulator.clone()

    def apply(self, reduced: torch.Tensor, microbatches: int) -> float:
        """Step the optimizer with reduced/M; empty accumulator and ledger; return mean loss."""
        mean_loss = float(reduced[-1]) / microbatches
        self.accumulator.copy_(reduced)
        self.accumulator.div_(microbatches)
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        self.optimizer.step()
        self.discard()
        return mean_loss

    def discard(self) -> None:
        """Empty the accumulator and ledger (a new iteration starts)."""
        self.accumulator.zero_()
        self.ledger.clear()

    def state_checksum(self) -> float:
        """A cheap fingerprint of the weights, for tests comparing replicas."""
        with torch.no_grad():
            return float(sum(p.double().sum() for p in self.model.parameters()))
