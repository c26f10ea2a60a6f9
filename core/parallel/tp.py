"""Tensor parallelism inside a replica: each block's attention heads and MLP width split over T ranks.

Contract:
- `tensor_parallel(model, tp_mesh)` applies torch's own DTensor tensor parallelism
  (`parallelize_module`) to every block of the GPT (core/components/model.py), over the
  replica's "tp" sub-mesh: the attention's `qkv` and the MLP's `fc` are
  `ColwiseParallel` (each rank computes its heads, its slice of the MLP width),
  the two `proj`s are `RowwiseParallel` (each rank's partial product, summed by an
  all-reduce into the replicated residual stream). The embeddings, layer norms and
  the tied head stay whole on every tp rank; their gradients are computed from
  replicated activations and replicated upstream gradients, so they come out equal
  on the T ranks with no collective of ours (checked in tests/test_tp_grid.py).
- The fused `qkv` weight holds all queries, then all keys, then all values; a
  plain row split would give rank 0 every query and half the keys. So before it is
  distributed, its rows (and bias) are regrouped per tp rank as [q; k; v] of that
  rank's heads (`group_heads_by_rank`). This is a fixed permutation of one
  parameter: the model computes the same function, AdamW and weight decay are
  elementwise, and norms and sums do not see the order. The attention reads its
  local head count from qkv's output width (core/components/model.py), so the single-process
  path is unchanged.
- Every rank must hold the same full weights when this is called (the same seed:
  core/components/model.py's contract); DTensor then keeps each rank's slice.
- Dropout: attention dropout draws masks for this rank's heads only, so with
  dropout > 0 a TP run matches a one-rank replica in distribution, not bit for bit.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

BLOCK_PLAN = {
    "attn.qkv": ColwiseParallel,
    "attn.proj": RowwiseParallel,
    "mlp.fc": ColwiseParallel,
    "mlp.proj": RowwiseParallel,
}
"""What each block's projections become under TP (the names are core/components/model.py's)."""


def qkv_row_order(n_embd: int, tp: int) -> torch.Tensor:
    """The permutation of a fused qkv's 3 x n_embd rows that puts each tp rank's [q; k; v] together.

    Row j of the result is the old row order[j]: rank t's chunk (rows t*3C/T ..) is its
    C/T query rows, then the same C/T key rows, then value rows.
    """
    if n_embd % tp:
        raise ValueError(f"--tp {tp} does not divide the embedding width {n_embd}")
    width = n_embd // tp
    return torch.cat([torch.arange(t * width, (t + 1) * width) + part * n_embd
                      for t in range(tp) for part in range(3)])


@torch.no_grad()
def group_heads_by_rank(qkv: nn.Linear, tp: int) -> None:
    """Permute `qkv`'s rows in place so that a row split over `tp` ranks gives each its heads' [q; k; v]."""
    order = qkv_row_order(qkv.in_features, tp)
    qkv.weight.copy_(qkv.weight[order])
    if qkv.bias is not None:
        qkv.bias.copy_(qkv.bias[order])


def tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Split every block of `model` (a core.components.model.GPT) over `tp_mesh` (see the contract). Returns model."""
    tp = tp_mesh.size()
    if tp == 1:
        return model
    cfg = model.cfg
    if cfg.n_head % tp or (4 * cfg.n_embd) % tp:
        raise ValueError(f"--tp {tp} must divide the heads ({cfg.n_head}) and the MLP width ({4 * cfg.n_embd})")
    for block in model.blocks:
        group_heads_by_rank(block.attn.qkv, tp)
        parallelize_module(block, tp_mesh, {name: style() for name, style in BLOCK_PLAN.items()})
    return model
