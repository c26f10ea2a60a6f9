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
  (core/components/data.py), so no data position or RNG state travels.
- Wire format: two broadcasts from `root`, then one per large tensor, then the
  fingerprint. First the sizes (two int64: the header's bytes and the buffer's
  fp32 elements). Then one byte buffer: the header (tagged JSON, `_encode`, of a
  dict without large tensors: the optimizer's non-tensor state and its 0-d
  tensors such as AdamW's `step`, the layout, the stepper's state), and from the
  next 4-aligned byte, as fp32, the parameters and every optimizer state tensor
  of one dimension or more, in (parameter index, state key) order, except those
  of `DIRECT_BYTES` or more, which the header lists ("direct") and which follow,
  each as a broadcast of its own, in that order. Last, the donor's weights
  fingerprint (`FINGERPRINT_BYTES` of ASCII hex), on its own. The donor fills the
  buffer (header, the copy of the small tensors) while the sizes travel: on gloo
  every broadcast waits for the receiver to post its receive, so that round trip
  is time the donor would otherwise idle. It computes its fingerprint (a read of
  every weight) while the state travels, not before it leaves: on gpt2-124m's
  shards that read is a tenth of a second that the wire would otherwise wait for.
  Why one buffer: small tensors share one collective, with no per-tensor round trips
  (measured: a broadcast per tensor was 3x slower than the copy into one
  buffer, on the tiny model); a large tensor costs one round trip for megabytes,
  and sending it from its own storage saves the donor a copy into the buffer,
  and the memory for it (on gpt2-124m, 1 GB of state, that copy and its page
  faults were most of the gap to a plain broadcast). The receiver keeps the
  optimizer's state as views of what arrived (no second copy). Works on any
  backend (gloo on the host, nccl on the device). `recover bench transfer` holds
  the cost against a plain broadcast of the same bytes.
  Why the 0-d tensors go in the header: AdamW keeps `step` on the host while
  the weights may live on a GPU.
- The header is JSON with tags for what JSON lacks (tuples, dicts with non-string
  keys, 0-d tensors as dtype and value; floats round-trip exactly): plain
  containers, numbers and 0-d tensors only, so a peer can never make it run code.
  Why not `torch.save`/`torch.load(weights_only=True)`: measured here, loading the
  tiny model's 6 KB header that way took 1.1 ms, more than broadcasting its 1.4 MB
  of state (the JSON round trip: well under 0.1 ms).
- Every broadcast has the communicator's deadline and abort check: a donor that
  dies mid-transfer surfaces as `CollectiveError` on the receivers (and vice
  versa) within `timeout`, never as a hang. A receiver that fails keeps its old
  state only in the sense that nothing it holds may be trusted: it must not take
  part in training until a later transfer succeeds (core/worker/replica.py).
- Both sides must have built their optimizer the same way (same parameter
  groups, same parameter order): checked from the header, `ValueError` if not.
- Sharded state (a rank of a replica of many ranks: FSDP2's or tensor parallelism's
  DTensor parameters and optimizer moments) moves as this rank's local parts only:
  the header's shapes are local shapes, and the receiver wraps each arrived moment
  back into a DTensor laid out as its parameter (same mesh, placements, global
  shape), so its optimizer steps exactly as the donor's. Each position of a replica
  runs its own transfer to the same position of the newcomer
  (`transfer_position`), all of them at once.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor

from recover.core.worker.accumulator import GradAccumulator
from recover.core.worker.comm import AbortCheck, CollectiveError, Communicator
from recover.core.worker.recipe import CommittedStep


class TransferError(CollectiveError):
    """The state arrived but does not match the donor's (fingerprints differ)."""


DIRECT_BYTES = 1 << 20  # a tensor this large is broadcast from its own storage (see the contract)
FINGERPRINT_BYTES = 64  # a weights fingerprint: sha256 as hex (GradAccumulator.weights_fingerprint)


@dataclass(frozen=True)
class TransferStats:
    """What one state transfer moved, as one member saw it."""

    bytes: int  # bytes broadcast from the donor: sizes, buffer (fingerprint, header, small tensors), direct tensors
    seconds: float  # wall time of the whole call on this member (loading and checking included)
    wire_seconds: float  # of which in the broadcasts (on a receiver: mostly waiting for the donor)
    fingerprint: str  # the weights fingerprint after the transfer (the donor's, checked)


def _local(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `t`: a DTensor's local part, a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _params_in_order(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters by their state_dict index (param_groups order)."""
    return [p for g in optimizer.param_groups for p in g["params"]]


def _like(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """An arrived optimizer moment as the receiver's optimizer holds it: a DTensor laid out as its
    parameter when that is one (the donor's moment was; shapes were checked), else itself."""
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


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
                v = _local(v)  # a sharded moment: this rank's part (see the contract)
                layout.append((idx, key, list(v.shape)))
                tensors.append(v)
            else:
                kept[key] = v.cpu() if isinstance(v, torch.Tensor) else v
        state[idx] = kept
    return {"state": state, "param_groups": sd["param_groups"]}, layout, tensors


def _encode(obj: Any) -> Any:
    """`obj` as JSON-able data, with tags for tuples, non-string-keyed dicts and 0-d tensors."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, list):
        return [_encode(v) for v in obj]
    if isinstance(obj, tuple):
        return {"__tuple": [_encode(v) for v in obj]}
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: _encode(v) for k, v in obj.items()}
        return {"__dict": [[_encode(k), _encode(v)] for k, v in obj.items()]}
    if isinstance(obj, torch.Tensor) and obj.dim() == 0:
        return {"__tensor": obj.item(), "dtype": str(obj.dtype).removeprefix("torch.")}
    raise TypeError(f"state transfer: cannot send a {type(obj).__name__} in the header")


def _decode(obj: Any) -> Any:
    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tuple" in obj:
        return tuple(_decode(v) for v in obj["__tuple"])
    if "__dict" in obj:
        return {_decode(k): _decode(v) for k, v in obj["__dict"]}
    if "__tensor" in obj:
        dtype = getattr(torch, obj["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"state transfer: unknown dtype {obj['dtype']!r} in the header")
        return torch.tensor(obj["__tensor"], dtype=dtype)
    return {k: _decode(v) for k, v in obj.items()}


def _groups_shape(optimizer: torch.optim.Optimizer) -> list[int]:
    return [len(g["params"]) for g in optimizer.param_groups]


def transfer_state(comm: Communicator, root: int, acc: GradAccumulator, optimizer: torch.optim.Optimizer,
                   stepper: CommittedStep, timeout: float, should_abort: AbortCheck | None = None,
                   direct_bytes: int = DIRECT_BYTES, progress: Callable[[], None] | None = None) -> TransferStats:
    """Make every member of `comm` hold rank `root`'s training state (see the module docstring).

    `direct_bytes`: on the donor, a tensor of at least this many bytes goes as a broadcast of
    its own, straight from its storage; smaller ones share the one buffer. `progress`: called
    after each broadcast completes (work done: the coordinator's progress rule sees a long
    transfer move, while each broadcast keeps its own timeout)."""
    wire = _Wire(comm, root, timeout, should_abort, progress)
    if comm.rank == root:
        return _send(wire, acc, optimizer, stepper, direct_bytes)
    return _receive(wire, acc, optimizer, stepper)


def transfer_position(open_store, generation: int, group_rank: int, group_size: int, position: int | None,
                      backend: str, acc: GradAccumulator, optimizer: torch.optim.Optimizer, stepper: CommittedStep,
                      timeout: float, should_abort: AbortCheck | None, graveyard,
                      progress: Callable[[], None] | None = None) -> TransferStats:
    """One position's transfer of an admitting generation: group rank 0 (the donor's rank at
    `position`) sends, the newcomers' ranks at `position` receive.

    The group holds only the donor and the newcomers, under the generation's prefix ("heal/",
    and "heal/pos<i>/" for position i of a replica of many ranks, None for a one-rank
    replica), so the other members go on folding and the positions move at once, each over
    a group of its own. The group goes to `graveyard` whatever happens."""
    namespace = "heal/" if position is None else f"heal/pos{position}/"
    comm = Communicator.build(open_store, generation, group_rank, group_size, backend, timeout, should_abort,
                              namespace=namespace)
    try:
        return transfer_state(comm, 0, acc, optimizer, stepper, timeout, should_abort, progress=progress)
    finally:
        graveyard.bury(comm)


class _Wire:
    """One transfer's broadcasts from `root`, timed: `seconds` is the time spent in them."""

    def __init__(self, comm: Communicator, root: int, timeout: float, should_abort: AbortCheck | None,
                 progress: Callable[[], None] | None = None):
        self.comm, self.root, self.timeout, self.should_abort = comm, root, timeout, should_abort
        self.progress = progress
        self.start = time.perf_counter()
        self.seconds = 0.0
        self.bytes = 0

    def broadcast(self, tensors: list[torch.Tensor], while_in_flight=None) -> None:
        t = time.perf_counter()
        self.comm.broadcast_many(tensors, self.root, self.timeout, self.should_abort, while_in_flight)
        self.seconds += time.perf_counter() - t
        self.bytes += sum(x.numel() * x.element_size() for x in tensors)
        if self.progress is not None:
            self.progress()

    def stats(self, fingerprint: str) -> TransferStats:
        return TransferStats(self.bytes, time.perf_counter() - self.start, self.seconds, fingerprint)


def _buffer(sizes: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The byte buffer the sizes describe, and its fp32 part (after the fingerprint and the
    header, 4-aligned)."""
    start = (int(sizes[0]) + 3) // 4 * 4
    buf = torch.empty(start + 4 * int(sizes[1]), dtype=torch.uint8, device=device)
    return buf, buf[start:].view(torch.float32)


def _bytes(data: bytes, device) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def _send(wire: _Wire, acc: GradAccumulator, optimizer: torch.optim.Optimizer, stepper: CommittedStep,
          direct_bytes: int) -> TransferStats:
    device = acc.buffer.device
    opt_sd, layout, tensors = _layout(optimizer)
    sources = [_local(p.detach()) for p in acc.params] + tensors  # (parameter, then state) order, as the layout
    direct = [i for i, t in enumerate(sources) if 4 * t.numel() >= direct_bytes and t.is_contiguous()]
    header = {"optimizer": opt_sd, "layout": layout, "stepper": stepper.state_dict(),
              "groups": _groups_shape(optimizer), "params": [list(_local(p).shape) for p in acc.params],
              "direct": direct}
    head = json.dumps(_encode(header), separators=(",", ":")).encode()
    skip = set(direct)  # the indices the buffer leaves out
    small = [t.reshape(-1) for i, t in enumerate(sources) if i not in skip]
    sizes = torch.tensor([len(head), sum(t.numel() for t in small)], dtype=torch.int64, device=device)
    packed: dict[str, Any] = {}

    def pack_while_sizes_travel() -> None:
        buf, flat = _buffer(sizes, device)
        buf[:len(head)].copy_(_bytes(head, device))
        # one copy of the small tensors into the buffer (a broadcast per small tensor measured 3x
        # slower on gloo: per-collective latency); the large ones go from their own storage
        if small:
            torch.cat(small, out=flat)
        packed.update(buf=buf)

    fp = torch.zeros(FINGERPRINT_BYTES, dtype=torch.uint8, device=device)

    def fingerprint_while_state_travels() -> None:
        # the weights are only read by the broadcasts in flight: the fingerprint reads them too
        packed["fingerprint"] = acc.weights_fingerprint()
        fp.copy_(_bytes(packed["fingerprint"].encode()[:FINGERPRINT_BYTES].ljust(FINGERPRINT_BYTES), device))

    wire.broadcast([sizes], while_in_flight=pack_while_sizes_travel)
    wire.broadcast([packed["buf"]] + [sources[i] for i in direct], while_in_flight=fingerprint_while_state_travels)
    wire.broadcast([fp])
    return wire.stats(packed["fingerprint"])


def _receive(wire: _Wire, acc: GradAccumulator, optimizer: torch.optim.Optimizer,
             stepper: CommittedStep) -> TransferStats:
    device = acc.buffer.device
    sizes = torch.zeros(2, dtype=torch.int64, device=device)  # header bytes, fp32 elements of the buffer
    wire.broadcast([sizes])
    buf, flat = _buffer(sizes, device)
    wire.broadcast([buf])
    raw = buf[:int(sizes[0])].cpu().numpy().tobytes()
    header = _decode(json.loads(raw))
    if header["groups"] != _groups_shape(optimizer) or header["params"] != [list(_local(p).shape)
                                                                             for p in acc.params]:
        raise ValueError("state transfer: the donor's parameters or optimizer groups "
                         f"({header['groups']}) differ from this replica's ({_groups_shape(optimizer)}): "
                         "every replica must build its model and optimizer the same way")
    shapes = header["params"] + [shape for _, _, shape in header["layout"]]
    direct = header["direct"]
    if any(not isinstance(i, int) or not 0 <= i < len(shapes) for i in direct):
        raise ValueError(f"state transfer: the header's direct tensors {direct} are not of its layout")
    # Each large tensor arrives in a fresh tensor, never straight into a parameter: an
    # abandoned broadcast may still write into its tensor later (core/worker/comm.py).
    received = {i: torch.empty(shapes[i], dtype=torch.float32, device=device) for i in direct}
    # and the donor's fingerprint, computed while its state travelled (its receive posted with theirs)
    fp = torch.zeros(FINGERPRINT_BYTES, dtype=torch.uint8, device=device)
    wire.broadcast([received[i] for i in direct] + [fp])
    want = fp.cpu().numpy().tobytes().decode(errors="replace").strip()
    _load(flat, received, header, acc, optimizer, stepper)
    got = acc.weights_fingerprint()
    if got != want:
        raise TransferError(wire.comm.generation, f"state transfer: weights fingerprint {got[:12]} after "
                                                  f"the transfer differs from the donor's {want[:12]}")
    return wire.stats(want)


def _load(flat: torch.Tensor, received: dict[int, torch.Tensor], header: dict, acc: GradAccumulator,
          optimizer: torch.optim.Optimizer, stepper: CommittedStep) -> None:
    """Put what arrived (the buffer's small tensors, the large ones received on their own) into the
    parameters and the optimizer; restore the stepper."""
    offset = 0

    def take(i: int, shape) -> torch.Tensor:
        nonlocal offset
        if i in received:
            return received[i].view(shape)
        n = int(torch.Size(shape).numel())
        offset += n
        return flat[offset - n:offset].view(shape)

    with torch.no_grad():
        for i, p in enumerate(acc.params):
            local = _local(p)
            local.copy_(take(i, local.shape))
    sd = header["optimizer"]
    owners = _params_in_order(optimizer)
    for j, (idx, key, shape) in enumerate(header["layout"]):
        # a view of freshly received memory, which nothing else holds: no second copy
        sd["state"][idx][key] = _like(take(len(acc.params) + j, shape), owners[idx])
    optimizer.load_state_dict(sd)
    stepper.load_state_dict(header["stepper"])
