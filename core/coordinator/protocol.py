"""The membership and commit protocol, as a pure state machine (no I/O, no clocks).

This is the coordinator's brain, `ProtocolStateMachine`. `coordinator_service.py`
(`CoordinatorService`: the sockets, heartbeats and files) feeds it what arrives on
the wire (and the time); it answers with `Out` actions to carry out. Because it is
pure, the property tests drive it through arbitrary interleavings of failures
with an in-process fake transport.

Invariants it keeps:
- An iteration t commits only when every member of the current generation has
  voted ok for (t, generation) and the members' ledgers are disjoint and their
  union is exactly `iteration_ids(t, M)`. So every committed gradient is the sum
  over exactly the M ids of iteration t, each once, whatever failed.
- Every membership change (a death, a failed collective, a missed rejoin, an
  admission) bumps the generation. Messages carrying another generation are
  ignored, and a replica declared dead is closed: a frozen replica that wakes up
  is fenced out of every later reduction and vote of the connection it had.
- Admission (a replacement process, or a fenced replica that woke up and said
  hello again on a new connection): a hello for a dead replica's slot that says
  it can be healed (`can_heal`) makes it a newcomer. Newcomers are admitted only
  at a commit, never inside an iteration: the commit of step t is followed by a
  new generation of the members plus the newcomers for step t+1, whose gen
  message names one donor (the fastest member) to send them its state
  (core/worker/state_transfer.py). Until a newcomer reports its state arrived ("healed",
  or a vote, or a join saying so) it is unhealed: if the generation fails first,
  its join says `healed: false` and it goes back to waiting for the next commit,
  so a replica without the committed state never folds, votes or survives into
  a generation. After `max_heal_attempts` such failures it is refused (a
  "join_refused" record), never re-admitted as that process: a state that cannot
  be sent would otherwise fail a generation at every commit, forever. The first vote of every member in an admitting generation
  carries a weights digest, so a newcomer off the members' digest is fenced
  before its gradient counts. A process fenced on evidence (corrupt weights, a
  persistent fault) is never readmitted; a new process in its slot is.
- A step whose votes carry weights digests commits only if they all agree; the
  members off a strict majority are fenced (as dead) first, and with no strict
  majority the run stops: no gradient from corrupt weights is committed.
- After a failure the survivors keep their ledgers; the new generation's quotas
  cover exactly the ids that no survivor's ledger holds (the work that died),
  split by the quota policy over the survivors' measured speeds.
- Persistent faults end in exclusion, never a livelock. Each failed generation
  implicates at most one member (see `_implicated`); a member implicated in
  `fence_after` consecutive failed generations (no commit between, no other
  member implicated in between) is fenced like a lost replica, with a "fenced"
  record naming the generations; a commit clears every count. After
  `max_failed_generations` consecutive failed generations without a commit the
  run stops (exit 1) with a reason saying so, whatever the attribution.
- Slow is not dead. A member is lost when its connection closes or its
  heartbeats stop, never because it, or a peer, takes long to fold a quota: a
  member that folded its quota says `ready`, and only once every member of the
  generation is ready does the coordinator say `go` (one message for all). The
  worker builds the generation's communicator and starts the all-reduce after
  `go`, so the collective deadline times the collective alone, from the moment
  every member can take part in it. Why a round of its own, not a deadline that
  starts when the all-reduce is issued: gloo's own timeouts (its rendezvous and
  its collectives) start when the operation is issued, and an abandoned gloo
  operation holds its process group until that timeout, so the only way to make
  the deadline mean the collective is not to issue it before the peers are
  there. The round costs one control round trip per step (a few hundred
  microseconds on loopback, against a step of tens of milliseconds at least).
- A vote is bounded too: once every other member has voted for the step (their
  all-reduce completed, so this member's did as well), the last one has
  `join_timeout` plus four times what the others took from `go` to vote; a member
  that misses it (a training thread blocked in a user's schedule or a device
  sync, while its heartbeat thread beats on) is declared dead and its share
  redone, like any lost replica.
- Liveness and progress are two signals. A heartbeat says a process is alive; its
  `p` (the training thread's count of units of work: core/worker/progress.py) says
  whether its work moves, and any other message from a member is progress too
  (`on_progress`). A member owes work while the step runs and it has not said
  `ready` (its quota, and before that the last step's optimizer step), and while
  a generation forms and it has not rejoined; waiting on the coordinator owes
  nothing. A member that owes work and shows no progress for longer than its
  bound is declared dead and its share redone: the bound is `join_timeout` plus
  four times the longest gap between two units of its work that it measured
  itself (each vote's `progress_gap`, the largest seen), so a replica slow but
  progressing is never fenced, whatever its speed, and one stuck (a device sync
  that never returns, a stalled rank its leader waits on) is, at any phase. Until
  its first vote a member has no measure, and start-up's rules judge it. A forming
  generation waits for a member that keeps progressing (a pipeline schedule
  finishing its quota before it can rejoin) instead of removing it at a fixed
  deadline.
- A non-finite loss is an event. Once every member voted for the step (after the
  digest check: corrupt weights are fenced first), a vote with a null loss sum
  means the step's loss is not finite; the votes name the replicas and their ids
  whose loss was not (`nonfinite`). Nothing of the step is committed. With
  `on_nonfinite` "stop" (the default) the run stops at once, exit 1, naming the
  step, the replicas and the ids, in a "nonfinite" record and the run_end reason;
  with "skip" the step is dropped (a commit message saying `skipped`: every member
  clears its accumulator, no optimizer step), a "nonfinite" record with action
  "skip" is written (no metrics line), and the run goes on with the next step's
  own ids.
- A restarted coordinator (`rebuild`) takes the workers as the truth. Each one's
  hello reports its step, generation, ledger, what it waits for and its last vote.
  Members at the highest step T form the next generation with their ledgers kept;
  members still waiting at T-1 after a vote (the old coordinator died between
  commit messages) hear that commit now, since every vote of T-1 was in (commits
  go out only then) and the others already stepped with the same reduced
  gradient. A newcomer that was waiting for admission (a process in no
  generation, a replacement or a woken replica) goes on waiting: it hears
  "pending" and is admitted at the restarted coordinator's next commit. Anyone
  else (behind, unhealed) is closed and comes back as a newcomer, healed from a
  live member: never a stale replica in a generation. The rebuilt generation's first votes carry weights digests, so a
  member off the majority is fenced before its gradient counts. When T is the
  run's last step count (the old coordinator died after sending the last commit,
  which workers learn is the last: they stay for `done`), nothing is rebuilt:
  the last line is written if missing and every worker hears `done`.

Messages: every control message, its sender and its fields, are in core/contract/messages.py, the one
schema (core/contract/wire.py checks what the coordinator receives against it; docs/protocol.md renders
it as a table). Ids on the wire are `core.contract.idranges` range lists, [[start, stop], ...].
"""
from __future__ import annotations

from typing import Any

from recover.core.contract import idranges
from recover.core.contract.iteration import iteration_range
from recover.core.contract.nonfinite import ON_NONFINITE, describe
from recover.core.contract.policy import assign_quota_ranges
from recover.core.contract.step_messages import Commit, Vote
from recover.core.storage.results import pack_members
# Act, Out and ProtocolError are the machine's vocabulary (core/coordinator/actions.py), and
# RebuildPlan/classify_reports the rebuild's pure part: all re-exported here, where callers import them.
from recover.core.coordinator.actions import Act, Out, ProtocolError
from recover.core.coordinator.admission import AdmissionMixin
from recover.core.coordinator.balancing import SPEED_SMOOTHING, SPEED_TOLERANCE, SPEED_WINDOW, Balancing
from recover.core.coordinator.fencing import FencingMixin
from recover.core.coordinator.readiness import STALL_SCAN_SECONDS, Readiness, ReadinessMixin
from recover.core.coordinator.rebuild import RebuildMixin, RebuildPlan, classify_reports
from recover.core.coordinator.speeds import SpeedTable, measure
from recover.core.coordinator.vote_tally import VoteTally

__all__ = ["Act", "Out", "ProtocolError", "ProtocolStateMachine", "RebuildPlan", "SPEED_SMOOTHING", "SPEED_TOLERANCE",
           "SPEED_WINDOW", "STALL_SCAN_SECONDS", "classify_reports"]


class ProtocolStateMachine(AdmissionMixin, ReadinessMixin, FencingMixin, RebuildMixin):
    """Generations, rejoin, the commit vote and the recovery records of one run.

    Concerns with a module of their own:
    - admission of newcomers (a replacement, a woken replica): core/coordinator/admission.py
      (`AdmissionMixin`);
    - when quotas follow the speeds: core/coordinator/balancing.py (`Balancing`, held as `self.balancer`);
    - readiness and the progress rule: core/coordinator/readiness.py (`Readiness`, held as
      `self.readiness`, and `ReadinessMixin`);
    - exclusion, fencing on evidence: core/coordinator/fencing.py (`FencingMixin`);
    - the rebuild after a coordinator restart: core/coordinator/rebuild.py (`RebuildMixin`)."""

    def __init__(self, replicas: int, microbatches: int, steps: int, join_timeout: float, now: float,
                 fence_after: int = 3, max_failed_generations: int = 10, startup_timeout: float | None = None,
                 heartbeat_interval: float | None = None, start_step: int = 0, min_replicas: int = 1,
                 on_nonfinite: str = "stop", max_heal_attempts: int = 3):
        self.R, self.M, self.S = replicas, microbatches, steps
        if on_nonfinite not in ON_NONFINITE:
            raise ValueError(f"on_nonfinite must be one of {ON_NONFINITE}, got {on_nonfinite!r}")
        self.on_nonfinite = on_nonfinite  # a step whose loss is not finite: "stop" the run, or "skip" the step
        self.skipped: list[int] = []  # the steps skipped for a non-finite loss (--on-nonfinite skip)
        # Below this many members, the next step waits at the boundary for newcomers
        # (up to the start-up timeout: a newcomer's start is a start-up).
        self.min_replicas = min_replicas
        self.startup_wait = max(join_timeout, 300.0) if startup_timeout is None else startup_timeout
        if max_heal_attempts < 1:
            raise ValueError(f"max_heal_attempts must be >= 1, got {max_heal_attempts}")
        self.max_heal_attempts = max_heal_attempts  # failed state transfers of a newcomer before it is refused
        self.fence_after = fence_after  # consecutive failed generations implicating a member before it is fenced
        self.max_failed_generations = max_failed_generations  # consecutive failed generations before the run stops
        self.failed_since_commit = 0  # generations that failed since the last commit (or the start)
        self.implicated_streak: dict[int, list[int]] = {}  # replica -> the failed generations, in a row, naming it
        self.reporters: list[int] = []  # members that reported the failure of generation `gen`, first first
        self.lost_in_failure = False  # a member of the failed generation was lost before the next one formed
        self.join_timeout = join_timeout
        self.heartbeat_interval = heartbeat_interval  # named in the answer to each hello (None: not named)
        self.alive: set[int] = set()  # connected, not declared dead
        self.dead: set[int] = set()
        self.gen = -1  # generation in force (-1: none yet)
        self.members: list[int] = []
        self.member_set: set[int] = set()  # the same replicas: O(1) membership tests per message
        self.member_ranges: idranges.Ranges = []  # the same replicas as the gen message carries them
        self.step = start_step  # 0, or the step of the checkpoint the run resumes from
        self.state = "forming"  # forming | running | waiting (at a boundary, for newcomers) | finished
        self.next_gen = 0
        self.expected: set[int] = set(range(replicas))  # forming: who must (re)join
        self.joins: dict[int, idranges.Ranges] = {}  # replica -> its ledger
        # The first start-up is slow (imports, model build): generation 0 waits this long
        # for the hellos, then forms with the replicas connected. Each hello is answered
        # with the time left (a "startup" message), so the workers wait exactly as long.
        self.deadline = now + (max(join_timeout, 300.0) if startup_timeout is None else startup_timeout)
        self.keys = [str(r) for r in range(replicas)]  # replica -> its key in a metrics line (made once, not per step)
        self.speeds = SpeedTable(replicas, SPEED_SMOOTHING)  # smoothed microbatches/s, per replica
        # whether quotas follow those speeds (core/coordinator/balancing.py; it updates the table)
        self.balancer = Balancing(self.speeds)
        # the ready/go round and each replica's progress (core/coordinator/readiness.py)
        self.readiness = Readiness(owed_since=now, next_stall_scan=now)
        self.votes = self._tally(now)  # the ok votes of (gen, step), summed as they arrive
        self.slowest_microbatch = 0.0  # seconds, the slowest microbatch of the last commit (a rejoin waits one out)
        self.tokens_per_mb = 0
        self.digests: dict[int, str] = {}  # replica -> digest of its initial weights (from its hello)
        self.pending: list[dict[str, Any]] = []  # recoveries not yet followed by a commit
        self.gen_started = now
        self.newcomers: dict[int, dict[str, Any]] = {}  # replica -> its join record: admitted at the next commit
        self.unhealed: set[int] = set()  # members admitted into `gen` whose state has not arrived yet
        self.joining: dict[int, dict[str, Any]] = {}  # admitted replica -> its join record, until its first commit
        self.banned: dict[int, Any] = {}  # replica -> pid of its process fenced on evidence: never readmitted
        self.pids: dict[int, Any] = {}  # replica -> the pid its (latest) hello gave
        self.digest_next_gen = False  # the next gen message asks for digested first votes (after a rebuild)
        # What the last gen/commit message dealt, (joins, ids, members, quotas or None): each member's
        # ledger must be its join ledger plus its quota of `ids`. Read only when ledgers do not add up
        # (`_expected`); None after a rebuild (the old coordinator dealt it).
        self.dealt: tuple[dict[int, idranges.Ranges], idranges.Ranges, idranges.Ranges, Any] | None = None

    @property
    def slow_streak(self) -> dict[int, int]:
        return self.balancer.slow_streak

    @property
    def balancing(self) -> bool:
        return self.balancer.balancing

    def balancing_speeds(self) -> dict[int, float] | None:
        """The members' speeds for the quota policy, or None (equal): `Balancing.speeds_for`."""
        return self.balancer.speeds_for(self.members)

    def _tally(self, now: float) -> VoteTally:
        """An empty tally for the votes of a new (generation, step); readiness starts over with it,
        and every member owes work again from `now` (the progress rule, `_stalled`)."""
        self.readiness.new_round(now)
        self.loss_not_finite = False  # a vote of (gen, step) said its loss sum is not finite
        self.nonfinite_named: dict[int, idranges.Ranges] = {}  # replica -> its ids whose loss was not finite
        return VoteTally(self.keys)

    # ---- inputs --------------------------------------------------------------------
    # ---- what the service asks, and tells, outside the messages (it never reaches into the fields) ----
    # (and note_pid, same_process, slot_open_to: core/coordinator/admission.py)
    def current_step(self) -> int:
        """The step being worked on: every step before it is committed."""
        return self.step

    def on_hello(self, r: int, msg: dict, now: float) -> list[Out]:
        if r in self.dead and msg.get("can_heal") and self.state != "finished":
            return self._newcomer(r, msg, now)
        if r in self.dead or r in self.alive or not 0 <= r < self.R:
            return [Out(Act.CLOSE, r, reason="unknown, duplicate or dead replica")]
        self.alive.add(r)
        self.pids[r] = msg.get("pid")
        self.tokens_per_mb = int(msg.get("tokens_per_mb", self.tokens_per_mb))
        if msg.get("weights_sha256"):
            self.digests[r] = str(msg["weights_sha256"])
        if self.state == "forming" and self.next_gen == 0:
            return [self._startup_progress(r, now), *self._joined(r, [], now)]
        # A late start-up hello after generation 0 formed: it was dropped from the run.
        self.alive.discard(r)
        self.dead.add(r)
        return [Out(Act.CLOSE, r, {"t": "refused"}, reason="arrived after the run started")]

    def on_join(self, r: int, msg: dict, now: float) -> list[Out]:
        if self.state != "forming" or msg.get("gen") != self.next_gen or r not in self.expected:
            return []  # stale or fenced
        if msg.get("healed") is False:
            return self._unhealed_join(r, now)
        if msg.get("step") != self.step:
            return self.on_bad(r, f"it rejoined at step {msg.get('step')}, the run is at {self.step}", now)
        try:
            ledger = idranges.check(msg.get("ledger", []))
        except ValueError as e:
            return self.on_bad(r, f"it rejoined with a malformed ledger: {e}", now)
        if not self._within(ledger, self._expected(r)):
            return self.on_bad(r, f"it rejoined with ledger {ledger}, which holds ids it was not dealt", now)
        self.unhealed.discard(r)
        return self._joined(r, ledger, now)

    def on_stop_run(self, r: int, msg: dict, now: float) -> list[Out]:
        """Replica r ends the run for a reason of its own (its storage is failing).

        The run stops as the coordinator's own stop does: every live replica hears
        `stop` with the reason. A member says it before it exits, so its connection
        closing afterwards is not a replica lost (no recovery is recorded while the
        job ends), and the reason is the one the run ends with."""
        if self.state == "finished" or r not in self.alive:
            return []
        reason = f"replica {r} stopped the run: {msg.get('reason', 'no reason given')}"
        rec = {"kind": "stop_run", "replica": r, "step": self.step, "reason": reason, "at": now}
        return [Out(Act.EVENT, msg=rec, reason=reason)] + self._finish(1, reason, now)

    def on_stop(self, code: int, reason: str, now: float) -> list[Out]:
        """The coordinator ends the run for a reason of its own (its run directory cannot
        be written): every live replica hears `stop` with the reason, the verdict is `code`."""
        if self.state == "finished":
            return []
        return self._finish(code, reason, now)

    def on_vote(self, r: int, vote: Vote, now: float) -> list[Out]:
        """Member r's vote for (gen, step), read from the wire (`Vote.from_wire`: wire.py checked its
        fields, `loss_sum` included); once every member voted ok, the step commits."""
        if self.state != "running" or vote.gen != self.gen or r not in self.member_set:
            return []
        if vote.step != self.step:
            return self.on_bad(r, f"it voted for step {vote.step}, the run is at {self.step}", now)
        if not vote.ok:
            self.reporters.append(r)
            return self._fail(f"replica {r} reported: {vote.reason if vote.reason is not None else 'vote not ok'}", now)
        if vote.loss_sum is None or vote.nonfinite is not None:  # (core/contract/nonfinite.py) rare
            if (why := self._nonfinite_problem(vote)):
                return self.on_bad(r, why, now)
        try:
            held = self.votes.add(r, vote)
        except ValueError as e:
            return self.on_bad(r, f"its vote's ledger is malformed: {e}", now)
        self.readiness.note_gap(r, vote.progress_gap)  # the stall bound only loosens
        self.unhealed.discard(r)  # it votes only with the state (core/worker/replica.py)
        if vote.loss_sum is None or vote.nonfinite is not None:
            self._note_nonfinite(r, vote)
        # votes holds members only (checked above), so a count says whether all have voted
        if held == len(self.members):
            if self.votes.digested and (fenced := self._fence_corrupt_weights(now)) is not None:
                return fenced  # corrupt weights first: their loss is not the data's fault
            if self.loss_not_finite:
                return self._nonfinite(now)
            return self._commit(now)
        if held == len(self.members) - 1:
            # the others' all-reduce completed, so the last member's did too: its vote is bounded
            self.readiness.bound_last_vote(now, self.join_timeout)
        return []

    @staticmethod
    def _nonfinite_problem(vote: Vote) -> str:
        """What is wrong with a vote's non-finite fields ('' if nothing): `nonfinite` must be id
        ranges within the voter's ledger, and comes only with a null loss sum."""
        if vote.nonfinite is None:
            return ""
        try:
            named = idranges.check(vote.nonfinite)
        except ValueError as e:
            return f"its vote's nonfinite ids are malformed: {e}"
        if vote.loss_sum is not None and named:
            return "its vote names non-finite losses with a finite loss sum"
        try:
            if not ProtocolStateMachine._within(named, idranges.check(vote.ledger)):
                return "its vote names non-finite ids outside its ledger"
        except ValueError:
            return ""  # the ledger itself is judged next
        return ""

    def _note_nonfinite(self, r: int, vote: Vote) -> None:
        """Member r's vote says the step's loss is not finite (null loss_sum), naming its own ids if any."""
        if vote.loss_sum is None:
            self.loss_not_finite = True
        if vote.nonfinite:
            self.nonfinite_named[r] = idranges.check(vote.nonfinite)

    def _nonfinite(self, now: float) -> list[Out]:
        """Every member voted for the step and its loss is not finite: stop the run, or skip the step.

        Nothing of the step is committed either way: the reduced gradient holds the same
        non-finite values wherever the loss was not finite, and an optimizer step with it
        would ruin every weight. Stop: the run ends at once (exit 1), every step before
        this one committed (and recorded) already; the stop message says so (`committed`),
        so a worker that writes checkpoints can save that state. Skip: see `_advance`."""
        named = {r: self.nonfinite_named[r] for r in sorted(self.nonfinite_named)}
        text = describe(self.step, self.gen, named)
        rec = {"kind": "nonfinite", "step": self.step, "generation": self.gen, "members": list(self.members),
               "nonfinite": {self.keys[r]: ids for r, ids in named.items()},
               "microbatch_ids": sorted({i for ids in named.values() for i in idranges.to_ids(ids)}),
               "action": self.on_nonfinite, "at": now}
        if self.on_nonfinite == "stop":
            reason = (f"{text}; the run stops (--on-nonfinite stop): steps before {self.step} are committed and kept")
            return [Out(Act.EVENT, msg=rec, reason=reason)] + self._finish(1, reason, now, committed=self.step)
        self.skipped.append(self.step)
        records = [Out(Act.EVENT, msg=rec, reason=f"{text}; step {self.step} skipped (--on-nonfinite skip): no "
                                                   f"optimizer step, the run goes on with step {self.step + 1}")]
        return self._advance(now, None, records, skipped=True)

    def on_fail(self, r: int, msg: dict, now: float) -> list[Out]:
        if self.state == "forming" and msg.get("gen") == self.gen and r in self.expected and r not in self.reporters:
            # a later report of the generation that is already failing: evidence for `_implicated`
            self.reporters.append(r)
            return []
        if self.state != "running" or msg.get("gen") != self.gen or r not in self.member_set:
            return []
        self.reporters.append(r)
        return self._fail(f"replica {r} reported: {msg.get('reason', 'collective failed')}", now)

    def on_lost(self, r: int, reason: str, now: float) -> list[Out]:
        if r not in self.alive:
            return []
        self.alive.discard(r)
        self.dead.add(r)
        self.newcomers.pop(r, None)
        self.joining.pop(r, None)
        self.unhealed.discard(r)
        out = [Out(Act.CLOSE, r, reason=reason)]
        if self.state == "waiting" and r in self.member_set:
            # idle between steps: nothing of the next step is folded yet, so no recovery
            self.members = [m for m in self.members if m != r]
            self.member_set.discard(r)
            if not self.members:
                return out + self._finish(1, "no replica left: every replica of the run has failed", now)
            return out
        if self.state == "running" and r in self.member_set:
            self.lost_in_failure = True
            out += self._fail(f"replica {r} lost: {reason}", now)
        elif self.state == "forming" and r in self.expected:
            self.lost_in_failure = True
            self._record_failure(f"replica {r} lost: {reason}", now)
            self.expected.discard(r)
            self.joins.pop(r, None)
            out += self._maybe_publish(now)
        return out

    def on_rank_lost(self, r: int, rank: int, leader_pid: int, how: str, now: float) -> list[Out]:
        """The launcher saw rank `rank` (not the leader) of replica r fail and is killing the others.

        The replica is lost now: handled as its closed connection would be (`on_lost`), one
        process exit sooner. Only for the process set whose leader said hello with
        `leader_pid`: news of a slot's earlier processes never ends a replacement."""
        if r not in self.alive or self.pids.get(r) != leader_pid:
            return []
        return self.on_lost(r, f"its rank {rank} failed ({how}); the launcher stops the replica's other ranks", now)

    def on_exit(self, r: int, how: str, now: float) -> list[Out]:
        """The launcher saw replica r's process exit (`how`: e.g. "killed by SIGKILL").

        Only news for a replica that never said hello: one that did is handled by its
        closed connection (`on_lost`). During start-up it is dropped at once, and
        generation 0 forms with the replicas there, instead of at the deadline."""
        if r in self.alive or r in self.dead or not 0 <= r < self.R:
            return []
        self.dead.add(r)
        if not (self.state == "forming" and self.next_gen == 0 and r in self.expected):
            return []
        reason = f"replica {r} exited during start-up ({how})"
        self._record_failure(reason, now)
        self.expected.discard(r)
        connected = len(self.alive & self.expected)
        out = [Out(Act.EVENT, msg={"kind": "startup", "exited": r, "how": how, "connected": connected,
                                 "expected": len(self.expected), "of": self.R, "at": now},
                   reason=f"{reason}; replicas connected {connected}/{len(self.expected)}")]
        return out + self._maybe_publish(now)

    def _startup_progress(self, r: int, now: float) -> Out:
        """Tell replica r how long start-up may still take (its own wait), and count it in.

        O(1): while generation 0 forms, a replica that said hello has joined it at once
        (on_hello), so the connected replicas are the joins, plus r. (Counting them as
        `alive & expected` made each hello O(R): 12.7 s of start-up at R = 16,384.)"""
        connected = len(self.joins) + (r not in self.joins)
        msg = {"t": "startup", "wait": max(0.0, self.deadline - now), "connected": connected, "of": len(self.expected)}
        if self.heartbeat_interval is not None:
            msg["heartbeat_interval"] = self.heartbeat_interval
        return Out(Act.SEND, r, msg,
                   reason=f"replicas connected {connected}/{len(self.expected)}")

    def on_tick(self, now: float) -> list[Out]:
        rd = self.readiness
        if self.state in ("running", "forming") and now >= rd.next_stall_scan and rd.progress_gap:
            if out := self._stalled(now):
                return out
        if self.state == "waiting" and now >= self.deadline:
            return self._admit(now)  # waited long enough: go on with whoever is there
        if self.state == "running" and rd.vote_deadline is not None and now >= rd.vote_deadline:
            return self._vote_overdue(now)
        if self.state != "forming" or now < self.deadline:
            return []
        out: list[Out] = []
        for r in sorted(self.expected - set(self.joins)):
            if r in self.alive and self.next_gen > 0 and self.stall_bound(r) is not None:
                continue  # measured: the progress rule (`_stalled`) judges it, however long its work takes
            if r in self.alive:
                out += self.on_lost(r, "did not rejoin before the deadline", now)
            else:  # never connected at all (died during start-up, or still starting)
                self.dead.add(r)
                self._record_failure(f"replica {r} never connected", now)
                self.expected.discard(r)
                out.append(Out(Act.EVENT, msg={"kind": "startup", "never_connected": r, "at": now},
                               reason=f"replica {r} did not connect within the start-up timeout"))
        return out + self._maybe_publish(now)

    # ---- transitions ---------------------------------------------------------------------
    def _record_failure(self, reason: str, now: float) -> None:
        """One record per recovery (per generation formed): failures seen while the
        next generation is still forming are part of the same recovery."""
        if self.pending and "generation" not in self.pending[-1]:
            self.pending[-1]["faults"].append(reason)
            return
        self.pending.append({"fault": reason, "faults": [reason], "detected_at": now, "step": self.step,
                             "from_generation": self.gen})

    def _fail(self, reason: str, now: float) -> list[Out]:
        """The running generation failed: abort it, collect the survivors' ledgers."""
        self._record_failure(reason, now)
        self.failed_since_commit += 1
        # (with nobody left the verdict is "no replica left", below, not "no progress")
        if self.failed_since_commit >= self.max_failed_generations and self.member_set & self.alive:
            return self._finish(1, (
                f"no progress: {self.failed_since_commit} consecutive generations failed without a commit "
                f"(step {self.step}, generations {self.gen - self.failed_since_commit + 1}..{self.gen}, "
                f"members {self.members}; last failure: {reason})"), now)
        self.state = "forming"
        self.next_gen = self.gen + 1
        self.expected = self.member_set & self.alive
        self.joins = {}
        self.votes = self._tally(now)
        # A survivor answers an abort at its next microbatch boundary (Replica.quota
        # is lazy), so the rejoin wait allows one microbatch on top of the deadline.
        self.deadline = now + self.join_timeout + 2 * self.slowest_microbatch
        abort = {"t": "abort", "gen": self.gen, "step": self.step, "next": self.next_gen, "reason": reason}
        out = [Out(Act.SEND, r, abort) for r in sorted(self.expected)]  # one message for all: encoded once
        return out + self._maybe_publish(now)

    def _joined(self, r: int, ledger: idranges.Ranges, now: float) -> list[Out]:
        self.joins[r] = ledger
        return self._maybe_publish(now)

    def _maybe_publish(self, now: float) -> list[Out]:
        if self.state != "forming":
            return []
        if not self.expected:
            return self._finish(1, "no replica left: every replica of the run has failed", now)
        # joins holds expected replicas only (on_join, on_lost and on_tick keep it so)
        if len(self.joins) != len(self.expected):
            return []
        if self.next_gen == 0 and (differ := self._initial_weights_differ()):
            return self._finish(1, differ, now)
        fenced = self._attribute_failure(now)
        if fenced and not self.expected:
            return fenced + self._finish(1, "no replica left: every replica of the run has failed", now)
        lo, hi = iteration_range(self.step, self.M)
        try:
            done = idranges.union_disjoint(self.joins[r] for r in sorted(self.joins))
        except ValueError:
            done = None
        if done is None or (done and (done[0][0] < lo or done[-1][1] > hi)):
            # (each join was checked against what it was dealt; after a rebuild it could not be)
            return fenced + self._fence_ledgers(self.joins, lo, hi, "rejoined", now)
        todo = idranges.difference(lo, hi, done)
        self.gen = self.next_gen
        self.members = sorted(self.expected)
        self.member_set = set(self.members)
        self.member_ranges = idranges.from_ids(self.members)
        self.state = "running"
        self.votes = self._tally(now)
        self.gen_started = now
        if self.pending and "generation" not in self.pending[-1]:
            self.pending[-1].update(generation=self.gen, survivors=list(self.members), redone=idranges.to_ids(todo),
                                    formed_at=now)
        out = list(fenced)
        if self.gen == 0:  # the end of start-up, with whoever is there
            missing = sorted(set(range(self.R)) - self.member_set)
            out.append(Out(Act.EVENT, msg={"kind": "startup", "formed": 0, "members": len(self.members), "of": self.R,
                                         "missing": missing, "at": now},
                           reason=f"generation 0 formed with {len(self.members)}/{self.R} replicas"
                                  + (f" (missing: {missing})" if missing else "")))
        digest = {"digest": True} if self.digest_next_gen else {}
        self.digest_next_gen = False
        return out + self._deal({"t": "gen", "gen": self.gen, "step": self.step, "members": self.member_ranges,
                                 "microbatches": self.M, "steps": self.S, **digest}, todo, self.joins)

    def _deal(self, msg: dict[str, Any], ids: idranges.Ranges,
              joins: dict[int, idranges.Ranges] | None = None) -> list[Out]:
        """`msg` to every member, with its quota of `ids` by the policy.

        At equal speeds (the common case) it is one message for all, naming the ids
        (`split`): each member takes its `policy.equal_share`, so the service encodes
        one line, not R, and the step costs no per-member quota here. While quotas
        follow the speeds, each member gets its own (`quota`)."""
        speeds = self.balancer.speeds_for(self.members)
        joins = joins or {}  # the ledgers the members hold already (a re-formed generation's survivors)
        if speeds is None:
            self.dealt = (joins, ids, self.member_ranges, None)
            shared = {**msg, "split": ids}
            return [Out(Act.SEND, r, shared) for r in self.members]
        quotas = assign_quota_ranges(ids, self.members, speeds)
        self.dealt = (joins, ids, self.member_ranges, quotas)
        return [Out(Act.SEND, r, {**msg, "quota": quotas[r]}) for r in self.members]

    def _commit(self, now: float) -> list[Out]:
        lo, hi = iteration_range(self.step, self.M)
        # What the votes said was summed as each arrived (core/coordinator/vote_tally.py): no pass
        # over R vote objects here. `ledgers` lists members in arrival order.
        votes = self.votes
        ledgers, lrs = votes.ledgers, votes.lrs
        # Never commit a gradient that is not exactly the M ids, each once: the
        # members' ledgers partition [lo, hi) (O(ranges), not O(M)).
        if not idranges.partitions(ledgers.values(), lo, hi):
            return self._fence_ledgers({r: ledgers[self.keys[r]] for r in self.members}, lo, hi, "voted", now)
        got = [[lo, hi]] if hi > lo else []
        if len(lrs) > 1:
            # The schedule is a function of the committed step: replicas that disagree would diverge.
            return self._fence_odd_lr(now)
        lr = next(iter(lrs))
        who, measured, slowest = measure(votes.seconds)  # vectorized: O(R) in C, not R dict operations
        if self.step == 0:  # step 0 pays one-time costs (first calls, allocations): not a speed
            who, measured = who[:0], measured[:0]
        if slowest:
            self.slowest_microbatch = slowest  # what the next rejoin waits out (the deadline of `_fail`)
        self.balancer.after_commit(who, measured, self.members, self.member_set)  # speeds, streak, balancing
        loss = self.votes[self.members[0]].loss_sum / self.M
        records = [self._commit_line(self.step, loss, got, ledgers, self.gen, list(self.members),
                                     len(self.pending), lr,
                                     # the slowest microbatch a member reported (seconds): what a rejoin waits out
                                     slowest_microbatch_seconds=slowest)]
        return self._advance(now, loss, records)

    def _advance(self, now: float, loss: float | None, records: list[Out], skipped: bool = False) -> list[Out]:
        """Step `self.step` is settled (committed, or skipped for a non-finite loss): the members hear
        it with the next step's quota (or the boundary), and the run moves to the next step.

        A skipped step's commit message says `skipped` (loss null): every member clears its
        accumulator without an optimizer step, and its schedule moves on (core/contract/nonfinite.py says
        why). The recoveries of the step end there too (their records say `skipped`); newcomers
        that took part are recorded at their first real commit (it shows their weights digest)."""
        for rec in self.pending:
            rec["committed_at"] = now
            rec["recovery_seconds"] = now - rec["detected_at"]
            if skipped:
                rec["skipped"] = True
            records.append(Out(Act.RECOVERY, msg=rec))
        if not skipped:
            records += self._first_commits(now)
        self.pending = []
        self.failed_since_commit = 0  # progress: the same failures later are a new story
        self.implicated_streak = {}
        committed = self.step
        self.step += 1
        self.votes = self._tally(now)
        last = self.step >= self.S
        skip = True if skipped else None  # (the commit message names `skipped` only when true)
        if not last and (self.newcomers or self._short()):
            # Step `committed` is the boundary: the members hear the commit with `next`,
            # and generation gen+1 (with the newcomers) follows, now or once enough arrived.
            boundary = Commit(self.gen, committed, loss, quota=[], next=self.gen + 1, skipped=skip).to_wire()
            sends = [Out(Act.SEND, r, boundary) for r in self.members]
            if not self._short():
                return sends + self._admit(now) + records
            self.state, self.deadline = "waiting", now + self.startup_wait
            return sends + [Out(Act.SEND, r, {"t": "pending", "step": self.step}) for r in self.members] + [
                Out(Act.EVENT, msg={"kind": "waiting", "step": self.step, "members": list(self.members),
                                  "min_replicas": self.min_replicas, "at": now},
                    reason=f"step {self.step} waits for newcomers: {len(self.members) + len(self.newcomers)} "
                           f"of at least {self.min_replicas} replicas")] + records
        # The commit messages go out before the records are written: the workers
        # are waiting on them, the files are not.
        sends = self._deal(Commit(self.gen, committed, loss, skipped=skip).to_wire(),
                           [] if last else [list(iteration_range(self.step, self.M))])
        if last:
            done = "all steps committed" if not self.skipped else (
                f"all steps done; step(s) {self.skipped} skipped for a non-finite loss (--on-nonfinite skip)")
            return sends + records + self._finish(0, done, now)
        return sends + records

    def _commit_line(self, step: int, loss: float, got: idranges.Ranges, ledgers: dict[str, list], generation: Any,
                     members: list[int], recoveries: int, lr: Any, **extra: Any) -> Out:
        """A step's metrics.jsonl line (the service adds the wall time and its own load): one shape
        for a commit and for one a restarted coordinator records from the votes reported."""
        return Out(Act.COMMIT, msg={
            "step": step, "loss": loss, "tokens": self.M * self.tokens_per_mb,
            # the ids the members reported folding (their ledgers' union, checked exactly, as
            # id ranges: core/storage/results.py's contract), and each member's report as it voted it:
            # the evidence, not what was handed out
            # (members and ledgers run-length encoded, losslessly: the line does not grow with R;
            # results.expand_members gives readers `members`, `ledgers` and `folded`)
            "microbatch_id_ranges": got, **pack_members(members, ledgers),
            "generation": generation, "recoveries": recoveries,
            # the longest gap between units of work any member measured: a restarted coordinator
            # waits for the members' reports in proportion to it (core/coordinator/service.py)
            **({"progress_gap": gap} if (gap := self.readiness.longest_gap) is not None else {}),
            **({"lr": lr} if lr is not None else {}), **extra})

    def _finish(self, code: int, reason: str, now: float, committed: int | None = None) -> list[Out]:
        """The run ends: `done` (code 0) or `stop` to every live replica, then the verdict.
        `committed`: every member holds the state after exactly this many steps, untouched
        (a non-finite stop), so a worker that writes checkpoints may save it."""
        self.state = "finished"
        msg = {"t": "done"} if code == 0 else {"t": "stop", "reason": reason}
        if committed is not None:
            msg["committed"] = committed
        return [Out(Act.SEND, r, msg) for r in sorted(self.alive)] + [Out(Act.FINISH, code=code, reason=reason)]
