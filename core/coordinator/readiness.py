"""Readiness (the ready/go round of a step) and the progress rule (stalls) of the protocol state machine.

Contract (the "slow is not dead" invariants of core/coordinator/protocol.py, kept here):
- A member that folded its quota of (generation, step) says `ready`; once every member
  of the generation has, all hear `go`, once per (generation, step), as one message
  object for all (O(1) per `ready`). Each new (generation, step) starts the round over
  (`Readiness.new_round`): nobody ready, no `go`, no vote deadline, and every member
  owes work again from then.
- A vote is bounded: once every member but one voted, the last one has `join_timeout`
  plus four times what the others took from `go` to vote (`Readiness.bound_last_vote`);
  a member that misses it is lost (`_vote_overdue`), its share redone.
- The progress rule: a member that owes work (`_owes_work`: in a running step before it
  said `ready` and before `go`; in a forming generation before it rejoined, generation 0
  aside) and showed no progress (`on_progress`: a heartbeat's count moved, or any
  message) for longer than its bound (`stall_bound`: `join_timeout` plus four times the
  longest gap between two units of its work it measured itself, plus two heartbeat
  intervals) is lost (`_stalled`). Before its first measured gap a member has no bound
  (start-up's rules judge it), and a measured gap only loosens the bound. The members
  are looked at at most every STALL_SCAN_SECONDS.

Why a state object and a mixin: the round's and the rule's own state (who is ready, when
`go` went out, the vote deadline, each member's last progress and longest measured gap)
is `Readiness`, a dataclass the machine owns (`ProtocolStateMachine.readiness`), with the
arithmetic on it, testable alone. The handlers (`on_ready`, `_stalled`, `_owes_work`,
`_vote_overdue`) read the machine's shared membership (state, members, expected, joins,
alive) and declare members lost through its `on_lost`, so they are the machine's methods,
in `ReadinessMixin`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from recover.core.contract.step_messages import Go, Ready
from recover.core.coordinator.actions import Act, Out

STALL_SCAN_SECONDS = 0.25  # how often the progress rule looks at the members (O(R) a look)


@dataclass(slots=True)
class Readiness:
    """The ready/go round of the current (generation, step) and each replica's progress."""

    owed_since: float  # when the members last owed new work (set with each new round)
    next_stall_scan: float  # the progress rule looks at the members at most every STALL_SCAN_SECONDS
    ready: set[int] = field(default_factory=set)  # members ready for (gen, step)'s all-reduce
    go_at: float | None = None  # when "go" went out for (gen, step); None: not yet
    vote_deadline: float | None = None  # the last member's vote is due by then (all others voted)
    progress_at: dict[int, float] = field(default_factory=dict)  # replica -> when it last showed progress
    progress_gap: dict[int, float] = field(default_factory=dict)  # replica -> longest gap between its units of work
    longest_gap: float | None = None  # the largest of them (kept as they arrive: no pass over R a commit)

    def new_round(self, now: float) -> None:
        """A new (generation, step): nobody is ready, no `go`, no vote deadline; all owe work from `now`."""
        self.owed_since = now
        self.ready = set()
        self.go_at = None
        self.vote_deadline = None

    def mark_ready(self, r: int, members: int, now: float) -> bool:
        """Member r is ready; True once all `members` are (`go` goes out `now`). O(1)."""
        self.ready.add(r)
        if len(self.ready) < members:
            return False
        self.go_at = now
        return True

    def note_gap(self, r: int, gap: object) -> None:
        """A vote's `progress_gap` (seconds; anything else is ignored): the bound only loosens."""
        if type(gap) in (int, float) and 0 <= gap < float("inf"):
            self.progress_gap[r] = max(gap, self.progress_gap.get(r, 0.0))
            self.longest_gap = max(gap, self.longest_gap or 0.0)

    def bound_last_vote(self, now: float, join_timeout: float) -> None:
        """Every member but one voted: the others' all-reduce completed, so the last one's did too."""
        took = now - self.go_at if self.go_at is not None else 0.0
        self.vote_deadline = now + join_timeout + 4 * took

    def stall_bound(self, r: int, join_timeout: float, heartbeat_interval: float | None) -> float | None:
        """Seconds without progress after which r, owing work, is lost (None: no gap measured yet)."""
        gap = self.progress_gap.get(r)
        if gap is None:
            return None
        return join_timeout + 4 * gap + 2 * (heartbeat_interval or 0.0)

    def silent_since(self, r: int) -> float:
        """Since when r showed no progress on the work it owes (its last progress, or when it began to owe)."""
        return max(self.progress_at.get(r, self.owed_since), self.owed_since)


class ReadinessMixin:
    """`ProtocolStateMachine`'s ready/go and progress handlers (see the module's docstring)."""

    readiness: Readiness

    @property
    def ready(self) -> set[int]:
        return self.readiness.ready

    @property
    def go_at(self) -> float | None:
        return self.readiness.go_at

    @property
    def vote_deadline(self) -> float | None:
        return self.readiness.vote_deadline

    @property
    def owed_since(self) -> float:
        return self.readiness.owed_since

    def on_progress(self, r: int, now: float) -> None:
        """Replica r showed progress (its heartbeat's count moved, or it sent a message). O(1)."""
        self.readiness.progress_at[r] = now

    def stall_bound(self, r: int) -> float | None:
        """Seconds without progress after which member r, owing work, is declared dead (None:
        not measured yet, before its first vote)."""
        return self.readiness.stall_bound(r, self.join_timeout, self.heartbeat_interval)

    def _owes_work(self, r: int) -> bool:
        if self.state == "running":
            return self.readiness.go_at is None and r not in self.readiness.ready and r in self.member_set
        if self.state == "forming":
            return r in self.expected and r not in self.joins and self.next_gen > 0
        return False

    def _stalled(self, now: float) -> list[Out]:
        """Members that owe work and showed no progress for longer than their bound: lost.
        O(members), at most every STALL_SCAN_SECONDS."""
        self.readiness.next_stall_scan = now + STALL_SCAN_SECONDS
        who = self.members if self.state == "running" else sorted(self.expected)
        out: list[Out] = []
        for r in who:
            bound = self.stall_bound(r)
            if bound is None or r not in self.alive or not self._owes_work(r):
                continue
            since = self.readiness.silent_since(r)
            if now - since > bound:
                owed = "its rejoin" if self.state == "forming" else f"its work of step {self.step}"
                out += self.on_lost(r, (
                    f"no progress for {now - since:.1f}s on {owed} (bound {bound:.1f}s: the collective timeout "
                    f"plus 4 x {self.readiness.progress_gap[r]:.2f}s, its longest measured gap); alive but stuck"), now)
                if self.state not in ("running", "forming"):
                    break
        return out

    def on_ready(self, r: int, ready: Ready, now: float) -> list[Out]:
        """Member r folded its quota of (gen, step); once every member has, all hear `go`.

        O(1) per message, and one message object for all members (the service encodes it once)."""
        if (self.state != "running" or ready.gen != self.gen or r not in self.member_set
                or self.readiness.go_at is not None):
            return []  # stale, fenced, or a repeat after go
        if ready.step != self.step:
            return self.on_bad(r, f"it is ready for step {ready.step}, the run is at {self.step}", now)
        if not self.readiness.mark_ready(r, len(self.members), now):
            return []
        go = Go(self.gen, self.step).to_wire()
        return [Out(Act.SEND, m, go) for m in self.members]

    def _vote_overdue(self, now: float) -> list[Out]:
        """Every member but one voted, and the last one's vote is past its deadline: it is lost."""
        self.readiness.vote_deadline = None
        late = [m for m in self.members if m not in self.votes.votes]
        out: list[Out] = []
        for r in late:  # exactly one (the deadline is set when all others voted)
            go_at = self.readiness.go_at
            why = (f"did not vote for step {self.step} within {now - go_at if go_at else 0.0:.1f}s of go "
                   f"while every other member had (its training thread is stuck; its heartbeat is not proof of work)")
            out += self.on_lost(r, why, now)
        return out
