"""The public API: this process's replica of a resilient job, for any training loop.

    replica = Replica.from_env(model, optimizer,     # under `recover launch` / `recover train`
                               lr_schedule=lambda step: 1e-3 * min(1.0, (step + 1) / 10),
                               grad_clip=1.0)
    while not replica.done:
        for mb in replica.quota():                    # global microbatch ids to fold now
            loss = loss_fn(model, batch(mb)); loss.backward()
            replica.fold(mb, loss.item())
        replica.commit()                              # False: a replica died; loop for the redo ids

Contract:
- `quota()` gives the ids this replica must fold before `commit()`. After a
  failure it gives only ids that no survivor had folded (the dead replica's work);
  what this replica folded before the failure stays in its accumulator. It is
  lazy: it stops early when the generation is aborted between microbatches, and
  the `commit()` that follows goes straight to recovery.
- `commit()` does the fault-tolerant all-reduce of a fresh copy of the
  accumulator (so a failed reduction never touches it), votes, and - once the
  coordinator has seen every member vote for exactly the iteration's M ids -
  divides by M, clips (optional) and steps the optimizer. It returns True when
  the iteration committed, False when recovery needs more work from `quota()`.
- `lr_schedule` (optional) is a function of the committed step giving its
  learning rate, or a torch LRScheduler over `optimizer`: it is set/stepped only
  on commit (`core.worker.recipe.CommittedStep`), so a redone step keeps its learning
  rate. Each vote reports the rate the step will use; the coordinator writes it
  to metrics.jsonl as `lr` and refuses to commit a step whose replicas disagree.
- Gradients live in a flat accumulator that the parameters' `.grad` tensors view:
  call `backward()` as usual, but neither `zero_grad()` nor replace `.grad`
  (commit clears the accumulator itself). `fold()` and `commit()` check that
  every `.grad` still views the accumulator (`zero_grad()`, set_to_none by
  default, or a DDP wrapper's buckets detach it) and raise `GradientDetached`
  naming the cause instead of reducing a gradient that is not the ledger's.
- A refused `fold()` (an id outside the quota, an id folded twice, a detached
  `.grad`) and a refused `commit()` raise, and discard what this replica folded
  in the iteration (its accumulator is zeroed, `.grad` re-attached, and
  `quota()` lists those ids again): a stray backward can never be committed.
- `after_step` (None, or a callable the loop sets) is called with the replica right
  after each committed step's optimizer step (or skip), before anything of the
  next generation happens (an admission, a state transfer that may fence this
  replica, in which case `commit()` returns False though it stepped).
  `committed_members` is the generation that committed the replica's last step:
  `members` may already be the next one's. A checkpoint writer decides there.
- Start-up waits as long as the coordinator says: its answer to the hello gives
  the time left before generation 0 forms with the replicas that are there.
- The hello carries a digest of the initial weights; generation 0 forms only if
  every replica's digest agrees, else the run stops naming the replica(s) that
  differ (e.g. a per-replica seed): replicas must start from the same weights.
- Every `digest_every` steps (default 1; 0 = never) the vote carries a digest of
  the weights this step's gradient was computed with. The coordinator fences a
  replica whose digest is off the members' majority (silent data corruption) and
  redoes its share of the step, so a corrupt replica never commits a gradient.
- Joining a running job (a replacement started in a dead replica's slot, as
  `--replace-after` does): the constructor's hello says the process can be healed;
  the coordinator answers "pending" and admits it at the next commit. The
  admitting generation's gen message names a donor, which sends its weights,
  optimizer and schedule state (core/worker/state_transfer.py) before folding its own
  quota; the newcomer checks the weights fingerprint against the donor's, reports
  "healed", and only then gets its quota. If the transfer fails (the donor dies,
  a deadline passes, or any error on either side: the layout code refusing the
  state, say), the side that saw it reports it, the generation fails as after a
  failed collective, the donor goes on with its own state (it only read it), and
  the newcomer reports it in its join and waits for the next commit again; it
  never folds or votes without the committed state. The coordinator refuses a
  newcomer after `--max-heal-attempts` failed transfers (it exits, code 3).
- Rejoin after a false death (`rejoin`, default on; RECOVER_REJOIN=0 turns it
  off for `from_env`): a replica declared dead while it was only frozen or slow
  wakes to the coordinator's last line, "fenced", and a closed connection. With
  rejoin it drops what it folded, opens a new
  connection and joins as a newcomer, through the same path; nothing it sent on
  the old connection, and no collective of its old generation, reaches the
  generations it is not in (every store key and message carries the generation).
  `quota()` then ends early and `commit()` returns False, so the loop asks for the
  new step's quota. Without rejoin it raises `RunEnded(fenced=True)`.
- The coordinator can die and come back. A closed connection is not taken as a
  verdict: the replica reconnects (for up to `reconnect_timeout` seconds; for as
  long as it takes under a launcher that restarts the coordinator, which brings
  it back or ends the job, RECOVER_COORDINATOR_SUPERVISED) and
  says hello with a report of where it stands (`_report`: step, generation,
  ledger, what it waits for, its last vote), keeping its weights, optimizer state
  and what it folded. Inside a quota the heartbeat thread makes that report the
  moment the connection is lost, without waiting for the microbatch in flight
  (`_report_from_heartbeat`); the training thread adopts its connection when it
  next looks. A restarted coordinator answers "rebuilt" and the wait goes
  on where it was (the commit it missed, an abort, the next generation, or, for
  a newcomer, its admission: the restarted coordinator admits it); a live
  one that had declared it dead answers "pending", and it rejoins as above. A
  coordinator silent for `coordinator_timeout` seconds (frozen) counts as closed.
  The last `commit()` returns once the coordinator says `done` (the step is
  recorded), so a coordinator killed right after sending the last commit still
  has every worker to rebuild from; that wait never raises into the caller.
- A replica of many ranks (HSDP, `link` given: core/parallel/replica_link.py):
  this object runs on the replica's leader rank (local rank 0), the only one
  that talks to the coordinator; each of its decisions (the ids of `quota()`,
  reduce or recover, the commit, the run's end) is relayed to the other ranks,
  which run `core.parallel.follower.ReplicaFollower` in the same loop; the
  commit and the end carry the generation's members (and the end the committed
  count of a stop), so a checkpoint writer decides alike on every rank. The
  all-reduce runs per position ("pos<i>/" communicators), the vote carries the
  replica's whole loss sum and goes only if every rank's all-reduce succeeded; its
  weights fingerprint is of every rank's shard (the ranks' bit sums, added in the
  same all-reduce), and its `nonfinite` ids include those a follower's rows made
  non-finite (`ReplicaLink.nonfinite_ids`). Healing such a replica (a
  replacement) moves the state rank to rank: the leader relays the admitting
  generation's heal to its ranks, each rank of the donor sends its shard (optimizer
  state too) to the newcomer's rank at the same position over a group of that
  position ("heal/pos<i>/gen<g>/"), all positions at once, each newcomer rank
  checks its shard's fingerprint against its donor rank's, and the leader says
  "healed" (with every rank's shard fingerprint and the replica's combined one)
  only once all of them did (`ReplicaLink.agree_healed`); one rank's failure is
  the replica's failed transfer. `can_heal` (the hello's; True by default) says
  whether this process can be healed from a donor: False for a loop whose state
  cannot move that way. Declared dead while alive (a frozen leader, or all its
  ranks frozen), such a replica rejoins as a one-rank one does: the leader relays
  "rejoin" first, so every rank drops what it folded and leaves the step it was
  in (its `quota()` ends, its `commit()` returns False), then the heal as above.
- Every failure the replica sees is a `CollectiveError` internally; the exceptions
  that reach the caller are `RunEnded` (the run cannot go on, or this replica was
  declared dead - fenced - and must exit). Its `code` is the worker's exit code
  (core/contract/worker_exit.py: 0 complete, 1 stopped, 3 fenced, 4 coordinator gone); a
  `RunEnded` the loop does not catch ends the process with one line saying why and
  that code, never a traceback.
- A loss that is not finite (NaN, inf) is reported, not sent as a malformed vote:
  `fold()` notes the ids, the vote says `loss_sum: null` with them
  (core/contract/nonfinite.py), and the coordinator stops the run naming them, or with
  `--on-nonfinite skip` drops the step: `commit()` then clears the accumulator
  without an optimizer step, moves the schedule on, and returns True.
- With an exact accumulator (core/worker/exact.py, `--exact`) a step in which a member
  folded a spike (a gradient beyond the normal fixed-point range) all-reduces the
  wide sums too, right after the first all-reduce (a failure there is the same
  failure); a microbatch beyond the wide range is folded as one whose loss is not
  finite (it was never summed; the log says which range), so the same stop or skip
  applies.
"""
from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

from recover.core.contract import idranges, worker_exit
from recover.core.worker.accumulator import GradAccumulator, fingerprint_of
from recover.core.worker.accumulator_interface import Accumulator
from recover.core.worker.comm import CollectiveError, Communicator, Graveyard
from recover.core.worker.control import ControlClient
from recover.core.worker.progress import ProgressMeter
from recover.core.launch.hooks import WorkerHooks
from recover.core.contract.nonfinite import NonfiniteLosses, vote_fields
from recover.core.contract.policy import quota_in, quota_of
from recover.core.contract.step_messages import Commit, Ready, Vote
from recover.core.worker.recipe import CommittedStep, LRSchedule
from recover.core.launch.startup import JOIN_TOKEN_ENV, env_addr, keyed_store, run_start_time
from recover.core.worker.state_transfer import transfer_position
from recover.core.contract import env_names

REJOIN_ENV = env_names.REJOIN  # "0": a fenced replica exits instead of rejoining (from_env's default)
STARTED_ENV = env_names.WORKER_STARTED  # time.time() when the launcher started this process
COORDINATOR_TIMEOUT_ENV = env_names.COORDINATOR_TIMEOUT  # seconds of coordinator silence = gone (from_env's)
RECONNECT_TIMEOUT_ENV = env_names.RECONNECT_TIMEOUT  # seconds to keep reaching a restarted one (from_env's)


# Past the coordinator's start-up deadline it forms generation 0 (or stops the run)
# within one tick and sends that at once: this is room for a loaded machine.
STARTUP_ANSWER_SECONDS = 30.0
# A coordinator answers a hello at once; one that accepted the connection and says
# nothing for this long is frozen (its kernel still accepts), so the next try goes on.
RECONNECT_ANSWER_SECONDS = 10.0


def load_reduced(acc: Accumulator, reduced: torch.Tensor, microbatches: int, wide: torch.Tensor | None = None,
                 loss_combined: bool = False) -> None:
    """Set `acc`'s gradients to the step's mean from its reduced `pack()` (and `wide`, an exact
    accumulator's reduced wide sums). `loss_combined`: a rank of a replica of many ranks, whose
    vote's combine (core/parallel/replica_link.py) carried the replica's loss, so `load_mean`'s own
    loss collective is left out (`load_shard_mean`, which every accumulator has) unless there are
    wide sums (those go through `load_mean`, whole). The leader and its followers all call this
    one function with the same `wide`/`loss_combined`, so every rank of a replica runs the same
    collectives (one that took the other branch would hang)."""
    if loss_combined and wide is None:
        acc.load_shard_mean(reduced, microbatches)
    else:
        acc.load_mean(reduced, microbatches, wide)


@dataclass
class _Reduction:
    """One step's cross-replica reduction, as the leader saw it (`Replica._reduce`)."""

    buf: torch.Tensor  # the reduced pack() (partly reduced, or not at all, after a failure)
    wide: torch.Tensor | None  # an exact accumulator's reduced wide sums, when the step has a spike
    failure: CollectiveError | None  # why this rank's (or, once combined, any rank's) reduction failed


class RunEnded(RuntimeError):
    """The job ended for this replica: the run failed, or this replica was fenced out.

    `code`: the worker's exit code for it (core/contract/worker_exit.py); `committed` (a stop for a
    non-finite loss): this replica holds the state after exactly that many steps, untouched."""

    def __init__(self, reason: str, fenced: bool = False, code: int | None = None, committed: int | None = None):
        """Raised by the replica, not by a loop; a loop reads these fields when it catches one.

        Args:
            reason: why the run ended for this replica (the line the worker's log gets).
            fenced: True when the coordinator fenced this replica out (it must exit); False: the run ended.
            code: the worker's exit code; None: EXIT_FENCED when `fenced`, else EXIT_STOPPED.
            committed: the steps the state this replica holds is after (a stop for a non-finite
                loss); None: not known.
        """
        super().__init__(reason)
        self.reason = reason
        self.fenced = fenced
        self.code = code if code is not None else (worker_exit.EXIT_FENCED if fenced else worker_exit.EXIT_STOPPED)
        self.committed = committed


class _Fenced(Exception):
    """Internal: the coordinator closed this member's connection; unwound to quota()/commit(), which rejoin."""


class GradientDetached(RuntimeError):
    """A parameter's .grad no longer views the replica's accumulator (zero_grad, DDP)."""


class Replica:
    """One replica's handle on the resilient job (quota, fold, commit)."""

    _announced = False  # a replica of many ranks: the last commit's relay gave its ranks the next quota

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter] | Accumulator,
        optimizer: torch.optim.Optimizer,
        *,
        replica: int,
        control_addr: tuple[str, int],
        store_addr: tuple[str, int],
        backend: str = "gloo",
        collective_timeout: float = 30.0,
        heartbeat_interval: float = 0.1,
        grad_clip: float = 0.0,
        lr_schedule: LRSchedule | None = None,
        tokens_per_microbatch: int = 0,
        hooks: WorkerHooks | None = None,
        join_token: str | None = None,
        digest_every: int = 1,
        rejoin: bool | None = None,
        coordinator_timeout: float | None = None,
        reconnect_timeout: float | None = None,
        link=None,
        can_heal: bool = True,
    ):
        """Join the job: say hello to the coordinator and wait for generation 0 (or admission).

        A loop under `recover launch` calls `from_env` instead, which reads `replica`,
        `control_addr` and `store_addr` from the launcher's environment.

        Args:
            params: the parameters to train (their `.grad` then views a `GradAccumulator`'s
                buffer), or an accumulator (an `Accumulator`: `ExactAccumulator`,
                `ShardedAccumulator`, ...) that holds them.
            optimizer: the optimizer over those parameters; stepped only when a step commits.
            replica: this replica's id (its failure domain).
            control_addr: (host, port) of the coordinator's control server.
            store_addr: (host, port) of the TCPStore the replicas' communicators meet at.
            backend: the collective backend of the cross-replica all-reduce ("gloo").
            collective_timeout: seconds a cross-replica all-reduce may take before it fails.
            heartbeat_interval: seconds between this replica's heartbeats to the coordinator.
            grad_clip: the max norm the committed (averaged) gradient is clipped to; 0: no clipping.
            lr_schedule: a function of the committed step giving its learning rate, or a torch
                LRScheduler over `optimizer`, set or stepped only on commit; None: the optimizer's rate.
            tokens_per_microbatch: the tokens of one microbatch, for the coordinator's `tokens`
                metric; 0: not counted.
            hooks: the worker hooks (`core.launch.hooks.WorkerHooks`) called at each phase; None: no-ops.
            join_token: the run's join token that keys every store key; None: RECOVER_JOIN_TOKEN,
                else "".
            digest_every: the steps between weight digests in the vote (a corrupt replica is
                fenced); 0: never.
            rejoin: whether a replica fenced while alive rejoins as a newcomer (else it raises
                `RunEnded(fenced=True)`); None: RECOVER_REJOIN ("0": off), else on.
            coordinator_timeout: seconds of coordinator silence that count as a closed
                connection; None: RECOVER_COORDINATOR_TIMEOUT, else 10.
            reconnect_timeout: seconds to keep reaching a coordinator that closed (it may be
                restarted); None: RECOVER_RECONNECT_TIMEOUT, else 60.
            link: a replica of many ranks: the leader's relay to its other ranks
                (`ReplicaContext.join` passes it); None: a one-rank replica.
            can_heal: whether a donor's state can make this process whole when it joins a
                running job (what its hello says).

        Raises:
            RunEnded: the run ended (stopped, or this replica was refused or fenced) before it began.
        """
        worker_exit.install(f"replica {replica}")  # an uncaught RunEnded: one line and its exit code
        # an accumulator (core/worker/accumulator_interface.py: any kind), or parameters
        self.acc: Accumulator = params if isinstance(params, Accumulator) else GradAccumulator(params)
        self.link = link  # a replica of many ranks: this is its leader (see the contract)
        self.can_heal = can_heal  # what the hello says: whether a donor's state can make this replica whole
        self._nonfinite = NonfiniteLosses()  # the ids folded with a loss that was not finite
        self.optimizer = optimizer
        self.replica = replica
        self.backend = backend
        self.timeout = collective_timeout
        self.stepper = CommittedStep(optimizer, self.acc.params, lr_schedule, grad_clip)
        self.hooks = hooks or WorkerHooks()
        self.hooks.attach_weights(self.acc)
        # hooks that may rewrite a vote get its dict; else the vote goes as encoded from its class
        self._votes_rewritten = type(self.hooks).outgoing_vote is not WorkerHooks.outgoing_vote
        if digest_every < 0:
            raise ValueError(f"digest_every must be >= 0 (0: never), got {digest_every}")
        self.digest_every = digest_every
        self.store_addr = store_addr
        self.store_timeout = timedelta(seconds=max(60.0, collective_timeout))
        # None: the launcher's, from the environment; it also keys every store client (_open_store)
        self.join_token = os.environ.get(JOIN_TOKEN_ENV, "") if join_token is None else join_token
        # A first client proves the store is reachable before the hello; each
        # generation's communicator then opens its own (core/worker/comm.py: a rendezvous
        # abandoned in a shared client would hold the next one up to its timeout).
        self._open_store()
        self.rejoin = os.environ.get(REJOIN_ENV, "1") != "0" if rejoin is None else rejoin
        self.control_addr = control_addr
        self.heartbeat_interval = heartbeat_interval
        # None: the launcher's, from the environment (`recover launch` sets them)
        self.coordinator_timeout = float(os.environ.get(COORDINATOR_TIMEOUT_ENV, 10.0)) \
            if coordinator_timeout is None else coordinator_timeout
        self.reconnect_timeout = float(os.environ.get(RECONNECT_TIMEOUT_ENV, 60.0)) \
            if reconnect_timeout is None else reconnect_timeout
        # a launcher that restarts the coordinator supervises this process: it brings the coordinator
        # back or ends the job (and this process), so the reconnect is bounded by the launcher's liveness
        self.supervised = os.environ.get(env_names.COORDINATOR_SUPERVISED) == "1"
        self._waiting: tuple[frozenset, int] | None = None  # what `_wait_for` waits for (a report says it)
        self._last_vote: dict | None = None  # the last vote sent (a report carries it)
        # the vote of the last step committed: a coordinator that died after sending that commit
        # and before writing its metrics line writes the line again from these (a report carries it)
        self._committed_vote: dict | None = None
        self._readmission_pending = False  # a reconnect's hello was answered "pending": no second hello
        self.tokens_per_microbatch = tokens_per_microbatch
        # A newcomer's hello says when it started waiting to be admitted (its process start, or its
        # rejoin) and whether it is a woken replica; a reconnect's hello says it again (`_reconnect`).
        self._started_at = float(os.environ.get(STARTED_ENV, time.time())) - run_start_time()
        self._woken = False
        # the training thread's units of work, carried by every heartbeat (core/worker/progress.py)
        self.meter = ProgressMeter()
        self.control = self._connect_at_start()
        self._hello(self._started_at, rejoin=False)
        self.comm: Communicator | None = None
        self.graveyard = Graveyard()
        self.generation = -1
        self.members: list[int] = []
        self.committed_members: list[int] = []  # the members of the generation that committed the last step
        self.after_step = None  # called with this replica right after each step (see the contract)
        self.member_ranges: idranges.Ranges = []  # the same, as the gen message named them (quota_of reads them)
        self.step = 0
        self.microbatches = 0
        self.steps = 0
        self._quota: list[int] = []
        self._in_quota: set[int] = set()  # the same ids: O(1) membership (fold() checks each id)
        self._abort: dict | None = None  # an abort seen between microbatches, not yet acted on
        self._unhealed = False  # admitted as a newcomer and the state has not arrived: never fold or vote
        self.healed = False  # this replica joined a running job and holds a donor's state (core/worker/state_transfer.py)
        self._digest_next_vote = False  # the first vote of an admitting generation carries the digest
        self._rejoined = False  # quota() rejoined after a fence: the next commit() only returns False
        # A lost coordinator, reported from the heartbeat thread (`_report_from_heartbeat`): the lock
        # orders that thread's report against the training thread's own reconnect and against
        # `_working` flipping; `_standby` holds a connection a restarted coordinator took a report on.
        self._reconnect_lock = threading.Lock()
        self._working = False  # inside a quota (between quota() and commit()): step, generation, wait fixed
        self._standby: tuple[ControlClient, dict] | None = None
        self._work_started = time.perf_counter()
        self._work_seconds = 0.0
        try:
            self._wait_generation(0)
        except _Fenced:  # admitted into a running job, then declared dead during the transfer
            self._rejoin()
        except RunEnded as e:
            self._relay_end(e)
            raise
        self._relay({"t": "start", **self._where()})

    @classmethod
    def from_env(cls, model_or_params, optimizer, **kw) -> "Replica":
        """Join the job the launcher set up (RECOVER_REPLICA, RECOVER_CONTROL_ADDR, RECOVER_STORE_ADDR).

        Args:
            model_or_params: a module (its parameters are trained), the parameters, or an accumulator.
            optimizer: the optimizer over those parameters; stepped only when a step commits.
            **kw: the constructor's other keyword arguments (`lr_schedule`, `grad_clip`, ...).

        Returns:
            This process's replica, a member of the job's first generation (or admitted into it).

        Raises:
            RunEnded: the run ended before it began (see the constructor).
        """
        params = model_or_params.parameters() if isinstance(model_or_params, torch.nn.Module) else model_or_params
        return cls(params, optimizer, replica=int(os.environ[env_names.REPLICA]),
                   control_addr=env_addr(env_names.CONTROL_ADDR), store_addr=env_addr(env_names.STORE_ADDR), **kw)

    # ---- the loop's view ---------------------------------------------------------------
    @property
    def done(self) -> bool:
        """True once every step of the run is committed."""
        return self.step >= self.steps

    @property
    def ledger(self) -> list[int]:
        """The ids folded since the last commit, in fold order (the accumulator's ledger)."""
        return self.acc.ledger

    def quota(self) -> Iterator[int]:
        """The ids still to fold before `commit()` (global microbatch ids), consumed lazily.

        Before handing out each id after the first, it looks (without blocking) for
        an abort of this generation; on one it stops early, so the loop goes straight
        to `commit()`, which recovers at once keeping what was folded. A survivor
        therefore answers an abort within one microbatch, not one quota: no deadline
        of the coordinator depends on how long a quota takes.

        Yields:
            The global microbatch ids to fold now, one at a time.

        Raises:
            RunEnded: the run ended for this replica while it waited.
        """
        gen = self.generation
        ids = self._still_to_fold()
        if self.link is not None and not self._announced:  # (else a commit's relay gave the ranks these ids)
            self._relay({"t": "quota", **self._next_quota(ids, self.step)})
        self._announced = False
        self._set_working(True)
        for k, i in enumerate(ids):
            try:
                if k and (self._abort is not None or self._poll_abort(gen)):
                    self._relay({"t": "stop"})
                    return
            except _Fenced:
                self._rejoin()
                self._rejoined = True  # the commit() that follows returns False: the loop asks again
                return
            except RunEnded as e:
                self._relay_end(e)
                raise
            if k:  # the ranks know the ids and take the first at once; each later one waits for this word
                self._relay({"t": "id", "id": i})
            self.meter.tick()
            yield i

    # ---- a replica of many ranks: the leader's relay ------------------------------------------
    def _where(self) -> dict:
        return {"gen": self.generation, "step": self.step, "steps": self.steps, "microbatches": self.microbatches}

    def _next_quota(self, ids: list[int], step: int) -> dict:
        """What a replica's other ranks need to fold `ids` of `step` (relayed once, not id by id):
        where the replica stands and whether the step's vote carries the weights digest, so they
        can add up their shards' bit sums while their leader waits for `go`."""
        return {"gen": self.generation, "step": step, "steps": self.steps, "microbatches": self.microbatches,
                "ids": ids, **({"digest": True} if self._digest_due(step) else {})}

    def _digest_due(self, step: int) -> bool:
        """Does step's vote carry the weights digest? Every `digest_every` steps, and the first vote
        after an admission or a rebuild (the newcomer's, or every member's, weights are checked)."""
        return bool(self.digest_every and step % self.digest_every == 0) or self._digest_next_vote

    def _relay(self, msg: dict) -> None:
        """Tell the replica's other ranks what this leader decided (nothing for a one-rank replica)."""
        if self.link is not None:
            self.link.share(msg)

    def _relay_end(self, e: "RunEnded") -> None:
        if self.link is not None:
            try:
                self.link.share({"t": "end", "reason": e.reason, "fenced": e.fenced, "code": e.code,
                                 "committed": e.committed, "members": list(self.members)})
            except Exception:  # noqa: BLE001 - a rank already gone: the launcher ends the replica anyway
                pass

    def _abort_reason(self, g: int) -> str | None:
        """Has the coordinator aborted generation g? A leader also tells its ranks' collectives."""
        reason = self.control.abort_reason(g)
        if reason is not None and self.link is not None:
            self.link.publish_abort(g, reason)
        return reason

    def _still_to_fold(self) -> list[int]:
        return [i for i in self._quota if not self.acc.has(i)]

    def fold(self, mb_id: int, loss: float) -> None:
        """Record that microbatch `mb_id`'s backward (with loss `loss`) is in the gradients.

        Args:
            mb_id: the global microbatch id, one that `quota()` gave and not folded yet.
            loss: the microbatch's loss (this rank's part of it at a replica of many ranks); a
                loss that is not finite is noted and voted on, never summed silently.

        Raises:
            ValueError: `mb_id` is not in this replica's quota, or was folded already; the
                iteration's folds are discarded and `quota()` lists them again.
            GradientDetached: a `.grad` no longer views the accumulator (`zero_grad()`, DDP); the
                iteration's folds are discarded likewise.
        """
        if mb_id not in self._in_quota or self.acc.has(mb_id):
            why = "folded twice" if self.acc.has(mb_id) else f"not in this replica's quota {self._quota}"
            self._discard_folded()  # its backward is in the accumulator already
            raise ValueError(f"microbatch {mb_id} is {why}; this iteration's folds were discarded "
                             f"(quota() lists them again)")
        self._check_attached("fold")
        self.acc.fold(mb_id, loss)
        if (why := self.acc.out_of_range.get(mb_id)) is not None:
            # --exact: a gradient outside the fixed-point range is never summed; the vote names the id
            # as it names a non-finite loss, so the step stops or is skipped (--on-nonfinite), never wrong
            self._log(f"step {self.step}: microbatch {mb_id} is outside the exact fixed-point range: {why}")
            loss = float("nan")
        self._nonfinite.record(mb_id, loss)
        self._work_seconds = time.perf_counter() - self._work_started
        self.meter.tick()

    def progress(self) -> None:
        """Say that this replica's training thread is working (cheap: one addition).

        `quota()` and `fold()` say it already. Call it from long work of your own
        between them (an evaluation, a pipeline schedule that runs many microbatches
        at once, a long save): the coordinator fences a member whose work shows no
        progress for longer than the collective timeout plus four times the longest
        gap it measured between such calls (docs/protocol.md, "Slow is not dead")."""
        self.meter.tick()

    def commit(self) -> bool:
        """Reduce, vote, and step the optimizer; False if recovery needs more work.

        Returns:
            True when the step committed (or, with --on-nonfinite skip, was skipped); False when
            a failure sent this replica into recovery: loop, and `quota()` gives the ids to redo.

        Raises:
            RunEnded: the run ended for this replica (stopped, fenced without rejoin, or the
                coordinator gone); its `code` is the exit code.
            GradientDetached: a `.grad` no longer views the accumulator; the iteration's folds
                are discarded and `quota()` lists them again.
            RuntimeError: an id of the quota was not folded (and no abort stopped the quota early).
        """
        self._set_working(False)
        if self._rejoined:
            self._rejoined = False
            return False
        try:
            return self._commit()
        except _Fenced:
            self._rejoin()
            return False
        except RunEnded as e:
            self._relay_end(e)
            raise

    def _commit(self) -> bool:
        """The commit protocol's steps, in order; each exit is one of the returns below (False: an
        abort, or a failed reduction, sent this replica into recovery with what it folded kept)."""
        self._announced = False  # a loop that called commit() without quota(): the ranks are told anew
        if (abort := self._abort or self._pending_abort()) is not None:
            return self._recover_replica(abort)  # what was folded so far is kept
        self._check_quota_folded()
        g, step = self.generation, self.step
        self._send_ready(g, step)
        digest = self._digest_due(step)
        bit_sums, fingerprint = self._read_vote_weights(digest)
        if (abort := self._wait_go(g)) is not None:
            return self._recover_replica(abort)
        reduction = self._reduce(g, step, digest)
        loss_sum, fingerprint = self._combine_in_replica(g, reduction, bit_sums, fingerprint)
        if reduction.failure is not None:
            return self._recover_replica(self._report_failure(g, step, reduction.failure))
        self._vote(g, step, loss_sum, digest, fingerprint)
        verdict = self._wait_verdict(step)
        if verdict["t"] == "abort":
            return self._recover_replica(verdict)
        commit = Commit.from_wire(verdict)
        next_quota = self._relay_commit(commit, step)
        self._apply_step(commit, step, reduction)
        if self.after_step is not None:
            self.after_step(self)
        self._start_next_step(commit, next_quota)
        return True

    # ---- the commit's steps, in the order `_commit` takes them ------------------------------------
    def _recover_replica(self, abort: dict) -> bool:
        """Leave the step for recovery: the replica's ranks first (they recover too), then this one; False."""
        self._relay({"t": "recover"})
        return self._recover(abort)

    def _check_quota_folded(self) -> None:
        """Refuse a commit before the whole quota is folded, or with a .grad that left the accumulator."""
        if missing := self._still_to_fold():
            raise RuntimeError(f"commit() before folding the whole quota; still to fold: {missing}")
        self._check_attached("commit")

    def _send_ready(self, g: int, step: int) -> None:
        """Tell the coordinator this replica folded its quota of `step` (readiness, core/coordinator/readiness.py).

        The all-reduce starts once every member folded its quota, so its deadline times the
        collective alone, however long the peers' quotas take; the wait for `go` has no deadline of
        its own (a peer that dies is seen by the coordinator, whose abort ends it; a coordinator that
        dies, by its silence)."""
        self.control.send_line(Ready(g, step).to_line())

    def _read_vote_weights(self, digest: bool) -> tuple[torch.Tensor | None, str | None]:
        """The weights this step's gradient came from, when the vote carries them (`digest`): this
        rank's bit sums at a replica of many ranks (the combine adds them up), else the fingerprint.

        A replica off the majority is corrupt (and after an admission: the newcomer's weights are
        the members'). They do not change before the optimizer step, so they are read here, while
        `ready` travels and the others finish their quotas, not after the all-reduce."""
        if not digest:
            return None, None
        if self.link is not None:
            return self.acc.weights_bit_sums(), None  # this rank's part of the replica's (the combine below)
        return None, self.acc.weights_fingerprint()

    def _wait_go(self, g: int) -> dict | None:
        """Wait, with no deadline of its own (see `_send_ready`), until every member is ready: None
        on `go`, the abort when the coordinator aborts generation g instead."""
        go = self._wait_for({"go", "abort"}, min_gen=g, forever=True)
        return go if go["t"] == "abort" else None

    def _reduce(self, g: int, step: int, digest: bool) -> _Reduction:
        """All-reduce a fresh copy of the accumulator (and an exact one's wide sums, when a member
        folded a spike) with the generation's members; a failure is returned, never raised, and
        never touches the accumulator. The replica's ranks are told first (they reduce their
        shards alike, and add their bit sums to the combine when `digest`)."""
        should_abort = lambda: self._abort_reason(g)  # noqa: E731
        rank = self.members.index(self.replica)
        self._relay({"t": "reduce", "gen": g, "rank": rank, "size": len(self.members),
                     **({"digest": True} if digest else {})})
        buf = self.acc.pack()
        wide = None  # an exact accumulator's wide sums, when the step has a spike
        failure: CollectiveError | None = None
        try:
            if self.comm is None or self.comm.generation != g:
                self.comm = Communicator.build(self._open_store, g, rank, len(self.members), self.backend,
                                               self.timeout, should_abort,
                                               namespace="" if self.link is None else "pos0/")
            self.comm.allreduce(buf, self.timeout, should_abort,
                                while_in_flight=lambda: self.hooks.at(step, "allreduce"))
            if self.acc.wide_needed(buf):
                # an exact accumulator, and a member folded a spike: every member read the same
                # count, so all reduce the wide sums too (core/worker/exact.py); a failure here is the same
                wide = self.acc.pack_wide()
                self.comm.allreduce(wide, self.timeout, should_abort)
        except CollectiveError as e:
            self._abandon_comm()  # never reuse a communicator that failed
            self._log(f"step {step}: {e}")
            failure = e
        return _Reduction(buf, wide, failure)

    def _combine_in_replica(self, g: int, reduction: _Reduction, bit_sums: torch.Tensor | None,
                            fingerprint: str | None) -> tuple[float, str | None]:
        """The vote's loss sum and weights fingerprint, for the whole replica: a one-rank replica's
        own; a replica of many ranks adds its ranks' (`ReplicaLink.combine`), and a failure of any
        rank's all-reduce becomes `reduction.failure` here, so every rank of it recovers alike."""
        loss_sum = self.acc.reduced_loss_sum(reduction.buf)
        if self.link is None:
            return loss_sum, fingerprint
        # every rank's all-reduce must have succeeded; the vote carries the replica's whole loss, and
        # its fingerprint is of every rank's shard (the ranks' bit sums, added in the same all-reduce)
        ok, loss_sum, slots = self.link.combine(reduction.failure is None, loss_sum,
                                                while_waiting=lambda: self._abort_reason(g),
                                                bit_sums=bit_sums)
        if slots is not None:
            fingerprint = fingerprint_of(slots)  # core/parallel/replica_link.py from_chunks
        if not math.isfinite(loss_sum):
            # a loss part of another rank's rows may be the one that is not finite: the vote names
            # its ids as this rank's own (every rank reads this sum, so all of them take part)
            self._nonfinite.mark(self.link.nonfinite_ids(list(self.acc.ledger),
                                                         self._nonfinite.held(self.acc.ledger)))
        if ok is False and reduction.failure is None:
            reduction.failure = CollectiveError(g, "the all-reduce of another rank of this replica failed")
        return loss_sum, fingerprint

    def _report_failure(self, g: int, step: int, failure: CollectiveError) -> dict:
        """Tell the coordinator the reduction failed (unless it aborted g already); its abort, once it comes."""
        if self.control.abort_reason(g) is None:
            self.control.send({"t": "fail", "gen": g, "step": step, "reason": failure.reason})
        return self._wait_for({"abort"})

    def _vote(self, g: int, step: int, loss_sum: float, digest: bool, fingerprint: str | None) -> None:
        """Send the replica's vote for `step`: its ledger, loss sum (or non-finite ids), learning rate,
        progress, and the weights fingerprint when `digest`; remembered for a report."""
        self.hooks.at(step, "vote")
        n = len(self.acc.ledger)
        loss = vote_fields(loss_sum, self.acc.ledger, self._nonfinite)
        vote = Vote(g, step, True, idranges.from_ids(self.acc.ledger), loss["loss_sum"],
                    mb_seconds=self._work_seconds / n if n else 0.0, progress_gap=self.meter.take_gap(),
                    lr=self.stepper.lr(step), weights_fingerprint=fingerprint if digest else None,
                    nonfinite=loss.get("nonfinite"))
        if vote.nonfinite is not None:
            self._log(f"step {step}: non-finite loss at microbatch(es) {idranges.to_ids(vote.nonfinite)}")
        if digest:
            self._digest_next_vote = False
        self._last_vote = {"gen": g, "step": step, "ledger": vote.ledger, "loss_sum": vote.loss_sum, "lr": vote.lr}
        if self._votes_rewritten:  # a fault plan's bad_vote rewrites the wire dict: the hook sees what is sent
            self.control.send(self.hooks.outgoing_vote(vote.to_wire()))
        else:
            self.control.send_line(vote.to_line())

    def _wait_verdict(self, step: int) -> dict:
        """The coordinator's verdict on the votes: `commit` (every member voted for exactly the
        iteration's ids) or `abort`."""
        self.hooks.at(step, "commit")
        return self._wait_for({"commit", "abort"})

    def _relay_commit(self, commit: Commit, step: int) -> dict | None:
        """Tell the replica's ranks the step commits (skipped or not, and generation g's members: the
        checkpoint writer's rule); returns step+1's quota when it rode along.

        step+1's quota rides on the commit's relay when nothing can come between (no admission, not
        the last step): the ranks then start it without waiting for their leader's quota()."""
        next_quota = None
        if self.link is not None and commit.next is None and step + 1 < self.steps:
            next_quota = self._next_quota(idranges.to_ids(self._commit_quota(commit)), step + 1)
        self._relay({"t": "commit", "microbatches": self.microbatches, "skipped": bool(commit.skipped),
                     "members": list(self.members),  # generation g's: the checkpoint writer's rule
                     **({"quota": next_quota} if next_quota is not None else {})})
        return next_quota

    def _apply_step(self, commit: Commit, step: int, reduction: _Reduction) -> None:
        """Step the optimizer with the reduced mean (or skip the step, --on-nonfinite skip), empty the
        accumulator and count the step: from here the replica holds step+1's weights."""
        self._committed_vote = self._last_vote
        self.hooks.at(step, "optimizer_step")
        if commit.skipped:  # its loss was not finite (--on-nonfinite skip): no update, the schedule moves on
            self._log(f"step {step} skipped: its loss was not finite")
            self.stepper.skip(step)
        else:  # (at a replica of many ranks, its loss came with the combine)
            load_reduced(self.acc, reduction.buf, self.microbatches, reduction.wide,
                         loss_combined=self.link is not None)
            self.stepper(step)
        self.acc.clear()
        self.step = step + 1
        self.committed_members = list(self.members)  # generation g's: an admission switches `members` below

    def _start_next_step(self, commit: Commit, next_quota: dict | None) -> None:
        """Where the replica goes after a commit: the run's end (wait for `done`), an admitting
        generation, or step+1's quota (already relayed to the ranks when `next_quota`)."""
        if self.done:
            self._await_done()
        elif commit.next is not None:  # step+1 belongs to an admitting generation
            self._wait_generation(commit.next)
        else:
            self._set_quota(self._commit_quota(commit))
            self._announced = next_quota is not None

    def _commit_quota(self, commit: Commit) -> list[list[int]]:
        """This replica's quota of step+1, as a commit gives it (core/contract/policy.py `quota_in`)."""
        return quota_in(commit.quota, commit.split, self.member_ranges, self.replica)

    def _await_done(self) -> None:
        """After the last commit: stay for the coordinator's `done`, which it sends once the
        commit is recorded. A coordinator killed between sending the last commit and writing
        its line is restarted with no one to ask if the workers had exited; waiting, they
        reconnect with their reports (through `_terminal`) and the restarted one writes the
        line and says done (protocol `rebuild`, every step committed). This replica's step is committed
        whatever follows, so no ending here reaches the caller's `commit()`: it is logged."""
        try:
            self._wait_for(set())
        except RunEnded as e:
            self._log("run complete: every step is committed and recorded" if e.reason == "run complete"
                      else f"after the last commit: {e.reason}")
        except _Fenced:  # a coordinator that no longer counts it: nothing is left to rejoin
            self._log("after the last commit: the coordinator closed this replica's connection")

    def stop_run(self, reason: str) -> None:
        """End the run for a reason of this replica's own (protocol `stop_run`): every
        replica hears `stop`, and this one's closing connection is not taken for a loss.

        Args:
            reason: why the run ends (the coordinator records it as the run's end).
        """
        self.control.send({"t": "stop_run", "reason": reason})

    def adopt_committed_count(self, state: dict) -> None:
        """Start from a checkpoint's committed count (its LR schedule and step: `CommittedStep`'s
        state_dict), before the first step. A newcomer healed from a donor already holds a newer one.

        Args:
            state: the checkpoint's `CommittedStep.state_dict()`.
        """
        self.stepper.load_state_dict(state)

    def close(self) -> None:
        """Close the connection to the coordinator (and a leader's relay to its ranks); call it after the loop."""
        if self.link is not None:
            self.link.close()
        self.control.close()

    def _hello(self, started_at: float, rejoin: bool, report: dict | None = None,
               client: ControlClient | None = None, standby: bool = False) -> None:
        """Say who this replica is (on `client`, else the current connection); `can_heal`: it can be
        admitted into a running job. A `standby` hello (the heartbeat thread's report) carries no
        weights digest: only generation 0 compares them, and hashing every weight off the training
        thread would compete with it for nothing."""
        (client or self.control).send({
            "t": "hello", "replica": self.replica, "pid": os.getpid(), "tokens_per_mb": self.tokens_per_microbatch,
            **({"standby": True} if standby else {"weights_sha256": self.acc.weights_digest()}),
            "token": self.join_token, "can_heal": self.can_heal, "rejoin": rejoin, "started_at": started_at,
            **({"report": report} if report is not None else {})})

    def _set_working(self, working: bool) -> None:
        with self._reconnect_lock:
            self._working = working

    def _report_from_heartbeat(self, lost: ControlClient) -> None:
        """The heartbeat thread of a connection that was lost: report to a restarted coordinator now.

        A worker's training thread sees a lost coordinator only at its next unit of work; a
        restarted coordinator then waits for its report as long as that unit may take. This
        thread reports at once instead, while the training thread works inside a quota, where
        what a report says (member, step, generation, its last votes, waiting for nothing) does
        not change until `commit()`, which takes the lock first. The hello says `standby`: a
        coordinator that did not die (it closed the connection on purpose, saying why on it)
        closes this one without a word, and the training thread reads why on the old one. A
        restarted one takes the report and answers "rebuilt"; the connection waits in
        `_standby` until the training thread, noticing the loss itself, adopts it in
        `_reconnect`. The training thread reconnecting by itself (outside a quota, or first)
        holds the lock, and this thread then leaves it to that."""
        deadline = float("inf") if self.supervised else time.monotonic() + self.reconnect_timeout
        delay = 0.05
        while time.monotonic() < deadline and self.control is lost and self._standby is None:
            if self._working and self._reconnect_lock.acquire(blocking=False):
                try:
                    if not self._working or self.control is not lost or self._standby is not None:
                        return
                    try:
                        client = self._connect(connect_timeout=max(0.1, min(5.0, deadline - time.monotonic())))
                    except OSError:
                        client = None
                    if client is not None:
                        self._hello(time.time() - run_start_time(), rejoin=True, report=self._report(),
                                    client=client, standby=True)
                        answer = client.recv(RECONNECT_ANSWER_SECONDS)
                        if answer is not None and answer["t"] == "rebuilt":
                            self._standby = (client, answer)
                            self._log(f"step {self.step}: the coordinator was lost; its restart took this "
                                      f"replica's report from the heartbeat thread, mid-quota")
                            return
                        client.close()  # not restarted yet (or never died): try again, or leave it
                finally:
                    self._reconnect_lock.release()
            time.sleep(delay)
            delay = min(2 * delay, 1.0)

    def _connect(self, connect_timeout: float = 60.0) -> ControlClient:
        return ControlClient(*self.control_addr, heartbeat_interval=self.heartbeat_interval,
                             connect_timeout=connect_timeout, silence_limit=self.coordinator_timeout,
                             progress=self.meter, on_lost=self._report_from_heartbeat)

    def _connect_at_start(self) -> ControlClient:
        """The first connection; a coordinator being restarted refuses it for a moment, so retry."""
        deadline = float("inf") if self.supervised else time.monotonic() + self.reconnect_timeout
        while True:
            try:
                return self._connect(connect_timeout=max(0.1, min(60.0, deadline - time.monotonic())))
            except OSError as e:
                if time.monotonic() >= deadline:
                    raise RunEnded(f"the coordinator is gone: cannot reach it at start-up within "
                                   f"{self.reconnect_timeout:g}s ({e})", code=worker_exit.EXIT_COORDINATOR_GONE) from None
                time.sleep(0.2)

    def _report(self) -> dict:
        """Where this replica stands, for a restarted coordinator (protocol `ProtocolStateMachine.rebuild`)."""
        kinds, awaiting = self._waiting or (frozenset(), -1)
        vote = self._last_vote
        wait = ""
        if kinds == {"gen"}:
            wait = "gen"
        elif "commit" in kinds and vote is not None and vote["step"] == self.step and vote["gen"] == self.generation:
            wait = "commit"  # voted: it holds the reduced gradient of this step
        return {"member": self.generation >= 0 and not self._unhealed, "step": self.step, "gen": self.generation,
                "ledger": idranges.from_ids(self.acc.ledger), "wait": wait,
                "awaiting": awaiting if wait == "gen" else None, "vote": vote,
                "committed_vote": self._committed_vote}

    def _reconnect(self) -> dict | None:
        """The connection closed: reach the coordinator again, with a report; its first answer.

        None when no coordinator answered within `reconnect_timeout`. The answer is
        "rebuilt" (a restarted coordinator: go on where this replica was), "pending"
        (a live one that declared it dead: rejoin), "refused", or done/stop. A connection
        closed without an answer is a coordinator dying again: the next try goes on. A report
        the heartbeat thread already made (`_report_from_heartbeat`) is adopted: its connection
        and its answer."""
        with self._reconnect_lock:
            return self._reconnect_locked()

    def _reconnect_locked(self) -> dict | None:
        self.control.close()
        if self._standby is not None:
            client, answer = self._standby
            self._standby = None
            if not client.closed.is_set():
                self.control = client
                return answer
            client.close()
        deadline = float("inf") if self.supervised else time.monotonic() + self.reconnect_timeout
        delay = 0.05
        self._log(f"step {self.step}: the connection to the coordinator closed; reconnecting ("
                  + ("until the launcher restarts it or ends the job" if self.supervised
                     else f"for up to {self.reconnect_timeout:g}s") + ") with a report of where this replica stands")
        while True:
            try:
                client = self._connect(connect_timeout=max(0.1, min(5.0, deadline - time.monotonic())))
            except OSError:
                client = None
            if client is not None:
                self.control = client
                # a process in no generation waits for admission: it stays what it was (a restarted
                # coordinator keeps it waiting, protocol `rebuild`); a member that is told "pending"
                # was declared dead, as a woken replica
                member = self.generation >= 0
                self._hello(time.time() - run_start_time() if member else self._started_at,
                            rejoin=member or self._woken, report=self._report())
                answer = client.recv(RECONNECT_ANSWER_SECONDS)
                if answer is not None and answer["t"] != "closed":
                    return answer
                client.close()
            if time.monotonic() >= deadline:
                return None
            time.sleep(delay)
            delay = min(2 * delay, 1.0)

    def _open_store(self) -> dist.Store:
        """A new client of the coordinator's store, for one generation's communicator."""
        client = dist.TCPStore(self.store_addr[0], self.store_addr[1], is_master=False, timeout=self.store_timeout)
        return keyed_store(client, self.join_token)

    def _log(self, text: str) -> None:
        # The replica's log (DIR/logs/replica<r>.log): what this replica saw, in its words.
        print(f"[replica {self.replica}] {text}", file=sys.stderr, flush=True)

    # ---- refusals --------------------------------------------------------------------
    def _discard_folded(self) -> None:
        """Zero the accumulator and re-attach .grad; the ids folded this iteration are owed again."""
        owed = list(self.acc.ledger) + [i for i in self._quota if not self.acc.has(i)]
        self.acc.clear()
        self.acc.reattach()
        self._quota, self._in_quota = owed, set(owed)

    def _check_attached(self, where: str) -> None:
        if not (detached := self.acc.detached()):
            return
        first = self.acc.params[detached[0]]
        self._discard_folded()
        raise GradientDetached(
            f"{where}(): the .grad of {len(detached)} of {len(self.acc.params)} parameters (first: #{detached[0]}, "
            f"shape {tuple(first.shape)}) no longer views replica {self.replica}'s gradient accumulator, so "
            "backward() wrote where no reduction reads. Something removed or replaced .grad: "
            "optimizer.zero_grad() (it sets .grad to None by default) or a DDP/FSDP wrapper. Call neither: "
            "commit() clears the gradients and reduces across replicas itself. This iteration's folds were "
            "discarded (quota() lists them again)."
        )

    # ---- recovery ------------------------------------------------------------------------
    def _recover(self, abort: dict) -> bool:
        """Rejoin the next generation with the ledger kept; take the redo quota."""
        self._abort = None
        self._abandon_comm()
        if abort["step"] != self.step:
            # Messages arrive in the order they were sent, so this is a coordinator bug:
            # rejoining at the wrong step would mix two iterations' gradients.
            raise RunEnded(f"protocol: the coordinator aborted step {abort['step']} "
                           f"while this replica is at step {self.step}")
        self.control.send({"t": "join", "gen": abort["next"], "step": self.step,
                           "ledger": idranges.from_ids(self.acc.ledger), "healed": not self._unhealed})
        self._wait_generation(abort["next"])
        return False

    def _rejoin(self) -> None:
        """Declared dead while alive (a freeze, a long pause): join again as a newcomer.

        What this replica folded belongs to a generation it is no longer in (its ids
        were redone by the survivors), so it is dropped; so is the old connection and
        communicator. The new hello goes on a new connection; the state comes from a
        donor at admission, as for a replacement."""
        self._log("fenced: the coordinator closed this replica's connection (declared dead, e.g. after a "
                  "freeze); rejoining as a newcomer")
        self._relay({"t": "rejoin"})  # its ranks drop what they folded too, and leave the step they were in
        self._abandon_comm()
        self.acc.clear()
        self._abort = None
        self._quota, self._in_quota = [], set()
        self._woken = True
        self._started_at = time.time() - run_start_time()
        while True:
            self.generation = -1  # a member of nothing (its report says so)
            self._unhealed = False
            if self._readmission_pending:  # the reconnect's hello was answered "pending" already
                self._readmission_pending = False
                self.control.put_back({"t": "pending", "step": self.step})
            else:
                self.control.close()
                try:
                    self.control = self._connect()
                except OSError as e:
                    raise RunEnded(f"the coordinator is gone: cannot reach it to rejoin ({e})",
                                   code=worker_exit.EXIT_COORDINATOR_GONE) from None
                self._hello(self._started_at, rejoin=True)
            try:
                self._wait_generation(0)
                return
            except _Fenced:  # admitted, then declared dead again during the transfer: once more
                self._relay({"t": "rejoin"})
                self._abandon_comm()

    def _heal(self, heal: dict) -> None:
        """An admitting generation: the donor sends its state to the newcomers, who check it.

        A replica of many ranks: each rank moves its own position's shard (optimizer state
        too) over a group of its own, all positions at once; the leader relays the heal to its
        ranks first, and reports "healed" only once every rank checked its shard's fingerprint
        against the donor's rank at its position (`ReplicaLink.agree_healed`)."""
        joining = idranges.to_ids(heal["joining"])
        donor = int(heal["donor"])
        self._digest_next_vote = True
        if self.replica != donor and self.replica not in joining:
            return  # the other members fold at once
        group = [donor, *joining]
        g = self.generation
        should_abort = lambda: self._abort_reason(g)  # noqa: E731
        self._unhealed = self.replica in joining
        self._relay({"t": "heal", "gen": g, "step": self.step, "rank": group.index(self.replica),
                     "size": len(group), "donor": donor})
        self.hooks.at(self.step, "state_transfer")
        stats, why = None, None
        try:
            # A group of the donor and the newcomers only, under the generation's prefix:
            # the other members go on folding while the bytes move.
            stats = transfer_position(self._open_store, g, group.index(self.replica), len(group),
                                      None if self.link is None else 0, self.backend, self.acc, self.optimizer,
                                      self.stepper, self.timeout, should_abort, self.graveyard,
                                      progress=self.meter.tick)
        except (RunEnded, _Fenced):
            raise
        except Exception as e:  # noqa: BLE001 - any failure of the transfer is a failed transfer
            # Not only a collective's: the layout code refusing a state (a TypeError for a
            # non-fp32 optimizer state), a header that does not match. The donor keeps its own
            # state (it only read it) and goes on; the newcomer holds nothing it may trust and
            # waits for the next commit (and is refused after --max-heal-attempts).
            why = e.reason if isinstance(e, CollectiveError) else f"{type(e).__name__}: {e}"[:500]
        shards = None
        if self.link is not None:  # every rank's transfer, each checked at its own position
            ok, shards = self.link.agree_healed(why is None, "" if stats is None else stats.fingerprint,
                                                0 if stats is None else stats.bytes,
                                                0.0 if stats is None else stats.seconds,
                                                while_waiting=lambda: self._abort_reason(g))
            if not ok and why is None:
                why = "the state transfer of another rank of this replica failed (its log says why)"
        if why is not None:
            self._log(f"step {self.step}: state transfer {'to this replica' if self._unhealed else 'from it'} in "
                      f"generation {g} failed: {why}")
            if self.control.abort_reason(g) is None:
                self.control.send({"t": "fail", "gen": g, "step": self.step, "reason": f"state transfer: {why}"})
            self._recover(self._wait_for({"abort"}))
            return
        moved, seconds, fingerprint = stats.bytes, stats.seconds, stats.fingerprint
        if shards is not None:  # the replica's: every position's bytes, the slowest position's time
            moved, seconds = sum(r["bytes"] for r in shards), max(r["seconds"] for r in shards)
            if self._unhealed:  # the replica's fingerprint, as its votes compute it (every rank's bit sums)
                _, _, slots = self.link.combine(True, 0.0, while_waiting=lambda: self._abort_reason(g),
                                                bit_sums=self.acc.weights_bit_sums())
                fingerprint = fingerprint_of(slots)
            peer = f"from replica {donor}" if self._unhealed else f"to {joining}"
            self._log(f"step {self.step}: state transfer {peer}, every position at once: shard fingerprints by rank "
                      f"{json.dumps([r['fingerprint'] for r in shards])}, seconds by rank "
                      f"{json.dumps([round(r['seconds'], 4) for r in shards])}")
        if self._unhealed:
            self._unhealed = False
            self.healed = True
            self._log(f"healed from replica {donor}: {moved} bytes in {seconds:.3f}s, "
                      f"weights fingerprint {fingerprint[:12]}")
            self.control.send({"t": "healed", "gen": g, "step": self.step, "donor": donor, "bytes": moved,
                               "seconds": seconds, "weights_fingerprint": fingerprint,
                               **({"shard_fingerprints": {str(i): r["fingerprint"] for i, r in enumerate(shards)}}
                                  if shards is not None else {})})
        self._work_started = time.perf_counter()  # the transfer is not microbatch time

    def _abandon_comm(self) -> None:
        self.graveyard.bury(self.comm)
        self.comm = None

    def _wait_generation(self, gen: int) -> None:
        msg = self._wait_for({"gen"}, min_gen=gen)
        self.generation = msg["gen"]
        self.member_ranges = msg["members"]
        self.members = idranges.to_ids(self.member_ranges)
        self.step = msg["step"]
        self.microbatches = msg["microbatches"]
        self.steps = msg["steps"]
        self._set_quota(quota_of(msg, self.member_ranges, self.replica))
        if msg.get("digest"):  # a rebuilt generation: its first votes show the weights
            self._digest_next_vote = True
        if msg.get("heal"):
            self._heal(msg["heal"])

    def _set_quota(self, quota: list[list[int]]) -> None:
        self._quota = idranges.to_ids(quota)  # on the wire as id ranges
        self._in_quota = set(self._quota)
        self._work_started = time.perf_counter()
        self._work_seconds = 0.0

    def _poll_abort(self, gen: int) -> bool:
        """Cheap check between microbatches: has generation `gen` been aborted?"""
        if self.control.abort_reason(gen) is None:
            return False
        self._abort = self._pending_abort()
        return self._abort is not None

    def _pending_abort(self) -> dict | None:
        while (msg := self.control.recv(0)) is not None:
            if self._terminal(msg):
                continue
            if msg["t"] == "abort" and msg["gen"] >= self.generation:
                return msg
        return None

    def _terminal(self, msg: dict) -> bool:
        """Raise RunEnded for messages that end this replica's run."""
        kind = msg["t"]
        if kind == "done":
            self.step = max(self.step, self.steps)
            raise RunEnded("run complete", code=worker_exit.EXIT_COMPLETE)
        if kind == "stop":
            raise RunEnded(f"run stopped by the coordinator: {msg['reason']}", committed=msg.get("committed"))
        if kind == "fenced":  # declared dead (a freeze, a long pause): the coordinator said so, then closed
            if self.rejoin and self.generation >= 0:
                raise _Fenced()
            raise RunEnded(f"fenced: {msg.get('reason', 'the coordinator declared this replica dead')}", fenced=True)
        if kind == "refused":
            raise RunEnded(f"refused by the coordinator: {msg.get('reason', '')}", fenced=True)
        if kind == "closed":  # closed without a word: the coordinator died (or froze); reach its restart
            answer = self._reconnect()
            if answer is None:
                raise RunEnded(f"the coordinator is gone: no answer within {self.reconnect_timeout:g}s of reconnecting",
                               code=worker_exit.EXIT_COORDINATOR_GONE)
            if answer["t"] == "rebuilt":
                if answer.get("heartbeat_interval"):
                    self.control.heartbeat_interval = float(answer["heartbeat_interval"])
                self._log(f"step {self.step}: a restarted coordinator took this replica's report")
                return True  # the wait goes on, on the new connection
            if answer["t"] == "startup" and self.generation < 0:
                # Start-up is still on and this replica was in no generation: its first
                # connection closed before the coordinator read its hello (under a flood of
                # connections without a hello the oldest is closed, and a loaded worker's hello
                # can come after 256 strangers'; seen in a suite). The reconnect's hello counted
                # it in: wait on for generation 0, on the new connection.
                self.control.put_back(answer)
                return True
            if answer["t"] == "pending" and (self.rejoin or self.generation < 0):
                self._readmission_pending = True
                raise _Fenced()
            if answer["t"] in ("done", "stop", "refused"):
                return self._terminal(answer)
            raise RunEnded(f"fenced: the coordinator answered the reconnect with {answer['t']!r}", fenced=True)
        return False

    def _wait_for(self, kinds: set[str], min_gen: int = -1, forever: bool = False) -> dict:
        """The next message of one of `kinds` (of generation `min_gen` or later), handling the
        terminal ones on the way. `forever`: no deadline (the answer depends on how long the
        peers' work takes, not on the coordinator; its silence still ends the wait)."""
        self._waiting = (frozenset(kinds), min_gen)
        try:
            return self._wait_for_inner(kinds, min_gen, forever)
        finally:
            self._waiting = None
            self.meter.resume()  # a wait on the coordinator is not a gap in this replica's work

    def _wait_for_inner(self, kinds: set[str], min_gen: int, forever: bool) -> dict:
        # The coordinator answers within a collective deadline plus a rejoin
        # deadline even in the worst case; past that it is gone.
        deadline = float("inf") if forever else time.monotonic() + 3 * self.timeout + 60
        while True:
            msg = self.control.recv(None if deadline == float("inf") else max(0.0, deadline - time.monotonic()))
            if msg is None and self.control.coordinator_beats:
                # It beats, so it is alive: its answer waits on the peers' work (a generation forming
                # around a member that finishes a long schedule), which no fixed time bounds. Its
                # silence, judged by the client, still ends the wait.
                deadline = time.monotonic() + 3 * self.timeout + 60
                continue
            if msg is None:
                raise RunEnded("no word from the coordinator", code=worker_exit.EXIT_COORDINATOR_GONE)
            if self._terminal(msg):
                continue
            if msg["t"] == "pending":
                # Admission comes at the next commit, however long the iteration in
                # flight takes (this process cannot know); a coordinator that dies
                # closes the connection, which ends the wait.
                deadline = float("inf")
                self._log(f"waiting at step {msg['step']} for admission at an iteration boundary")
                continue
            if msg["t"] == "startup":
                # The coordinator's start-up deadline is the one source: it says how long
                # it may still wait for the other replicas; answering takes it a moment more.
                deadline = max(deadline, time.monotonic() + float(msg["wait"]) + STARTUP_ANSWER_SECONDS)
                if msg.get("heartbeat_interval"):  # stretched for a large run (core/contract/heartbeat.py)
                    self.control.heartbeat_interval = float(msg["heartbeat_interval"])
                self._log(f"connected; replicas connected {msg['connected']}/{msg['of']}, "
                          f"start-up ends within {float(msg['wait']):.0f}s")
                continue
            if msg["t"] in kinds and msg.get("gen", min_gen) >= min_gen:
                if msg["t"] == "abort" and msg["gen"] < self.generation:
                    continue
                return msg
