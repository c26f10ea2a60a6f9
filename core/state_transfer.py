"""Live state transfer: a joining replica is healed from a live member, over a communicator.

Contract:
- `transfer_state(comm, root, acc, optimizer, stepper, timeout, should_abort)` is
  called by every member of `comm`: rank `root` (the donor) sends, every other
  rank receives. When it returns, each receiver holds the donor's parameters,
  optimizer state and committed-step state (`recipe.CommittedStep.state_dict`,
  which holds the schedule's position) bit for bit, and its weights fingerprint
  (`GradAccumulator.weights_fingerprint`) has been checked against the donor's;
  a mismatch raises `TransferError`. It returns what moved (`TransferStats`).
- What is sent is everything a replica's future depends on that is not a
  function of the global microbatch id: data and per-microbatch randomness are
  (core/data.py), so no data position or RNG state travels.
- Wire format: two broadcasts from `root`: the sizes (two int64: the header's
  bytes, padded to 4, and the fp32 elements), then one byte buffer: the header
  (`torch.save` of a dict without large tensors: the optimizer's non-tensor
  state and its 0-d tensors such as AdamW's `step`, the layout, the stepper's
  state, the donor's fingerprint), then as fp32 the parameters and every
  optimizer state tensor of one dimension or more, in (parameter index, state
  key) order. Why one buffer: one collective moves all the bytes, on any backend
  (gloo on the host, nccl on the device), with no per-tensor round trips
  (measured: a broadcast per tensor was 3x slower than the copy into one
  buffer); the receiver keeps the optimizer's state as views of it (no second
  copy). `recover bench transfer` holds the cost against a plain broadcast of
  the same bytes.
  Why the 0-d tensors go in the header: AdamW keeps `step` on the host while
  the weights may live on a GPU.
- The header is read with `torch.load(weights_only=True)`: plain containers,
  numbers and tensors only; a peer can never make it run code.
- Every broadcast has the communicator's deadline and abort check: a donor that
  dies mid-transfer surfaces as `CollectiveError` on the receivers (and vice
  versa) within `timeout`, never as a hang. A receiver that fails keeps its old
  state only in the sense that nothing it holds may be trusted: it must not take
  part in training until a later transfer succeeds (core/replica.py).
- Both sides must have built their optimizer the same way (same parameter
  groups, same parameter order): checked from the header, `ValueError` if not.
"""
from __future__ import annotations

import io
import time
from dataclasses import dataclass
from typing import Any

import torch

from .accumulator import GradAccumulator
from .comm import AbortCheck, CollectiveError, Communicator
from .recipe import CommittedStep


class TransferError(CollectiveError):
    """The state arrived but does not match the donor's (fingerprints differ)."""


@dataclass(frozen=True)
class TransferStats:
    """What one state transfer moved, as one member saw it."""

    bytes: int  # bytes broadcast from the donor (header and flat buffer)
    seconds: float  # wall time of the three broadcasts on this member
    fingerprint: str  # the weights fingerprint after the transfer (the donor's, checked)


def _layout(optimizer: torch.optim.Optimizer) -> tuple[dict, list[tuple[int, str, list[int]]], list[torch.Tensor]]:
    """(state_dict with the flat-buffer tensors taken out, their layout, those tensors in order)."""
    sd = optimizer.state_dict()
    layout: list[tuple[int, str, list[int]]] = []
    tensors: list[torch.Tensor] = []
    state: dict[int, dict[str, Any]] = {}
    for idx in sorted(sd["state"]):
        kept: dict[str, Any] = {}
        for key in sorted(sd["state"][idx]):
            v = sd["state"][idx][key]
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                if v.dtype != torch.float32:
                    raise TypeError(f"optimizer state {key!r} of parameter {idx} is {v.dtype}; "
                                    "the state transfer moves fp32 state")
                layout.append((idx, key, list(v.shape)))
                tensors.append(v)
            else:
                kept[key] = v.cpu() if isinstance(v, torch.Tensor) else v
        state[idx] = kept
    return {"state": state, "param_groups": sd["param_groups"]}, layout, tensors


def _groups_shape(optimizer: torch.optim.Optimizer) -> list[int]:
    return [len(g["params"]) for g in optimizer.param_groups]


def transfer_state(comm: Communicator, root: int, acc: GradAccumulator, optimizer: torch.optim.Optimizer,
                   stepper: CommittedStep, timeout: float, should_abort: AbortCheck | None = None) -> TransferStats:
    """Make every member of `comm` hold rank `root`'s training state (see the module docstring)."""
    device = acc.buffer.device
    start = time.perf_counter()
    sending = comm.rank == root
    sizes = torch.zeros(2, dtype=torch.int64, device=device)  # header bytes (padded to 4), fp32 elements
    if sending:
        opt_sd, layout, tensors = _layout(optimizer)
        header = {"optimizer": opt_sd, "layout": layout, "stepper": stepper.state_dict(),
                  "fingerprint": acc.weights_fingerprint(), "groups": _groups_shape(optimizer),
                  "params": [list(p.shape) for p in acc.params]}
        raw = io.BytesIO()
        torch.save(header, raw)
        head = raw.getvalue()
        sizes[0] = (len(head) + 3) // 4 * 4
        sizes[1] = sum(p.numel() for p in acc.params) + sum(t.numel() for t in tensors)
    comm.broadcast(sizes, root, timeout, should_abort)
    hbytes, numel = int(sizes[0]), int(sizes[1])
    buf = torch.empty(hbytes + 4 * numel, dtype=torch.uint8, device=device)
    flat = buf[hbytes:].view(torch.float32)
    if sending:
        buf[:len(head)].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
        # one copy into the buffer: the cost the benchmark holds against a plain broadcast
        # (sending each tensor as its own collective measured 3x slower on gloo)
        torch.cat([p.detach().reshape(-1) for p in acc.params] + [t.reshape(-1) for t in tensors], out=flat)
    comm.broadcast(buf, root, timeout, should_abort)
    seconds = time.perf_counter() - start
    if not sending:
        header = torch.load(io.BytesIO(buf[:hbytes].cpu().numpy().tobytes()), weights_only=True)
        if header["groups"] != _groups_shape(optimizer) or header["params"] != [list(p.shape) for p in acc.params]:
            raise ValueError("state transfer: the donor's parameters or optimizer groups "
                             f"({header['groups']}) differ from this replica's ({_groups_shape(optimizer)}): "
                             "every replica must build its model and optimizer the same way")
        _load(flat, header, acc, optimizer, stepper)
        got = acc.weights_fingerprint()
        if got != header["fingerprint"]:
            raise TransferError(comm.generation, f"state transfer: weights fingerprint {got[:12]} after the "
                                                 f"transfer differs from the donor's {header['fingerprint'][:12]}")
    return TransferStats(sizes.numel() * 8 + buf.numel(), seconds, header["fingerprint"])


def _load(flat: torch.Tensor, header: dict, acc: GradAccumulator, optimizer: torch.optim.Optimizer,
          stepper: CommittedStep) -> None:
    """Copy the received buffer into the parameters and the optimizer; restore the stepper."""
    offset = 0
    with torch.no_grad():
        for p in acc.params:
            n = p.numel()
            p.copy_(flat[offset:offset + n].view_as(p))
            offset += n
    sd = header["optimizer"]
    for idx, key, shape in header["layout"]:
        n = int(torch.Size(shape).numel())
        # a view of the freshly received buffer, which nothing else holds: no second copy
        sd["state"][idx][key] = flat[offset:offset + n].view(shape)
        offset += n
    optimizer.load_state_dict(sd)
    stepper.load_state_dict(header["stepper"])
