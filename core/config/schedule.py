"""The learning-rate schedule: linear warm-up, then cosine decay to a floor (nanoGPT's shape).

Contract:
- `WarmupCosine(max_lr, min_lr, warmup_steps, decay_steps)(step)` is a pure function
  of the *committed* step index (0-based): every trainer asks it for the learning
  rate of the step it is about to commit, so a redone step gets the same learning
  rate again and a resumed replica gets the one the others have.
- Steps 0..W-1 warm up linearly, lr = max_lr * (step + 1) / (W + 1) (never 0, so
  step 0 already trains); step W is max_lr; steps W..D follow a half cosine from
  max_lr down to min_lr; steps >= D stay at min_lr.
- `ScheduleDefaults` are a model size's values; `for_run(steps)` scales the
  warm-up to the run (a fraction of its steps, at least the size's minimum) and ends the decay at
  the run's last step, so short runs get the whole shape.
Importing this module imports no torch.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class WarmupCosine:
    """lr(step): linear warm-up over `warmup_steps`, cosine decay to `min_lr` at `decay_steps`."""

    max_lr: float = field(metadata={"help": "peak learning rate, reached at step warmup_steps"})
    min_lr: float = field(metadata={"help": "floor the cosine decays to"})
    warmup_steps: int = field(metadata={"help": "steps of linear warm-up (0 = start at max_lr)"})
    decay_steps: int = field(metadata={"help": "step at which the decay reaches min_lr"})

    def __call__(self, step: int) -> float:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        w = self.warmup_steps
        if step < w:
            return self.max_lr * (step + 1) / (w + 1)
        # A decay that ends before the warm-up does would divide by zero: it ends one step after.
        end = max(self.decay_steps, w + 1)
        if step >= end:
            return self.min_lr
        ratio = (step - w) / (end - w)
        return self.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (self.max_lr - self.min_lr)

    def state_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ScheduleDefaults:
    """A model size's learning-rate schedule, independent of the run's length."""

    max_lr: float = field(metadata={"help": "peak learning rate"})
    min_lr: float = field(metadata={"help": "floor of the cosine decay"})
    warmup_fraction: float = field(metadata={"help": "warm-up length as a fraction of the run's steps"})
    min_warmup_steps: int = field(default=1, metadata={
        "help": "warm-up steps however short the run (step 0's lr is max_lr / (this + 1))"})

    def warmup_for(self, steps: int) -> int:
        """Warm-up steps for a run of `steps`: the fraction, rounded, at least `min_warmup_steps` (0 for 1 step)."""
        if steps < 2:
            return 0
        return max(self.min_warmup_steps, round(self.warmup_fraction * steps))
