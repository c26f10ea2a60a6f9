"""The optimization recipe every system shares: AdamW groups, and the committed step.

Contract:
- `build_adamw(params, lr, weight_decay)` is AdamW with betas (0.9, 0.95) and two
  parameter groups, as nanoGPT: tensors of 2+ dimensions (matrices, embeddings;
  the tied output head is the token embedding) decay, vectors (layer-norm gains,
  biases) do not - decaying a gain towards 0 only fights the normalisation.
- `CommittedStep(optimizer, params, lr_schedule, grad_clip)` is the one place a
  committed gradient becomes an optimizer step, in this order: the learning rate
  of committed step s (a function of s, or a torch LRScheduler that has been
  stepped exactly s times), clipping of the global gradient norm (the gradient is
  already the mean over the iteration's M microbatches, so every replica clips
  the same tensor the same way), `optimizer.step()`, then the scheduler's own
  `step()`. The clipping is torch's `clip_grad_norm_` unless `clip_grad_norm` (same
  signature) is given: a replica split by tensor parallelism clips with its
  accumulator's (core/parallel/fsdp.py), which knows which ranks hold what.
  Nothing advances the schedule but a commit: a step that is redone never reaches
  it. `skip(s)` settles step s without an optimizer step (a loss that was not
  finite, --on-nonfinite skip): the schedule moves on all the same.
- `lr(s)` is the rate step s will use (what the workers report in metrics.jsonl);
  `state_dict()` is what a checkpoint keeps of the schedule.
"""
from __future__ import annotations

import warnings
from typing import Callable, Iterable, Union

import torch
from torch.optim.lr_scheduler import LRScheduler

BETAS = (0.9, 0.95)

LRSchedule = Union[Callable[[int], float], LRScheduler]
"""A function of the committed step giving its learning rate, or a torch LRScheduler."""


def build_adamw(params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW(betas 0.9, 0.95) with weight decay on 2+-dimensional tensors only."""
    params = [p for p in params if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=BETAS)


class CommittedStep:
    """Turns the committed (already averaged) gradient into an optimizer step."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: Iterable[torch.nn.Parameter],
                 lr_schedule: LRSchedule | None = None, grad_clip: float = 0.0,
                 clip_grad_norm: Callable[..., torch.Tensor] | None = None):
        self.optimizer = optimizer
        self.params = list(params)
        self.schedule = lr_schedule
        self.grad_clip = grad_clip
        self.clip_grad_norm = clip_grad_norm or torch.nn.utils.clip_grad_norm_
        self.committed = 0  # optimizer steps taken: the index of the next committed step

    def lr(self, step: int) -> float:
        """Set and return the learning rate committed step `step` uses (the first group's)."""
        if isinstance(self.schedule, LRScheduler):
            if self.schedule.last_epoch != step:
                raise RuntimeError(
                    f"the LR scheduler was stepped {self.schedule.last_epoch} times but the run is at committed "
                    f"step {step}: only commit() may step it"
                )
        elif self.schedule is not None:
            lr = float(self.schedule(step))
            for g in self.optimizer.param_groups:
                g["lr"] = lr
        return float(self.optimizer.param_groups[0]["lr"])

    def __call__(self, step: int) -> float:
        """Step the optimizer as committed step `step`; returns the learning rate it used."""
        lr = self.lr(step)
        if self.grad_clip > 0:
            self.clip_grad_norm(self.params, self.grad_clip)
        self.optimizer.step()
        if isinstance(self.schedule, LRScheduler):
            self.schedule.step()
        self.committed = step + 1
        return lr

    def skip(self, step: int) -> float:
        """Step `step` is skipped (its loss was not finite, --on-nonfinite skip): no optimizer step,
        but the schedule moves on as if it had run, so step+1 uses its own rate (core/contract/nonfinite.py
        says why). Returns the rate the skipped step would have used."""
        lr = self.lr(step)
        if isinstance(self.schedule, LRScheduler):
            with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": on purpose here
                warnings.simplefilter("ignore", UserWarning)
                self.schedule.step()
        self.committed = step + 1
        return lr

    def state_dict(self) -> dict:
        """The schedule's state: the next committed step, and the schedule itself."""
        sd: dict = {"committed": self.committed}
        if isinstance(self.schedule, LRScheduler):
            sd["scheduler"] = self.schedule.state_dict()
        elif hasattr(self.schedule, "state_dict"):
            sd["schedule"] = self.schedule.state_dict()
        return sd

    def load_state_dict(self, sd: dict) -> None:
        self.committed = int(sd["committed"])
        if isinstance(self.schedule, LRScheduler) and "scheduler" in sd:
            self.schedule.load_state_dict(sd["scheduler"])
        elif "schedule" in sd and hasattr(self.schedule, "state_dict") and sd["schedule"] != self.schedule.state_dict():
            raise ValueError(f"checkpoint's schedule {sd['schedule']} differs from this run's "
                             f"{self.schedule.state_dict()}")
