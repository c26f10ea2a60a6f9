"""Exclusion: who is fenced out of the run, on what evidence, for the protocol state machine.

Contract (the exclusion invariants of core/coordinator/protocol.py, kept here):
- A replica fenced on evidence is taken out like a lost replica (its ledger's ids are
  redone by the others), with a "fenced" record naming the evidence, and that process
  is never readmitted (`_ban`: its pid; a new process in its slot may be admitted).
  The evidence: a message the protocol cannot take (`on_bad`: a wrong step, a ledger
  not what it was dealt, a malformed field), weights digests off a strict majority
  (`_fence_corrupt_weights`; without a strict majority the run stops rather than
  guess), ledgers that do not add up (`_fence_ledgers`: the members whose ledger is not
  what they were dealt, `_expected`; with no one to blame the generation fails and the
  ids are dealt again), a learning rate off the members' (`_fence_odd_lr`), and a
  persistent fault (`_attribute_failure`: a member implicated, `_implicated`, in
  `fence_after` consecutive failed generations). Nothing a peer sends ends the run.
- Each failed generation implicates at most one member: the first to report the
  failure, unless a member was lost in it or every member reported it.
- Generation 0 forms only if the joined replicas' initial weights agree
  (`_initial_weights_differ` names the minority otherwise).

Why a mixin of `ProtocolStateMachine`, not a state object: the evidence is gathered
along every failure path of the machine (a vote or a fail report appends to
`reporters`, a lost member sets `lost_in_failure`, a commit clears
`implicated_streak`, a rebuild starts them over), and a fence changes the shared
membership (alive, dead, expected, joins, the newcomers) and goes through the
machine's `on_lost`, `_record_failure` and `_finish`. So the attribution state stays
the machine's attributes and these methods are the machine's.
"""
from __future__ import annotations

from typing import Any

from recover.core.contract import idranges
from recover.core.contract.policy import equal_share
from recover.core.coordinator.actions import Act, Out


class FencingMixin:
    """`ProtocolStateMachine`'s exclusion: fencing on evidence (see the module's docstring)."""

    def on_bad(self, r: int, what: str, now: float) -> list[Out]:
        """Replica r sent what the protocol cannot take: a message of the wrong step, a ledger
        that is not what it was dealt, a malformed field (the service refuses a line that
        breaks core/contract/wire.py's tables and calls this for a member). Only a peer holding the
        join token gets here, and no worker does this; it is fenced like a replica with
        corrupt weights (a "fenced" record, never readmitted as this process), its ids
        redone by the others. The run goes on: nothing a peer sends ends it."""
        reason = f"replica {r} fenced: {what}"
        if r not in self.alive:
            return [Out(Act.CLOSE, r, reason=reason)]
        self._ban(r)
        return [self._fenced_record(r, reason, now, {"message": what})] + self.on_lost(r, f"fenced: {what}", now)

    @staticmethod
    def _within(ranges: idranges.Ranges, allowed: idranges.Ranges | None) -> bool:
        """Whether every id of `ranges` is in `allowed` (None: unknown, so yes). O(pairs)."""
        if allowed is None or not ranges:
            return True
        try:
            merged = idranges.union_disjoint([allowed])
        except ValueError:
            return True
        j = 0
        for a, b in ranges:
            while j < len(merged) and merged[j][1] <= a:
                j += 1
            if j == len(merged) or not (merged[j][0] <= a and b <= merged[j][1]):
                return False
        return True

    def _expected(self, r: int) -> idranges.Ranges | None:
        """The ledger member r must hold once it folded what the last gen/commit message dealt
        it (its join ledger plus its quota); None: not known (after a rebuild, or not dealt).
        Computed only on the rare paths (a rejoin, ledgers that do not add up)."""
        if self.dealt is None:
            return None
        joins, ids, members, quotas = self.dealt
        try:
            if quotas is not None:
                quota = quotas.get(r, [])
            else:
                quota = equal_share(ids, members, r) if ids else []
            return idranges.union_disjoint([joins.get(r, []), quota])
        except ValueError:  # r was not a member it dealt to
            return None

    def _initial_weights_differ(self) -> str:
        """Why generation 0 must not form ('' if the joined replicas' initial weights agree).

        The replicas in the minority (ties: those not agreeing with the lowest
        replica) are named: a per-replica seed or init is a user's bug, and training
        from different weights would commit a gradient no failure-free run takes."""
        digests = {r: self.digests[r] for r in sorted(self.joins) if r in self.digests}
        if len(set(digests.values())) <= 1:
            return ""
        groups: dict[str, list[int]] = {}
        for r, d in digests.items():
            groups.setdefault(d, []).append(r)
        ref = max(groups, key=lambda d: (len(groups[d]), -groups[d][0]))
        odd = sorted(r for r, d in digests.items() if d != ref)
        return (f"initial weights differ: replica(s) {odd} do not match replica(s) {groups[ref]} "
                f"(weights digest {', '.join(f'{r}: {digests[r][:12]}' for r in digests)}); every replica "
                "must start from the same weights (same seed, same initialisation)")

    def _fence_corrupt_weights(self, now: float) -> list[Out] | None:
        """None if the votes' weights digests agree (or none came); else fence the odd ones.

        Members train the same weights with the same gradients, so their digests are
        equal unless a replica's memory was silently corrupted (a flipped bit). The
        members off the strict majority are declared dead, which aborts the step:
        the survivors keep their ledgers and redo the corrupt replicas' share, so no
        gradient computed from corrupt weights is ever committed. Without a strict
        majority (two members, one each) nobody can tell which side is sound, and
        the run stops saying so rather than guess. O(members), once per digested step.
        """
        groups: dict[str, list[int]] = {}
        for r in self.members:
            d = self.votes[r].weights_fingerprint
            if d is not None:
                groups.setdefault(d, []).append(r)
        if len(groups) <= 1:
            return None
        ref = max(groups, key=lambda d: len(groups[d]))
        digested = sum(len(rs) for rs in groups.values())
        seen = "; ".join(f"{d[:12]}: replica(s) {rs}" for d, rs in groups.items())
        if 2 * len(groups[ref]) <= digested:
            return self._finish(1, f"step {self.step}: the replicas' weights differ and no digest has a majority "
                                   f"({seen}): cannot tell the corrupt replicas from the sound", now)
        out: list[Out] = []
        for r in sorted(r for d, rs in groups.items() if d != ref for r in rs):
            why = f"weights digest at step {self.step} differs from the majority's ({seen}): silent data corruption"
            self._ban(r)
            out.append(self._fenced_record(r, f"replica {r} fenced: {why}", now, {
                "weights_digest": self.votes[r].weights_fingerprint, "majority_digest": ref}))
            out += self.on_lost(r, f"fenced: {why}", now)
        return out

    def _fence_ledgers(self, ledgers: dict[int, idranges.Ranges], lo: int, hi: int, how: str,
                       now: float) -> list[Out]:
        """Ledgers that do not add up to [lo, hi), each id once: fence the members whose ledger
        is not what they were dealt (a vote: exactly it; a rejoin: within it). Where that is
        not known (after a rebuild), the members whose ledger strays outside [lo, hi) or overlaps
        another's. With no one to blame (ids missing), the generation fails and its survivors
        rejoin, so the missing ids are dealt again. Rare path: O(M) is fine here."""
        bad = []
        for r, ledger in sorted(ledgers.items()):
            want = self._expected(r)
            if want is None:
                continue
            try:
                held = idranges.union_disjoint([ledger])
            except ValueError:
                held = None
            if held is None or (held != want if how == "voted" else not self._within(held, want)):
                bad.append(r)
        if not bad:
            seen: dict[int, int] = {}
            for ledger in ledgers.values():
                for i in idranges.to_ids(ledger):
                    seen[i] = seen.get(i, 0) + 1
            bad = sorted(r for r, ledger in ledgers.items()
                         if any(not lo <= i < hi or seen[i] > 1 for i in idranges.to_ids(ledger)))
        if not bad:
            if self.state == "running":
                return self._fail(f"step {self.step}: the members' ledgers are not exactly the ids [{lo}, {hi})", now)
            return []
        out: list[Out] = []
        for r in bad:
            out += self.on_bad(r, f"it {how} at step {self.step} with ledger {ledgers[r]}, not what it was dealt", now)
        return out

    def _fence_odd_lr(self, now: float) -> list[Out]:
        """The votes name different learning rates (a schedule is a function of the step, so no
        worker does): fence the members off the most common rate (ties: the lowest member's)."""
        rates: dict[Any, list[int]] = {}
        for r in self.members:
            rates.setdefault(self.votes[r].lr, []).append(r)
        ref = max(rates, key=lambda lr: (len(rates[lr]), -rates[lr][0]))
        out: list[Out] = []
        for lr, rs in rates.items():
            if lr != ref:
                for r in rs:
                    out += self.on_bad(r, f"its vote's learning rate {lr} at step {self.step} is not the "
                                          f"members' {ref}", now)
        return out

    def _implicated(self) -> int | None:
        """The member the failure of generation `gen` points at, or None.

        The first member to report the failure is implicated: a replica whose own
        link is broken fails at once, while the others fail later and only as a
        consequence (or hear the abort before they notice). Nobody is implicated
        when a member was lost in the failure (its death explains the others'
        failed collectives: a ring neighbour of a SIGKILLed rank reports first), or
        when every member reported it (a symmetric fault, say the network or the
        store, singles no one out; the no-progress limit ends that livelock). A
        first reporter picked by chance (a hang that every waiter times out on)
        varies between generations, so it rarely builds a streak of `fence_after`.
        """
        if self.lost_in_failure or not self.reporters:
            return None
        if set(self.members) <= set(self.reporters):
            return None
        return self.reporters[0]

    def _attribute_failure(self, now: float) -> list[Out]:
        """Count the failed generation against the member it implicates; fence one at
        `fence_after` in a row (called once per failed generation, before the next forms)."""
        culprit = self._implicated() if self.gen >= 0 else None  # generation 0 forming: no failed generation
        failed_gen = self.gen
        self.reporters, self.lost_in_failure = [], False
        if culprit is None:
            return []  # no evidence either way: every streak stays as it was
        streak = self.implicated_streak.get(culprit, []) + [failed_gen]
        self.implicated_streak = {culprit: streak}  # another member implicated ends the others' streaks
        if len(streak) < self.fence_after or culprit not in self.expected:
            return []
        del self.implicated_streak[culprit]
        reason = (f"replica {culprit} fenced: implicated in {len(streak)} consecutive failed generations "
                  f"({', '.join(map(str, streak))}) at step {self.step}, as the first to report each failure "
                  f"while no member was lost")
        return self._fence(culprit, reason, now, {"generations": streak})

    def _fence(self, r: int, reason: str, now: float, evidence: dict[str, Any]) -> list[Out]:
        """Take `r` out of the run like a lost replica (its ledger's ids are redone), with a record."""
        self._ban(r)
        self.alive.discard(r)
        self.dead.add(r)
        self.expected.discard(r)
        self.joins.pop(r, None)
        self.joining.pop(r, None)
        self.unhealed.discard(r)
        self._record_failure(reason, now)
        return [self._fenced_record(r, reason, now, evidence), Out(Act.CLOSE, r, reason=reason)]

    def _ban(self, r: int) -> None:
        """Fenced on evidence: this process of `r` never comes back (a new process in its slot may)."""
        if self.pids.get(r) is not None:
            self.banned[r] = self.pids[r]

    def _fenced_record(self, r: int, reason: str, now: float, evidence: dict[str, Any]) -> Out:
        """The events.jsonl line saying `r` was fenced, why, and on what evidence."""
        return Out(Act.EVENT, r, msg={"kind": "fenced", "replica": r, "reason": reason, "step": self.step, "at": now,
                                    **evidence}, reason=reason)
