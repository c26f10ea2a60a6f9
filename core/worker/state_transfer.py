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
  faults were most of the gap to a plain broadcast).
- Where it arrives: a large tensor arrives straight in the receiver's own storage, its
  parameter's (this rank's part) or the optimizer's state tensor of that key when the
  optimizer already holds one of that shape (it has stepped, as a woken replica has);
  otherwise in fresh memory that then becomes the optimizer's state, with no second
  copy. Why: measured on gpt2-124m's S2 shards, receiving 0.5 GB into fresh memory took
  0.45-0.5 s where a warm buffer took 0.2-0.3 s (the page faults), and the copy into the
  parameters 0.02-0.03 s more. The weights fingerprint is read per parameter as soon as
  its broadcast completes, while the rest still travels. Works on any backend (gloo on
  the host, nccl on the device). `recover bench transfer` holds the cost against a
  plain broadcast of the same bytes.
- Late writes: an abandoned broadcast may still write into its tensor later
  (core/worker/comm.py), so a receive abandoned in the receiver's own storage stays in
  doubt, per accumulator, until the backend says it ended (`is_completed()`, at the
  latest at its backend timeout). While one is in doubt, the next transfer receives into
  fresh memory and copies into the parameters only once it ended (a wait bounded by that
  backend timeout and by the abort check); past it, the transfer fails (`CollectiveError`).
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
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor

from recover.core.worker.accumulator import GradAccumulator, fingerprint_of, weights_bit_sums
from recover.core.worker.comm import EXIT_SLACK, POLL_SECONDS, AbortCheck, CollectiveError, Communicator
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

    def broadcast(self, tensors: list[torch.Tensor], while_in_flight=None, after_each=None, issued=None) -> None:
        t = time.perf_counter()
        self.comm.broadcast_many(tensors, self.root, self.timeout, self.should_abort, while_in_flight,
                                 after_each, issued)
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
    in_place = _settled(acc)
    live = _live_tensors(header, acc, optimizer) if in_place else {}
    received = {i: live[i] if i in live else torch.empty(shapes[i], dtype=torch.float32, device=device)
                for i in direct}
    n = len(acc.params)
    sums: dict[int, torch.Tensor] = {}

    def sum_arrived_weight(k: int) -> None:
        # a parameter that arrived in place is final: its bit sum is read while the rest travels
        if k < len(direct) and direct[k] < n and direct[k] in live:
            sums[direct[k]] = weights_bit_sums([received[direct[k]]])[0]

    # and the donor's fingerprint, computed while its state travelled (its receive posted with theirs)
    fp = torch.zeros(FINGERPRINT_BYTES, dtype=torch.uint8, device=device)
    issued: list = []
    try:
        wire.broadcast([received[i] for i in direct] + [fp], after_each=sum_arrived_weight, issued=issued)
    except BaseException:
        if live:
            _in_doubt(acc, issued, time.monotonic() + wire.comm.timeout)
        raise
    want = fp.cpu().numpy().tobytes().decode(errors="replace").strip()
    if not in_place:  # what arrived is copied into the parameters only once no late write can follow it
        _wait_settled(acc, wire)
    _load(flat, received, header, acc, optimizer, stepper)
    with torch.no_grad():  # acc.weights_fingerprint(): the bit sums of each parameter's local part, hashed
        got = fingerprint_of(torch.stack([sums[i] if i in sums else weights_bit_sums([_local(p)])[0]
                                          for i, p in enumerate(acc.params)]))
    if got != want:
        raise TransferError(wire.comm.generation, f"state transfer: weights fingerprint {got[:12]} after "
                                                  f"the transfer differs from the donor's {want[:12]}")
    return wire.stats(want)


def _live_tensors(header: dict, acc: GradAccumulator, optimizer: torch.optim.Optimizer) -> dict[int, torch.Tensor]:
    """By layout index (parameters, then optimizer state), the receiver's own storage that a
    tensor the donor sends on its own can arrive in: this rank's part of the parameter, and of
    the optimizer's state tensor of that key where the optimizer already holds one of the same
    shape (it has stepped). Only contiguous fp32 tensors (a broadcast fills its storage whole)."""
    def fits(t: torch.Tensor | None, shape) -> bool:
        return (t is not None and t.dtype == torch.float32 and t.is_contiguous()
                and list(t.shape) == list(shape))

    live: dict[int, torch.Tensor] = {}
    for i, p in enumerate(acc.params):
        local = _local(p.detach())
        if fits(local, header["params"][i]):
            live[i] = local
    owners = _params_in_order(optimizer)
    for j, (idx, key, shape) in enumerate(header["layout"]):
        held = optimizer.state.get(owners[idx], {}).get(key)
        held = _local(held) if isinstance(held, torch.Tensor) else None
        if fits(held, shape):
            live[len(acc.params) + j] = held
    return live


# Per accumulator (a replica's rank: its parameters and its optimizer's state), the receives
# into its live storage that a failed transfer abandoned, with the time by which each has
# ended (its backend timeout): until then such a receive may still write (core/worker/comm.py).
_ABANDONED: "weakref.WeakKeyDictionary[Any, list[tuple[Any, float]]]" = weakref.WeakKeyDictionary()
_ABANDONED_LOCK = threading.Lock()


def _in_doubt(acc: Any, works: list, ends_by: float) -> None:
    with _ABANDONED_LOCK:
        _ABANDONED.setdefault(acc, []).extend((w, ends_by) for w in works)


def _settled(acc: Any) -> bool:
    """Whether no abandoned receive may still write into `acc`'s live storage (waits for nothing)."""
    with _ABANDONED_LOCK:
        left = [(w, end) for w, end in _ABANDONED.get(acc, []) if not w.is_completed()]
        if left:
            _ABANDONED[acc] = left
        else:
            _ABANDONED.pop(acc, None)
        return not left


def _wait_settled(acc: Any, wire: _Wire) -> None:
    """Wait until every abandoned receive into `acc`'s live storage has ended: each is bound by
    its backend timeout (gloo's own deadline, after which it fails and writes nothing more).
    The abort check still ends the wait at once."""
    while not _settled(acc):
        with _ABANDONED_LOCK:
            ends_by = max((end for _, end in _ABANDONED.get(acc, [])), default=0.0)
        if wire.should_abort is not None and (reason := wire.should_abort()):
            raise CollectiveError(wire.comm.generation, f"state transfer aborted: {reason}")
        if time.monotonic() > ends_by + EXIT_SLACK:
            raise CollectiveError(wire.comm.generation, "state transfer: a receive an earlier transfer abandoned "
                                                        "has not ended by its backend timeout")
        time.sleep(POLL_SECONDS * 10)


def _load(flat: torch.Tensor, received: dict[int, torch.Tensor], header: dict, acc: GradAccumulator,
          optimizer: torch.optim.Optimizer, stepper: CommittedStep) -> None:
    """Put what arrived (the buffer's small tensors, the large ones received on their own, maybe
    already in place) into the parameters and the optimizer; restore the stepper."""
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
            arrived = take(i, local.shape)
            if arrived.data_ptr() != local.data_ptr():  # else it arrived in place
                local.copy_(arrived)
    sd = header["optimizer"]
    owners = _params_in_order(optimizer)
    for j, (idx, key, shape) in enumerate(header["layout"]):
        arrived = take(len(acc.params) + j, shape)
        held = optimizer.state.get(owners[idx], {}).get(key)
        if isinstance(held, torch.Tensor) and _local(held).data_ptr() == arrived.data_ptr() \
                and list(_local(held).shape) == list(shape):
            sd["state"][idx][key] = held  # it arrived in the state tensor the optimizer holds
        else:
            # a view of freshly received memory, which nothing else holds: no second copy
            sd["state"][idx][key] = _like(arrived, owners[idx])
    optimizer.load_state_dict(sd)
    stepper.load_state_dict(header["stepper"])
