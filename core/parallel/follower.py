"""The training API on a rank of a replica that is not its leader: what `Replica` offers, fed by the leader.

    replica = ReplicaFollower(acc, optimizer, link=link, ...)   # local rank >= 1
    while not replica.done:
        for mb in replica.quota():          # the ids the leader hands out (relayed as one list)
            ...forward/backward of this rank's part of mb...
            replica.fold(mb, loss_part)
        replica.commit()

Contract:
- The same loop as a one-rank replica's (core/worker/replica.py): a user's code does not
  change with the rank it runs on. Every answer comes from the leader through the
  replica link (core/parallel/replica_link.py), in the leader's order: `quota()`
  yields exactly the ids the leader yields, stopping where it stops (an abort
  between microbatches). The ids come as one list (in the last commit's relay
  when the leader could say them then, else in a "quota" message); the first is
  folded at once, each later one after the leader's word ("id", or "stop"), which
  it says only where its own `quota()` looks for an abort. `commit()` reduces when the leader reduces, votes
  nothing (the leader votes for the replica), and steps or recovers as the leader
  was told, returning what the leader's `commit()` returns.
- The cross-replica all-reduce of this rank's shard runs on its position's
  communicator of the generation ("pos<i>/gen<g>/"), started only after the
  leader heard `go` (so its deadline times the collective alone); its abort check
  is the link's (the coordinator's abort, published by any leader). A failed
  all-reduce never touches the accumulator (it reduces a copy), so after a
  recovery this rank keeps its folded shard exactly as the leader keeps its ledger.
- The vote's two replica-wide parts come from every rank through the link's
  `combine`: on a step whose vote carries the weights fingerprint (the leader's
  "reduce" says "digest") this rank adds its shard's weight bit sums, so a bit
  flipped here moves the replica's fingerprint; and when the replica's loss sum is
  not finite it names the ids its own rows made non-finite (`nonfinite_ids`), so
  the leader's vote names them as if they were its own.
- Healing (an admitting generation names this rank's replica donor or newcomer):
  the leader relays "heal" between any two of its decisions; this rank then moves
  its own position's shard, weights and optimizer state, over that position's group
  (`core.worker.state_transfer.transfer_position`: the donor's rank sends, the
  newcomer's checks the fingerprint), and says through `agree_healed` whether it
  succeeded. A newcomer's rank adds its bit sums once all did, so the leader's
  "healed" carries the replica's fingerprint; `healed` is then True here.
- A leader that rejoins (declared dead while alive) relays "rejoin" first: this
  rank drops what it folded and its communicator, its `quota()` ends and its
  `commit()` returns False, as the leader's do; the heal that admits the replica
  again follows.
- The hooks get this rank's weights (`attach_weights`, as the leader's do): a
  bitflip fault planned at this rank flips a bit of its shard.
- `after_step` (None, or a callable the loop sets) is called with this handle right
  after each committed step's optimizer step (or skip), at the point where the
  leader calls its own, so collectives there (a checkpoint's) meet the leader's.
  `committed_members` (the generation that committed the last step) and `members`
  come from the leader's commit and end messages, and `RunEnded.committed` from its
  end: the leader's checkpoint rule (`core/training/resilient.py`) reads the same
  values on every rank.
- The run ending for the leader (stop, fenced, the coordinator gone) ends it here
  with `core.worker.replica.RunEnded` (the leader's reason and exit code); a leader that dies takes this process with it (the launcher
  kills a replica's ranks together).
"""
from __future__ import annotations

import math
from typing import Iterator

import torch

from recover.core.worker.accumulator_interface import Accumulator
from recover.core.worker.comm import CollectiveError, Communicator, Graveyard
from recover.core.launch.hooks import WorkerHooks
from recover.core.worker.recipe import CommittedStep, LRSchedule
from recover.core.worker.state_transfer import transfer_position
from recover.core.contract import worker_exit
from recover.core.contract.nonfinite import NonfiniteLosses
from recover.core.worker.replica import RunEnded, load_reduced
from recover.core.parallel.replica_link import ReplicaLink


class _Rejoined(Exception):
    """Internal: the leader rejoins the job as a newcomer (declared dead while alive); unwound to
    quota()/commit(), which leave the step, as the leader's do."""


class ReplicaFollower:
    """A non-leader rank's handle on the resilient job (quota, fold, commit), fed by its leader."""

    def __init__(self, acc: Accumulator, optimizer: torch.optim.Optimizer, *, replica: int, local_rank: int,
                 link: ReplicaLink, open_store, backend: str = "gloo", collective_timeout: float = 30.0, grad_clip: float = 0.0,
                 lr_schedule: LRSchedule | None = None, hooks: WorkerHooks | None = None):
        if link.leader:
            raise ValueError("the leader rank runs core.worker.replica.Replica, not a follower")
        # an uncaught RunEnded in a user's loop: one line and its documented code, as on the leader
        worker_exit.install(f"replica {replica} rank {local_rank}")
        self.acc = acc
        self.optimizer = optimizer
        self.replica = replica
        self.local_rank = local_rank
        self.link = link
        self._open_store = open_store
        self.backend = backend
        self.timeout = collective_timeout
        self.hooks = hooks or WorkerHooks()
        self.hooks.attach_weights(acc)  # a bitflip planned at this rank corrupts its shard
        self._nonfinite = NonfiniteLosses()  # the ids this rank folded with a non-finite loss part
        self.stepper = CommittedStep(optimizer, acc.params, lr_schedule, grad_clip)
        self.healed = False  # this rank joined a running job and holds its donor position's state
        self.comm: Communicator | None = None
        self.graveyard = Graveyard()
        self.generation = -1
        self.step = 0
        self.steps = 0
        self.microbatches = 0
        self.members: list[int] = []  # as the leader last said (a commit, or the end)
        self.committed_members: list[int] = []  # the generation that committed the last step
        self.after_step = None  # called with this handle right after each step (see the contract)
        self._rejoined = False  # quota() left its step for a rejoin: the commit() that follows returns False
        self._announced: dict | None = None  # the next quota, as the leader's last commit relayed it
        self._bit_sums: torch.Tensor | None = None  # this rank's weight bit sums for the step's vote
        while True:  # the leader's generation 0 (or, admitted into a running job, its first generation)
            try:
                self._take(self._next("start"))
                break
            except _Rejoined:  # the leader was admitted, then declared dead in the transfer: once more
                continue

    # ---- the relay ----------------------------------------------------------------------------------
    def _next(self, *kinds: str) -> dict:
        msg = self.link.share()
        while msg.get("t") == "heal":  # an admitting generation, between any two of the leader's decisions
            self._heal(msg)
            msg = self.link.share()
        if msg.get("t") == "rejoin":  # declared dead while alive: what was folded is another generation's
            self.acc.clear()
            self._abandon_comm()
            raise _Rejoined()
        if msg.get("t") == "end":
            if msg.get("members") is not None:
                self.members = list(msg["members"])
            raise RunEnded(msg.get("reason", "the run ended"), bool(msg.get("fenced")), msg.get("code"),
                           msg.get("committed"))
        if msg.get("t") not in kinds:
            # ranks of one replica run the same loop: anything else is a bug, never a fault
            raise RuntimeError(f"replica {self.replica} rank {self.local_rank}: the leader said {msg} "
                               f"where one of {kinds} belongs")
        return msg

    def _heal(self, msg: dict) -> None:
        """This rank's position of an admitting generation's state transfer (the leader's `_heal`):
        group rank 0 is the donor's rank at this position, the others the newcomers'. Then every
        rank of the replica says whether its transfer succeeded and checked (`agree_healed`); a
        newcomer's ranks also add their bit sums, so its leader reports the replica's fingerprint.
        A failure is the leader's to report: this rank goes on to its next message."""
        g, step = msg["gen"], msg["step"]
        who = f"[replica {self.replica} rank {self.local_rank}]"
        self.hooks.at(step, "state_transfer")
        stats, ok = None, True
        try:
            stats = transfer_position(self._open_store, g, msg["rank"], msg["size"], self.local_rank, self.backend,
                                      self.acc, self.optimizer, self.stepper, self.timeout, self.link.abort_check(g),
                                      self.graveyard)
        except Exception as e:  # noqa: BLE001 - any failure of the transfer is a failed transfer (the leader's)
            why = e.reason if isinstance(e, CollectiveError) else f"{type(e).__name__}: {e}"[:500]
            print(f"{who} step {step}: state transfer in generation {g} failed: {why}", flush=True)
            ok = False
        all_ok, _ = self.link.agree_healed(ok, "" if stats is None else stats.fingerprint,
                                           0 if stats is None else stats.bytes, 0.0 if stats is None else stats.seconds)
        if stats is not None:
            what = f"received from replica {msg['donor']}" if msg["rank"] else "sent to the newcomers"
            print(f"{who} step {step}: state transfer of position {self.local_rank} {what}: {stats.bytes} bytes in "
                  f"{stats.seconds:.3f}s, shard fingerprint {stats.fingerprint}", flush=True)
        if all_ok and msg["rank"] > 0:
            self.link.combine(True, 0.0, bit_sums=self.acc.weights_bit_sums())  # the leader's fingerprint
            self.healed = True

    def _take(self, msg: dict) -> None:
        self.generation, self.step = msg["gen"], msg["step"]
        self.steps, self.microbatches = msg["steps"], msg["microbatches"]

    # ---- the loop's view ----------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.step >= self.steps

    @property
    def ledger(self) -> list[int]:
        return self.acc.ledger

    def quota(self) -> Iterator[int]:
        try:
            msg = self._announced if self._announced is not None else self._next("quota")
            self._announced = None
            self._take(msg)
            self._bit_sums = None
            ids = msg["ids"]
            for k, i in enumerate(ids):
                if k:  # the first id goes at once; each later one waits for the leader's word (it may stop)
                    word = self._next("id", "stop")
                    if word["t"] == "stop":
                        break
                    if word["id"] != i:  # the same list on both sides: anything else is a bug, never a fault
                        raise RuntimeError(f"replica {self.replica} rank {self.local_rank}: the leader handed out "
                                           f"{word['id']} where its quota {ids} has {i}")
                yield i
            if msg.get("digest"):
                # the vote carries the weights digest: this rank's part is read now, while its leader
                # waits for `go`, not once the all-reduce is done (the weights do not change before
                # the optimizer step)
                self._bit_sums = self.acc.weights_bit_sums()
        except _Rejoined:  # as the leader's quota(): it ends, and the commit() that follows returns False
            self._rejoined = True

    def progress(self) -> None:
        """Nothing to say: the leader speaks for the replica, and its own work waits on this rank's."""

    def fold(self, mb_id: int, loss: float) -> None:
        self.acc.fold(mb_id, loss)
        if (why := self.acc.out_of_range.get(mb_id)) is not None:  # --exact: the leader's vote names it; say why here
            print(f"[replica {self.replica} rank {self.local_rank}] step {self.step}: microbatch {mb_id} is outside "
                  f"the exact fixed-point range: {why}", flush=True)
        self._nonfinite.record(mb_id, loss)

    def commit(self) -> bool:
        self._announced = None  # (as the leader's: a commit() without quota() has the next one relayed anew)
        if self._rejoined:
            self._rejoined = False
            return False
        try:
            return self._commit()
        except _Rejoined:  # the leader's commit() rejoined: it returns False
            return False

    def _commit(self) -> bool:
        msg = self._next("recover", "reduce")
        if msg["t"] == "recover":
            return self._recover()
        g, step = msg["gen"], self.step
        should_abort = self.link.abort_check(g)
        buf = self.acc.pack()
        wide = None
        ok = True
        try:
            if self.comm is None or self.comm.generation != g:
                self._abandon_comm()
                self.comm = Communicator.build(self._open_store, g, msg["rank"], msg["size"], self.backend,
                                               self.timeout, should_abort, namespace=f"pos{self.local_rank}/")
            self.comm.allreduce(buf, self.timeout, should_abort,
                                while_in_flight=lambda: self.hooks.at(step, "allreduce"))
            if self.acc.wide_needed(buf):  # --exact: the leader read the same count, and reduces its wide sums too
                wide = self.acc.pack_wide()
                self.comm.allreduce(wide, self.timeout, should_abort)
        except CollectiveError as e:
            self._abandon_comm()
            print(f"[replica {self.replica} rank {self.local_rank}] step {step}: {e}", flush=True)
            ok = False
        digest = None
        if msg.get("digest"):  # the weights of this step's gradient (read at the end of the quota, or now)
            digest = self._bit_sums if self._bit_sums is not None else self.acc.weights_bit_sums()
        _, loss_sum, _ = self.link.combine(ok, self.acc.reduced_loss_sum(buf), bit_sums=digest)
        if not math.isfinite(loss_sum):  # every rank reads the same sum: all of them name their ids
            self.link.nonfinite_ids(list(self.acc.ledger), self._nonfinite.held(self.acc.ledger))
        self.hooks.at(step, "vote")
        self.hooks.at(step, "commit")  # its part of the vote is with the leader; the commit is not known yet
        msg = self._next("recover", "commit")
        if msg["t"] == "recover":
            return self._recover()
        self.hooks.at(step, "optimizer_step")
        if msg.get("skipped"):  # a non-finite loss and --on-nonfinite skip: no update, the schedule moves on
            self.stepper.skip(step)
        else:
            load_reduced(self.acc, buf, msg["microbatches"], wide, loss_combined=True)  # as its leader
            self.stepper(step)
        self.acc.clear()
        self.step = step + 1
        self._announced = msg.get("quota")  # step+1's, when the leader could say it now
        if msg.get("members") is not None:
            self.members = list(msg["members"])
            self.committed_members = list(msg["members"])
        if self.after_step is not None:
            self.after_step(self)
        return True

    def _recover(self) -> bool:
        self._abandon_comm()  # the leader rejoins the next generation; the folded shard is kept
        return False

    def _abandon_comm(self) -> None:
        self.graveyard.bury(self.comm)
        self.comm = None

    def adopt_committed_count(self, state: dict) -> None:
        """Start from a checkpoint's committed count (its LR schedule and step: `CommittedStep`'s
        state_dict), before the first step. A newcomer healed from a donor already holds a newer one."""
        self.stepper.load_state_dict(state)

    def close(self) -> None:
        self.link.close()
