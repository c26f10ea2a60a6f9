"""A restarted coordinator's rebuild of the run from its workers' reports.

Contract (the rebuild invariant of core/coordinator/protocol.py, kept here):
- The workers are the truth. `classify_reports` sorts their hellos, purely, into a
  `RebuildPlan`: members at the highest step T (`ahead`), members at T-1 that voted and
  wait for its commit (`behind`: they only missed a message, since a commit goes out
  only after every member's vote), newcomers waiting for admission (`waiting`), and
  everyone else (`stale`). A report past what metrics.jsonl allows is set aside.
- `rebuild` forms the next generation of `ahead` and `behind` with their ledgers kept
  (T restarts as a recovery does), lets `waiting` go on waiting ("pending"), and
  closes `stale` so it comes back as a newcomer, healed from a live member: never a
  stale replica in a generation. The rebuilt generation's first votes carry weights
  digests. When T is the run's last step count nothing is rebuilt: every worker hears
  `done`.
- `_resend_missed_commit` is the one place the commit of T-1 that the old coordinator
  sent but did not finish is made good: its metrics line, from the votes reported
  (marked "rebuilt"), if metrics.jsonl lacks it, and the commit message to each
  `behind` member.

Why a mixin of `ProtocolStateMachine`, not a state object: the rebuild holds no
state of its own. It re-seeds the machine's (step, generation, members, the forming
generation's joins, the newcomers) and goes on through the machine's transitions
(`_newcomer`, `_record_failure`, `_maybe_publish`, `_finish`, `_commit_line`), so
its methods are the machine's; the pure part (`classify_reports`) is a function.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from recover.core.contract import idranges
from recover.core.contract.iteration import iteration_range
from recover.core.coordinator.actions import Act, Out, ProtocolError


def _ledger(r: int, msg: dict) -> idranges.Ranges:
    """A vote's or join's ledger, checked to be a range list (O(pairs))."""
    try:
        return idranges.check(msg.get("ledger", []))
    except ValueError as e:
        raise ProtocolError(f"replica {r} sent a malformed ledger: {e}") from None


def _int_or(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _committed_vote_of(rep: dict, step: int) -> list[dict]:
    """[the vote with which a report's member committed `step`] if the report says so, else []."""
    for vote in (rep.get("committed_vote"), rep.get("vote") if "committed_vote" not in rep else None):
        if isinstance(vote, dict) and vote.get("step") == step:
            return [vote]
    return []


@dataclass
class RebuildPlan:
    """What a restarted coordinator's reports say (`classify_reports`), before anything is decided."""

    reports: dict[int, dict]  # replica -> the report of its hello (every replica that said hello)
    members: dict[int, dict]  # the reports of members holding a committed state (stale steps set aside)
    top: int  # the highest step a member reports (-1: no member)
    ahead: dict[int, dict]  # members at `top`
    behind: dict[int, dict]  # members at top-1 that voted for it and wait for its commit
    waiting: list[int]  # newcomers waiting for admission (a replacement, a woken replica)
    stale: list[int]  # everyone else: they rejoin as newcomers
    recorded: int  # the last step metrics.jsonl holds (-1: none, or not known)


def classify_reports(hellos: dict[int, dict], replicas: int, step: int, recorded_step: int | None) -> RebuildPlan:
    """Sort a restarted coordinator's hellos into who is where (pure; `ProtocolStateMachine.rebuild` acts on it).

    Why "behind" members only missed a message: a commit goes out only after every member's
    vote, so if any member reached step T, every member still at T-1 that voted holds the same
    reduced gradient. metrics.jsonl is the other witness: the old coordinator recorded every
    commit but at most the last one it sent, so no member can be past recorded_step + 2; a report
    beyond that (a worker's bug) would make every sound member look behind, so it is set aside."""
    reports = {r: h.get("report") or {} for r, h in hellos.items() if 0 <= r < replicas}
    limit = None if recorded_step is None else max(recorded_step, step - 1) + 2
    members = {r: rep for r, rep in reports.items()
               if rep.get("member") and isinstance(rep.get("step"), int) and (limit is None or rep["step"] <= limit)}
    recorded = -1 if recorded_step is None else recorded_step
    if not members:
        return RebuildPlan(reports, members, -1, {}, {}, [], sorted(reports), recorded)
    top = max(rep["step"] for rep in members.values())
    ahead = {r: rep for r, rep in members.items() if rep["step"] == top}
    # The generation that committed top-1, from the vote each member past it committed:
    # `committed_vote`, not its last vote, which is of step top once it voted again (the
    # filter would then be empty and admit any old vote of top-1: a member cut off after
    # voting in a generation that never committed would be handed a commit it was not
    # part of). The last vote stands in only for a report without `committed_vote`
    # (an older worker), where it is the committed one if it is of top-1.
    committed_in = {vote["gen"] for rep in ahead.values() for vote in _committed_vote_of(rep, top - 1)}

    def missed_commit(rep: dict) -> bool:
        vote = rep.get("vote") or {}
        return (rep["step"] == top - 1 and rep.get("wait") == "commit" and vote.get("step") == top - 1
                and (not committed_in or vote.get("gen") in committed_in))

    # (with nobody past a step, nobody is "behind" at it: top is the highest step reported)
    behind = {r: rep for r, rep in members.items() if r not in ahead and missed_commit(rep)}
    # A process in no generation that can be healed (a replacement, or a woken replica that
    # rejoined) was waiting for admission: it goes on waiting for the next commit. Closed, it
    # would read the close as a verdict and exit.
    waiting = sorted(r for r, rep in reports.items()
                     if r not in members and hellos[r].get("can_heal") and not rep.get("member")
                     and _int_or(rep.get("gen"), -1) < 0)
    stale = sorted(set(reports) - set(ahead) - set(behind) - set(waiting))
    return RebuildPlan(reports, members, top, ahead, behind, waiting, stale, recorded)


class RebuildMixin:
    """`ProtocolStateMachine`'s rebuild after a coordinator restart (see the module's docstring)."""

    def rebuild(self, hellos: dict[int, dict], now: float, recorded_step: int | None = None,
                progress_gap: float = 0.0) -> list[Out]:
        """Members, step and generation of a run whose coordinator restarted, from its workers.

        `hellos`: replica -> the hello it sent the new coordinator (a member reporting a step
        past what metrics.jsonl allows is treated as stale); its "report" says
        (core/worker/replica.py `_report`): member (in a generation, holding the committed
        state), step (its committed count), gen, ledger (ids of `step` it folded),
        wait ("commit": it voted and holds the reduced gradient; "gen": it waits for
        generation `awaiting`; "": anything else), vote (its last vote: gen, step,
        ledger, loss_sum, lr) and committed_vote (the vote of its last committed step;
        absent from older workers). `recorded_step`: the last step metrics.jsonl holds
        (None: not known, as in a test of the machine alone); a commit the old
        coordinator sent but did not record (it sends, then records: a kill between the
        two loses the line, whether some members missed the commit or none did) is
        recorded here, from the votes the workers report, marked "rebuilt". `progress_gap`:
        the longest gap between units of work a member had measured, as the last metrics
        line recorded it (0: none); each member is judged by it (the progress rule) until
        its own next vote, so a member whose report came from its heartbeat thread in the
        middle of a long microbatch is waited for, not removed at the forming deadline.

        Why this is safe: a commit goes out only after every member's vote, so if any
        member reached step T, every member still at T-1 that voted holds the same
        reduced gradient and only missed the message. Nothing at T was committed (no
        member is past T), so T restarts as a recovery does: ledgers kept, the rest
        redone by the next generation. The workers' weights are checked by the digests
        of that generation's first votes (`_fence_corrupt_weights`)."""
        for r, h in hellos.items():
            self.pids[r] = h.get("pid")
            self.tokens_per_mb = int(h.get("tokens_per_mb", self.tokens_per_mb))
        plan = classify_reports(hellos, self.R, self.step, recorded_step)
        self.alive, self.dead = set(plan.reports), set(range(self.R)) - set(plan.reports)
        if not plan.members:
            return self._finish(1, f"cannot rebuild the run after a coordinator restart: no member of it reported "
                                   f"({len(plan.reports)} newcomer(s) did)", now)
        top, ahead, behind = plan.top, plan.ahead, plan.behind
        if top >= self.S:
            # every step is committed: the old coordinator died after sending the last commit,
            # before writing its line or before its `done` (workers wait for that word,
            # core/worker/replica.py `_await_done`); nothing is left to run, so nothing is rebuilt
            self.step = top
            reason = (f"coordinator restarted after the last commit (step {top - 1}): {len(ahead)} member(s) "
                      f"committed it" + (f", {len(behind)} still waited for it" if behind else ""))
            out: list[Out] = [Out(Act.EVENT, msg={
                "kind": "rebuilt", "step": top, "finished": True, "members": sorted({*ahead, *behind}),
                "missed_commit": sorted(behind), "reports": len(plan.reports), "at": now}, reason=reason)]
            return out + self._resend_missed_commit(plan, None, now) + self._finish(0, "all steps committed", now)
        self.step = top
        self.gen = max(max(int(rep.get("gen", -1)), int(rep.get("awaiting", -1) if rep.get("awaiting") is not None
                                                       else -1)) for rep in plan.members.values())
        self.next_gen = self.gen + 1
        self.state = "forming"
        self.expected = set(ahead) | set(behind)
        self.members = sorted(self.expected)
        self.member_set = set(self.members)
        self.joins, self.votes, self.reporters, self.lost_in_failure = {}, self._tally(now), [], False
        self.newcomers, self.joining, self.unhealed = {}, {}, set()
        self.dealt = None  # what the old coordinator dealt is not known
        self.deadline = now + self.join_timeout
        for r in self.members if progress_gap > 0 else ():
            self.readiness.note_gap(r, progress_gap)
        self.digest_next_gen = True
        reason = (f"coordinator restarted: rebuilt step {top} from {len(plan.members)} member report(s)"
                  + (f"; {len(behind)} member(s) still waiting for the commit of step {top - 1}" if behind else ""))
        self._record_failure(reason, now)
        out = [Out(Act.EVENT, msg={
            "kind": "rebuilt", "step": top, "generation": self.next_gen, "members": self.members,
            "missed_commit": sorted(behind), "closed": plan.stale, "newcomers": plan.waiting,
            "reports": len(plan.reports), "at": now}, reason=reason)]
        out += self._resend_missed_commit(plan, self.next_gen, now)
        for r in behind:
            self.joins[r] = []  # it steps with the gradient it holds and waits for next_gen, ledger empty
        for r, rep in sorted(ahead.items()):
            if rep.get("wait") == "gen" and rep.get("awaiting") is not None and rep["awaiting"] <= self.next_gen:
                self.joins[r] = _ledger(r, rep)  # it joined already: generation next_gen's gen message answers it
            else:
                out.append(Out(Act.SEND, r, {"t": "abort", "gen": int(rep.get("gen", -1)), "step": top,
                                           "next": self.next_gen, "reason": reason}))
        for r in plan.waiting:
            out += self._newcomer(r, hellos[r], now)  # "pending": admitted at the next commit
        for r in plan.stale:
            # behind or unhealed: it comes back through admission, healed from a member
            self.alive.discard(r)
            self.dead.add(r)
            out.append(Out(Act.CLOSE, r, reason=f"replica {r} does not hold step {top}'s state after the coordinator "
                                               f"restart: it rejoins as a newcomer"))
        return out + self._maybe_publish(now)

    def _resend_missed_commit(self, plan: "RebuildPlan", next_gen: int | None, now: float) -> list[Out]:
        """The one place a restarted coordinator makes good the commit of step top-1 that the old one
        sent but did not finish: its metrics line, from the votes reported, if metrics.jsonl lacks it
        (the old coordinator sends, then records: a kill between the two loses the line), and the
        commit message to each member that voted and still waits for it (`next`: the generation it
        then waits for; None: that was the last step)."""
        top, out = plan.top, []
        if plan.recorded < top - 1 and (line := self._rebuilt_commit_record(top - 1, {**plan.behind, **plan.ahead},
                                                                              now)):
            out.append(line)
        for r, rep in sorted(plan.behind.items()):
            msg = {"t": "commit", "gen": rep["vote"]["gen"], "step": top - 1, **self._missed_commit(rep["vote"]),
                   "quota": []}
            if next_gen is not None:
                msg["next"] = next_gen
            out.append(Out(Act.SEND, r, msg))
        return out

    def _missed_commit(self, vote: dict) -> dict[str, Any]:
        """What a commit that a member missed says of its loss: the mean, or, for a vote whose loss
        was not finite (members past that step exist, so it was skipped, never committed), `skipped`."""
        if vote.get("loss_sum") is None:
            return {"loss": None, "skipped": True}
        return {"loss": vote["loss_sum"] / self.M}

    def _rebuilt_commit_record(self, step: int, reports: dict[int, dict], now: float) -> Out | None:
        """The metrics line of a commit the old coordinator sent but never wrote, from the votes reported
        (a member's last vote, or the vote of its last committed step); None when no one reported one."""
        votes = {}
        for r, rep in reports.items():
            for vote in (rep.get("vote"), rep.get("committed_vote")):
                if isinstance(vote, dict) and vote.get("step") == step:
                    votes[r] = vote
                    break
        if not votes:
            return None
        ledgers = {str(r): v.get("ledger", []) for r, v in sorted(votes.items())}
        try:
            got = idranges.union_disjoint(idranges.check(v) for v in ledgers.values())
        except ValueError as e:
            raise ProtocolError(f"step {step}: the reported votes' ledgers overlap: {e}") from None
        first = votes[min(votes)]
        if first.get("loss_sum") is None:
            return None  # a step skipped for a non-finite loss: it has no metrics line
        lo, hi = iteration_range(step, self.M)
        return self._commit_line(step, first["loss_sum"] / self.M, got, ledgers, first.get("gen"), sorted(votes), 0,
                                 first.get("lr"),
                                 # the members that voted and did not report (dead since) leave their ids out
                                 rebuilt=True, complete=idranges.is_exactly(got, lo, hi))
