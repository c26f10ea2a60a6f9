"""The model's named shapes and their learning-rate schedules, without torch.

Contract:
- `GPTConfig` is the transformer's shape; `MODEL_CONFIGS` names the sizes and
  `MODEL_SCHEDULES` each size's schedule defaults; `model_config(name, **overrides)`
  is a named shape with overrides.
- Importing this module imports no torch: the command line (`recover train` and
  friends) reads shapes to validate flags and write config.json, and a process that
  only launches others should not pay torch's start-up (seconds of CPU each time).
  `core.components.model` builds the network from these and re-exports them.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from recover.core.config.schedule import ScheduleDefaults


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the transformer."""

    block_size: int = field(default=64, metadata={"help": "context length in tokens"})
    vocab_size: int = field(default=256, metadata={"help": "vocabulary size (256 = bytes)"})
    n_layer: int = field(default=2, metadata={"help": "transformer blocks"})
    n_head: int = field(default=2, metadata={"help": "attention heads per block"})
    n_embd: int = field(default=64, metadata={"help": "embedding width"})
    dropout: float = field(default=0.0, metadata={"help": "dropout probability"})
    bias: bool = field(default=False, metadata={"help": "bias in linear and layer-norm layers"})


# Named sizes. Byte vocabulary throughout, so the GPT-2 shapes have fewer
# parameters than OpenAI's 50257-token GPT-2 (124M there, ~85M here).
MODEL_CONFIGS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(),
    "small": GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=128),
    "medium": GPTConfig(block_size=256, n_layer=6, n_head=6, n_embd=384),
    "gpt2-124m": GPTConfig(block_size=1024, n_layer=12, n_head=12, n_embd=768),
}


# Each size's learning-rate schedule (overridable by --lr, --min-lr, --warmup-steps).
# gpt2-124m takes nanoGPT's GPT-2 values (max 6e-4, floor max/10); the smaller
# shapes take nanoGPT's "baby GPT" values (1e-3, floor 1e-4), as small models
# tolerate a higher rate. nanoGPT warms up for 2000 of 600000 iterations; our runs
# are 4 to a few hundred steps, so the warm-up is a fraction of the run instead
# (10%, as in torchtitan's short debug runs), with the decay ending at the run's
# last step. gpt2-124m also warms up for at least 19 steps (step 0 at 6e-4/20 =
# 3e-5): measured on its 4-step run (M=2, batch 4), a first step at 3e-4 or 6e-5
# raised the next loss (5.42 -> 6.45, -> 5.75), at 3e-5 it fell (-> 5.38), and
# the loss at step 3 was 4.09 against 5.42 at step 0.
MODEL_SCHEDULES: dict[str, ScheduleDefaults] = {
    "tiny": ScheduleDefaults(max_lr=1e-3, min_lr=1e-4, warmup_fraction=0.1),
    "small": ScheduleDefaults(max_lr=1e-3, min_lr=1e-4, warmup_fraction=0.1),
    "medium": ScheduleDefaults(max_lr=1e-3, min_lr=1e-4, warmup_fraction=0.1),
    "gpt2-124m": ScheduleDefaults(max_lr=6e-4, min_lr=6e-5, warmup_fraction=0.1, min_warmup_steps=19),
}


def model_config(name: str, **overrides) -> GPTConfig:
    """The named config with `overrides` applied; KeyError names the choices."""
    if name not in MODEL_CONFIGS:
        raise KeyError(f"unknown model {name!r}; choose from {', '.join(MODEL_CONFIGS)}")
    return replace(MODEL_CONFIGS[name], **overrides)
