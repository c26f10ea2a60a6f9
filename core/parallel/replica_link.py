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
- `combine(ok, loss_part)`: after the cross-replica all-reduce of every position,
  one all-reduce inside the replica says whether every rank's succeeded and sums
  the ranks' parts of the loss (the vote carries the replica's whole loss sum).
  While it waits, `while_waiting` runs between short slices: the leader keeps
  watching its control connection there, so an abort reaches the ranks that are
  still stuck in their own all-reduce (below).
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

    def combine(self, ok: bool, loss_part: float, while_waiting: Callable[[], Any] | None = None) -> tuple[bool, float]:
        """(every rank's all-reduce succeeded, the replica's loss sum), on every rank."""
        t = torch.tensor([0.0 if ok else 1.0, loss_part], dtype=torch.float64)
        work = dist.all_reduce(t, group=self.group, async_op=True)
        while True:
            try:
                work.wait(WAIT_SLICE)
                break
            except Exception:
                if work.is_completed():
                    work.wait()
                    break
            if while_waiting is not None:
                while_waiting()
        return float(t[0]) == 0.0, float(t[1])

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
