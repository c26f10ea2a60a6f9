"""One voice per replica: the leader rank relays what the coordinator said to the replica's other ranks.

Contract:
- Only the leader (local rank 0) holds the control connection (core/worker/replica.py).
  Every decision that changes what a rank does next (the ids to fold, reduce or
  recover, the commit) reaches the other ranks through `share`, in the order the
  leader took it, so all ranks of a replica switch generation together and never
  disagree on what is folded. A rank never learns anything from the coordinator
  except through its leader.
- `share(obj)`: the leader passes a JSON-able object, every other rank receives
  it (one broadcast of `HEAD_BYTES` over the link's own group, a second one only
  for a longer object).
- `combine(ok, loss_part, bit_sums=None)`: after the cross-replica all-reduce of
  every position, one all-reduce inside the replica says whether every rank's
  succeeded and sums the ranks' parts of the loss (the vote carries the replica's
  whole loss sum). On a step whose vote carries the weights fingerprint (the
  leader's "reduce" message says "digest": every rank passes `bit_sums`, or none
  does) the same all-reduce also sums the ranks' weight bit sums exactly
  (`to_chunks`/`from_chunks`: each int64 as three 21/21/22-bit chunks in float64,
  folded into `DIGEST_SLOTS` slots), so the leader's fingerprint covers every
  rank's shard at no extra round trip (`from_chunks` says what it sees).
- `nonfinite_ids(ledger, bad)`: called by every rank when the combined loss sum
  is not finite (so all or none call it): one more all-reduce, over the ledger's
  positions (the same ids, in the same order, on every rank), returns the ids
  some rank folded with a non-finite loss part, so the leader names ids that only
  a follower's rows made non-finite. A step whose losses are finite pays nothing.
  While it waits, `while_waiting` runs between short slices: the leader keeps
  watching its control connection there, so an abort reaches the ranks that are
  still stuck in their own all-reduce (below).
- `agree_healed(ok, fingerprint)`: after a state transfer (every rank of a donor or a
  newcomer ran its position's, `core.worker.state_transfer.transfer_position`), one
  all-gather inside the replica says whether every rank's transfer succeeded (and,
  on a newcomer, matched its donor position's fingerprint) and gives every rank's
  shard fingerprint in rank order, so the leader reports "healed" only once each
  rank has checked its own shard, and names what each position now holds.
- Aborts inside a collective: a rank other than the leader has no control
  connection, so its cross-replica collective's abort check (`abort_check(g)`)
  reads a key of the coordinator's store, "replica-abort/gen<g>", that any leader
  sets (`publish_abort`) as soon as it sees generation g aborted. The check asks
  the store at most every `ABORT_POLL_SECONDS`, and only once its collective has
  waited that long, so a step without a fault costs the store nothing.
- Nothing inside a replica times out on its own (the link's group waits for a day):
  any rank dying takes the whole replica out (the launcher kills its other ranks,
  core/launch/replica_processes.py), and the leader's waits are the protocol's, which
  can be long (a slow peer's quota) without anyone being at fault.
"""
from __future__ import annotations

import json
import math
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from recover.core.worker.comm import AbortCheck

HEAD_BYTES = 4096  # the first broadcast of `share`: an int32 length, then the object's first bytes
ABORT_POLL_SECONDS = 0.01  # how often a non-leader rank's collective asks the store about an abort
LINK_TIMEOUT = timedelta(days=1)  # see the contract: a replica's ranks live and die together
WAIT_SLICE = timedelta(milliseconds=2)
FINGERPRINT_BYTES = 64  # a shard's weights fingerprint: sha256 as hex (core/worker/accumulator.py)
DIGEST_SLOTS = 64  # the replica fingerprint's int64 slots: tensor i of a rank adds into slot i % DIGEST_SLOTS
CHUNK_BITS = (21, 21, 22)  # an int64 as three unsigned chunks, low first: each < 2^22, exact in float64
_U64 = 1 << 64


def to_chunks(sums: torch.Tensor) -> torch.Tensor:
    """A rank's int64 bit sums as the float64 part of the combine: [DIGEST_SLOTS * 3].

    Tensor i's sum goes to slot i % DIGEST_SLOTS, split into its unsigned 21/21/22-bit
    chunks (low, middle, high). Every chunk is < 2^22, so float64 sums of them are exact
    for up to 2^31 addends (tensors per slot times ranks): the all-reduce's sum of the
    chunks, reassembled by `from_chunks`, is the int64 sum mod 2^64 of every rank's
    vector folded the same way (`reference_slot_sums`, the plain version)."""
    x = sums.to(torch.int64).reshape(-1)
    lo_bits, mid_bits, hi_bits = CHUNK_BITS
    parts = torch.stack([x & ((1 << lo_bits) - 1),
                         (x >> lo_bits) & ((1 << mid_bits) - 1),
                         (x >> (lo_bits + mid_bits)) & ((1 << hi_bits) - 1)], dim=1).to(torch.float64)
    slots = torch.arange(x.numel()) % DIGEST_SLOTS
    out = torch.zeros(DIGEST_SLOTS, 3, dtype=torch.float64)
    out.index_add_(0, slots, parts)
    return out.reshape(-1)


def from_chunks(chunks: torch.Tensor) -> torch.Tensor:
    """The int64 slot sums (mod 2^64, as signed int64) from summed chunks (`to_chunks`, all-reduced).

    The leader's vote carries `fingerprint_of` this vector (core/worker/accumulator.py)
    as the fingerprint of a replica of many ranks. Equal weights on every replica of
    the same layout give equal vectors (each rank at one position holds the same
    shard), so the coordinator's majority rule works as for one-rank replicas; one bit
    b flipped in any rank's shard moves one slot by 2^b mod 2^64, never 0, so it is
    always seen. Two flips can cancel: bit b set in one weight and cleared in another
    whose tensors share a slot (the same tensor, the same parameter's shard on another
    rank, or tensors DIGEST_SLOTS apart) leave the sums, and so the fingerprint,
    unchanged, as the same two flips would a one-rank replica's per-tensor sums. The
    value is not a one-rank replica's fingerprint (another vector is hashed): a run's
    replicas all have one layout, and only they are compared."""
    lo_bits, mid_bits, _ = CHUNK_BITS
    out = []
    for lo, mid, hi in chunks.reshape(DIGEST_SLOTS, 3).tolist():
        v = (int(lo) + (int(mid) << lo_bits) + (int(hi) << (lo_bits + mid_bits))) % _U64
        out.append(v - _U64 if v >= 1 << 63 else v)
    return torch.tensor(out, dtype=torch.int64)


def reference_slot_sums(vectors) -> list[int]:
    """The plain version of `from_chunks` after an all-reduce of `to_chunks`: each rank's int64
    vector folded into DIGEST_SLOTS slots, summed over ranks with Python integers, wrapped to int64."""
    acc = [0] * DIGEST_SLOTS
    for vec in vectors:
        for i, v in enumerate(vec):
            acc[i % DIGEST_SLOTS] += int(v)
    return [(v % _U64) - _U64 if v % _U64 >= 1 << 63 else v % _U64 for v in acc]


class ReplicaLink:
    """The leader's relay to the other ranks of its replica (see the module docstring)."""

    def __init__(self, local_rank: int, size: int, open_store: Callable[[], dist.Store]):
        self.local_rank = local_rank
        self.size = size
        self.leader = local_rank == 0
        # A group of its own: the relay never interleaves with FSDP2's collectives on the default one.
        self.group = dist.new_group(backend="gloo", timeout=LINK_TIMEOUT)
        self._open_store = open_store
        self._store: dist.Store | None = None  # opened on first use: a leader without faults never needs it
        self._published: set[int] = set()
        self.committed_once = False  # a commit went through this link (the ranks' beats are judged tighter after)
        self.beats = None  # the ranks' beats to the leader (core/parallel/rank_beats.py), stopped by close()

    # ---- the relay ---------------------------------------------------------------------------
    def share(self, obj: Any = None) -> Any:
        """The leader's `obj`, on every rank of the replica (the leader passes it, the others get it)."""
        head = torch.zeros(HEAD_BYTES, dtype=torch.uint8)
        data = b""
        if self.leader:
            data = json.dumps(obj, separators=(",", ":")).encode()
            head[:4].view(torch.int32)[0] = len(data)
            n = min(len(data), HEAD_BYTES - 4)
            head[4:4 + n] = torch.frombuffer(bytearray(data[:n]), dtype=torch.uint8)
        dist.broadcast(head, 0, group=self.group)
        length = int(head[:4].view(torch.int32)[0])
        if length > HEAD_BYTES - 4:
            rest = torch.zeros(length - (HEAD_BYTES - 4), dtype=torch.uint8)
            if self.leader:
                rest.copy_(torch.frombuffer(bytearray(data[HEAD_BYTES - 4:]), dtype=torch.uint8))
            dist.broadcast(rest, 0, group=self.group)
            body = bytes(head[4:].numpy()) + bytes(rest.numpy())
        else:
            body = bytes(head[4:4 + length].numpy())
        msg = obj if self.leader else json.loads(body)
        if isinstance(msg, dict) and msg.get("t") == "commit":
            self.committed_once = True
        return msg

    def close(self) -> None:
        """The loop is over: the ranks' beats say goodbye (they may now exit in any order)."""
        if self.beats is not None:
            self.beats.stop()

    def combine(self, ok: bool, loss_part: float, while_waiting: Callable[[], Any] | None = None,
                bit_sums: torch.Tensor | None = None) -> tuple[bool, float, torch.Tensor | None]:
        """(every rank's all-reduce succeeded, the replica's loss sum, the replica's slot sums), on every rank.

        `bit_sums`: this rank's weight bit sums (`weights_bit_sums`) on a step whose vote
        carries the fingerprint, given by every rank or by none; the third item is then their
        exact sum over the replica's ranks, folded into DIGEST_SLOTS slots (`from_chunks`),
        else None."""
        head = [0.0 if ok else 1.0, loss_part]
        t = torch.tensor(head, dtype=torch.float64)
        if bit_sums is not None:
            t = torch.cat([t, to_chunks(bit_sums)])
        self._wait(dist.all_reduce(t, group=self.group, async_op=True), while_waiting)
        slots = from_chunks(t[2:]) if bit_sums is not None else None
        return float(t[0]) == 0.0, float(t[1]), slots

    def agree_healed(self, ok: bool, fingerprint: str, moved: int = 0, seconds: float = 0.0,
                     while_waiting: Callable[[], Any] | None = None) -> tuple[bool, list[dict]]:
        """(every rank's transfer succeeded, per rank in rank order its shard's `fingerprint`, the
        bytes it `moved` and its transfer's `seconds`), on every rank: one all-gather."""
        mine = torch.zeros(1 + 8 + 8 + FINGERPRINT_BYTES, dtype=torch.uint8)
        mine[0] = 1 if ok else 0
        mine[1:9] = torch.tensor([moved], dtype=torch.int64).view(torch.uint8)
        mine[9:17] = torch.tensor([seconds], dtype=torch.float64).view(torch.uint8)
        raw = fingerprint.encode()[:FINGERPRINT_BYTES]
        if raw:
            mine[17:17 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        out = [torch.zeros_like(mine) for _ in range(self.size)]
        self._wait(dist.all_gather(out, mine, group=self.group, async_op=True), while_waiting)
        ranks = [{"fingerprint": bytes(t[17:].numpy()).rstrip(b"\0").decode(errors="replace"),
                  "bytes": int(t[1:9].clone().view(torch.int64)[0]),
                  "seconds": float(t[9:17].clone().view(torch.float64)[0])} for t in out]
        return all(int(t[0]) == 1 for t in out), ranks

    @staticmethod
    def _wait(work, while_waiting: Callable[[], Any] | None) -> None:
        """Wait for `work` in short slices, running `while_waiting` between them (the leader's
        control connection: an abort it reads reaches the ranks still in their collectives)."""
        while True:
            try:
                work.wait(WAIT_SLICE)
                return
            except Exception:
                if work.is_completed():
                    work.wait()
                    return
            if while_waiting is not None:
                while_waiting()

    def nonfinite_ids(self, ledger: list[int], bad: set[int]) -> list[int]:
        """The ids of `ledger` that any rank folded with a non-finite loss part (`bad`: this rank's).

        Every rank calls it, or none: the call follows a combined loss sum that is not
        finite, which every rank reads alike. The ledger is the replica's (the same ids in
        the same order on every rank), so one flag per position says it."""
        if not ledger:
            return []
        flags = torch.tensor([1.0 if i in bad else 0.0 for i in ledger], dtype=torch.float64)
        dist.all_reduce(flags, group=self.group)
        return [i for i, f in zip(ledger, flags.tolist()) if f > 0 or math.isnan(f)]

    # ---- aborts inside a collective ----------------------------------------------------------------
    def _key(self, gen: int) -> str:
        return f"replica-abort/gen{gen}"

    def _client(self) -> dist.Store:
        if self._store is None:
            self._store = self._open_store()
        return self._store

    def publish_abort(self, gen: int, reason: str) -> None:
        """Leader: generation `gen` is aborted; the ranks stuck in its collectives read it (once per gen)."""
        if gen in self._published:
            return
        self._published.add(gen)
        try:
            self._client().set(self._key(gen), reason)
        except Exception:  # noqa: BLE001 - the store gone: the ranks' own deadline still ends their wait
            pass

    def abort_check(self, gen: int) -> AbortCheck:
        """A non-leader rank's abort check for a collective of generation `gen` (see the contract)."""
        start = time.monotonic()
        state = {"next": start + ABORT_POLL_SECONDS}
        key = self._key(gen)

        def check() -> str | None:
            now = time.monotonic()
            if now < state["next"]:
                return None
            state["next"] = now + ABORT_POLL_SECONDS
            try:
                if self._client().check([key]):
                    return f"generation {gen} aborted (its leader said so)"
            except Exception:  # noqa: BLE001 - see publish_abort
                return None
            return None

        return check
