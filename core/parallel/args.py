"""The layout of a job: how many replicas, and how each replica is cut into ranks.

Contract:
- `ParallelismArgs` is plain data (a frozen dataclass, one help line per field, so
  it can become CLI flags like the other configs); nothing here starts a process or
  touches torch.distributed.
- `validate(model_or_shapes, batch_size=None)` raises one `ValueError` naming the
  field and the reason for a layout that cannot run, before anything starts; a
  layout it accepts runs. What the grid needs of a model's heads, width and layers
  and of the batch is `ReplicaLayout.check` (core/config/replica_layout.py), the
  rules `recover train` checks too; what only a torch model shows (a 0-d
  parameter, none trainable) is checked here.
- `ranks_per_replica` and `world_size` are the job's sizes (a replica's is
  `ReplicaLayout.ranks`).

What FSDP2 really needs of the shard size S (checked in torch 2.13's
`fully_shard`, and by running it): it shards every parameter on dim 0 in chunks of
ceil(dim0 / S) rows, pads the last chunks and lets a rank hold an empty one. So S
need not divide any dimension, and S larger than a parameter's dim 0 (say a
LayerNorm gain of 64 over 128 ranks) still runs: some ranks hold none of that
parameter. That is waste, not an error, and is allowed. What is an error:
- S < 1 or R < 1;
- a parameter with no dimension at all (a 0-d tensor): there is no dim 0 to cut,
  and `fully_shard` refuses it;
- with a batch size given: fewer sequences per microbatch than S. Inside a replica
  the S ranks split each microbatch's rows between them (see fsdp.py); a rank with
  no row would have no loss to take the gradient of.
(FSDP2 needs even division only for a `Shard(d)` with d > 0, which this project
does not ask for.)

Tensor parallelism T (`tp`, core/parallel/tp.py) splits each block's attention heads
and MLP width over T ranks, so T must divide the model's heads and its MLP width
(4 x n_embd); with a model or its config given, `validate` refuses any other T,
naming the field. The T ranks of one shard position see the same rows, so the rows
per microbatch must be at least S (not S x T).

Pipeline parallelism P (`pp`, core/parallel/pp.py) cuts the model's blocks into P
consecutive stages, so P may not exceed the model's layers (a stage with no block
would only pass activations on); with a model or its config given, `validate`
refuses a larger P, naming the field. `pp_schedule` is nanotron's name of the
schedule: "afab" (all forwards, then all backwards: GPipe) or "1f1b".

The grid inside a replica is ("pp", "shard", "tp"), tp innermost and pp outermost,
as nanotron orders (pp, dp, tp): local rank = (pp_index * S + shard_index) * T +
tp_index. A replica is P x S x T ranks (`ranks_per_replica`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Union

import torch

from recover.core.config.replica_layout import ReplicaLayout

ModelShapes = Union[torch.nn.Module, Mapping[str, Iterable[int]], Iterable[Iterable[int]], Any]
"""A model, its trainable parameters' shapes (by name, or just a list of shapes), or a GPTConfig."""


def _shapes(model_or_shapes: ModelShapes) -> list[tuple[str, tuple[int, ...]]]:
    if isinstance(model_or_shapes, torch.nn.Module):
        return [(n, tuple(p.shape)) for n, p in model_or_shapes.named_parameters() if p.requires_grad]
    if isinstance(model_or_shapes, Mapping):
        return [(str(n), tuple(s)) for n, s in model_or_shapes.items()]
    return [(f"parameter {i}", tuple(s)) for i, s in enumerate(model_or_shapes)]


def _n_layer(model_or_shapes) -> int:
    """The blocks of a GPT or its GPTConfig; TypeError for anything else."""
    cfg = model_or_shapes if _is_config(model_or_shapes) else getattr(model_or_shapes, "cfg", None)
    if cfg is None or not hasattr(cfg, "n_layer"):
        raise TypeError("--pp > 1 is validated against a GPT or its GPTConfig (its layers)")
    return int(cfg.n_layer)


def _is_config(x) -> bool:
    return hasattr(x, "n_head") and hasattr(x, "n_embd") and not isinstance(x, torch.nn.Module)


def _tp_widths(model_or_shapes) -> tuple[int, int]:
    """(attention heads, MLP width) of a GPT or its GPTConfig; TypeError for anything else."""
    cfg = model_or_shapes if _is_config(model_or_shapes) else getattr(model_or_shapes, "cfg", None)
    if cfg is None or not _is_config(cfg):
        raise TypeError("--tp > 1 is validated against a GPT or its GPTConfig (heads and MLP width)")
    return int(cfg.n_head), 4 * int(cfg.n_embd)


@dataclass(frozen=True)
class ParallelismArgs:
    """The job's rank layout: `replicas` failure domains, each of `pp` x `shard` x `tp` ranks."""

    replicas: int = field(default=1, metadata={"help": "replicas R: data-parallel copies of the model, each a failure domain"})
    shard: int = field(default=1, metadata={"help": "shard S: ranks per replica over which FSDP2 shards the model"})
    tp: int = field(default=1, metadata={"help": "tensor parallel T: ranks over which each block's heads and MLP are split"})
    pp: int = field(default=1, metadata={"help": "pipeline parallel P: consecutive stages the model's blocks are cut into"})
    pp_schedule: str = field(default="1f1b", metadata={"help": "pipeline schedule: afab (GPipe) or 1f1b"})

    @property
    def ranks_per_replica(self) -> int:
        """Processes in one replica: P x S x T."""
        return ReplicaLayout(shard=self.shard, tp=self.tp, pp=self.pp).ranks

    @property
    def world_size(self) -> int:
        """Processes in the whole job: R * ranks_per_replica."""
        return self.replicas * self.ranks_per_replica

    def validate(self, model_or_shapes: ModelShapes | None = None, batch_size: int | None = None) -> "ParallelismArgs":
        """Raise one ValueError if this layout cannot run `model_or_shapes` (see the module docstring); else self."""
        for name in ("replicas", "shard", "tp", "pp"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name}: must be an integer >= 1, got {v!r}")
        # what the grid needs of the model and the batch: the rules TrainConfig checks too
        heads = width = layers = None
        if model_or_shapes is not None and self.tp > 1:
            heads, width = _tp_widths(model_or_shapes)
        if model_or_shapes is not None and self.pp > 1:
            layers = _n_layer(model_or_shapes)
        ReplicaLayout(shard=self.shard, tp=self.tp, pp=self.pp).check(
            self.pp_schedule, heads=heads, mlp_width=width, layers=layers, batch_size=batch_size)
        if model_or_shapes is not None and not _is_config(model_or_shapes):
            shapes = _shapes(model_or_shapes)
            if not shapes:
                raise ValueError("the model has no trainable parameters to shard")
            scalars = [n for n, s in shapes if len(s) == 0]
            if scalars and self.shard > 1:
                raise ValueError(
                    f"--shard {self.shard}: FSDP2 shards every parameter on dim 0, and {scalars[0]} is a 0-d "
                    f"tensor (give it shape (1,))")
        return self
