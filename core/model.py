"""The training workload: a nanoGPT-style decoder-only transformer.

Contract:
- `GPT(config)` is a pure function of `config` and the torch RNG state at
  construction, so every replica that seeds identically builds identical weights
  (replicas never need a broadcast to agree at step 0).
- The forward pass draws randomness (dropout) only from the global torch RNG, which
  the trainer reseeds from (seed, microbatch id) before every microbatch: a redone
  microbatch is bit-for-bit the same computation.
- Byte-level tokens: the default vocabulary is 256.

Named sizes live in `MODEL_CONFIGS`: `tiny` runs an iteration in well under a second
on one CPU core; the GPT-2 shapes are for GPU clusters.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from .schedule import ScheduleDefaults


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


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0, "n_embd must be divisible by n_head"
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, heads, T, head_dim)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return F.dropout(self.proj(y), self.dropout, self.training)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.proj(F.gelu(self.fc(x))), self.dropout, self.training)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # weight tying, as in GPT-2
        self.apply(self._init_weights)
        # GPT-2's scaled init of the residual projections keeps the residual
        # stream's variance from growing with depth.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """Logits for `idx` (B, T); with `targets`, also the mean cross-entropy."""
        B, T = idx.shape
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.cfg.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = F.dropout(self.tok_emb(idx) + self.pos_emb(pos), self.cfg.dropout, self.training)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
