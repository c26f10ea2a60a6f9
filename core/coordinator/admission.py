"""Admission: how a process enters a run already going, for the protocol state machine.

Contract (the admission invariants of core/coordinator/protocol.py, kept here):
- A hello for a dead replica's slot from a process that can be healed (`can_heal`) makes
  it a newcomer (`_newcomer`: "pending"), unless that process was fenced on evidence
  (`banned`: refused). `slot_open_to` and `same_process` answer the service the same way.
- Newcomers are admitted only at a commit, never inside an iteration (`_admit`, the only
  place a replica enters a running generation): generation gen+1 is the members plus the
  newcomers, and its gen message names one donor, the fastest member by the measured
  speeds (ties: the lowest id), to send them its state. Below `min_replicas` (`_short`)
  the next step waits at the boundary for more.
- Until a newcomer's state arrived (`on_healed`, or a vote) it is `unhealed`: a
  generation that fails first sends it back to waiting for the next commit
  (`_unhealed_join`), and after `max_heal_attempts` such failures it is refused for good
  as that process (`_refuse_newcomer`: a "join_refused" record); its slot stays open to
  a new process.
- A newcomer's "join" record is written at its first real commit (`_first_commits`),
  with every member's weights digest as the evidence that it was healed.

Why a mixin of `ProtocolStateMachine`, not a state object: the newcomers, the joining
and the unhealed replicas are dropped or reset by the machine's loss, fence and rebuild
paths (`on_lost`, `_fence`, `rebuild`), read by its commit (`_advance`) and its vote
(`on_vote`), and admission itself re-forms the shared membership (members, generation,
state); so that state stays the machine's attributes and these methods are the machine's.
"""
from __future__ import annotations

from typing import Any

from recover.core.contract import idranges
from recover.core.contract.iteration import iteration_range
from recover.core.coordinator.actions import Act, Out


class AdmissionMixin:
    """`ProtocolStateMachine`'s admission of newcomers (see the module's docstring)."""

    def note_pid(self, r: int, pid: Any) -> None:
        """Replica r's process id, as its latest hello gave it (a restarted coordinator's reports)."""
        self.pids[r] = pid

    def same_process(self, r: int, pid: Any) -> bool:
        """Whether `pid` is the process replica r last said hello from (a reconnect, not a newcomer)."""
        return pid is not None and pid == self.pids.get(r)

    def slot_open_to(self, r: int, can_heal: bool) -> bool:
        """Whether a hello for slot r may take it: a slot declared dead takes only a newcomer that
        can be healed (admission); any other slot takes its replica."""
        return r not in self.dead or can_heal

    def _newcomer(self, r: int, msg: dict, now: float) -> list[Out]:
        """A hello for a dead replica's slot, from a process that can receive the state."""
        pid = msg.get("pid")
        if pid is not None and self.banned.get(r) == pid:
            return [Out(Act.CLOSE, r, {"t": "refused"},
                        reason=f"replica {r} (pid {pid}) was fenced on evidence and is not readmitted")]
        self.dead.discard(r)
        self.alive.add(r)
        self.pids[r] = pid
        why = "woken" if msg.get("rejoin") else "replacement"
        self.newcomers[r] = {"replica": r, "pid": pid, "why": why, "hello_at": now,
                             "started_at": float(msg.get("started_at", now)), "attempts": 0}
        out = [Out(Act.SEND, r, {"t": "pending", "step": self.step},
                   reason=f"replica {r} ({why}, pid {pid}) waits for admission at the next commit")]
        if self.state == "waiting" and not self._short():
            out += self._admit(now)
        return out

    def _short(self) -> bool:
        """Fewer members and newcomers than `min_replicas`: the next step waits for more."""
        return len(self.members) + len(self.newcomers) < self.min_replicas

    def on_healed(self, r: int, msg: dict, now: float) -> list[Out]:
        """A newcomer's state arrived from its donor: what moved goes into its join record."""
        if msg.get("gen") != self.gen or r not in self.joining:
            return []
        self.unhealed.discard(r)
        self.joining[r].update(healed_at=now, bytes=msg.get("bytes"), transfer_seconds=msg.get("seconds"),
                               weights_digest=msg.get("weights_fingerprint"),
                               **({"shard_fingerprints": msg["shard_fingerprints"]}
                                  if msg.get("shard_fingerprints") is not None else {}))
        return []

    def _unhealed_join(self, r: int, now: float) -> list[Out]:
        """A newcomer whose state transfer failed: it waits for the next commit again."""
        if r not in self.unhealed:
            return self.on_bad(r, "it rejoined saying it lacks the state, but it was a healed member", now)
        self.unhealed.discard(r)
        self.expected.discard(r)
        rec = self.joining.pop(r)
        rec["attempts"] += 1
        failed = Out(Act.EVENT, msg={"kind": "join_failed", "replica": r, "generation": self.gen,
                                   "attempts": rec["attempts"], "at": now},
                     reason=f"replica {r}'s state transfer failed with generation {self.gen} "
                            f"(attempt {rec['attempts']} of {self.max_heal_attempts})")
        if rec["attempts"] >= self.max_heal_attempts:
            return [failed] + self._refuse_newcomer(r, rec, now) + self._maybe_publish(now)
        for key in ("generation", "donor", "admitted_at", "step"):
            rec.pop(key, None)
        self.newcomers[r] = rec
        return [Out(Act.SEND, r, {"t": "pending", "step": self.step}), failed] + self._maybe_publish(now)

    def _refuse_newcomer(self, r: int, rec: dict[str, Any], now: float) -> list[Out]:
        """A newcomer that could not be healed `max_heal_attempts` times is refused, never admitted again
        as this process: re-admitted at every commit, it would fail every generation that admits it
        (a state the donors cannot send, a newcomer that cannot load it). Its slot is free: a new
        process in it (the launcher's replacement) is a newcomer like any other."""
        reason = (f"replica {r} (pid {rec.get('pid')}) refused: its state transfer failed {rec['attempts']} "
                  f"time(s) (--max-heal-attempts {self.max_heal_attempts})")
        self._ban(r)
        self.alive.discard(r)
        self.dead.add(r)
        return [Out(Act.EVENT, msg={"kind": "join_refused", "replica": r, "pid": rec.get("pid"), "why": rec.get("why"),
                                  "attempts": rec["attempts"], "step": self.step, "reason": reason, "at": now},
                    reason=reason),
                Out(Act.CLOSE, r, {"t": "refused"}, reason=reason)]

    def _admit(self, now: float) -> list[Out]:
        """At a boundary (the members heard a commit with `next`): generation gen+1 = the
        members + the newcomers runs step `self.step`.

        Its gen message goes to all of them; it names the donor, the fastest member
        by the measured speeds (ties: the lowest id), which sends its state before
        folding its own quota. This is the only place a replica enters a running
        generation, so a newcomer never sees a half-done iteration."""
        old, joining = list(self.members), sorted(self.newcomers)
        donor = max(old, key=lambda r: (self.speeds.get(r, 0.0), -r))
        # the members owe the step's work from now: the wait for newcomers (state "waiting") owed
        # nothing, however long a replacement took to start (the progress rule, `_stalled`)
        self.readiness.owed_since = now
        self.state = "running"
        self.gen += 1
        self.next_gen = self.gen
        self.members = sorted(old + joining)
        self.member_set = set(self.members)
        self.member_ranges = idranges.from_ids(self.members)
        self.unhealed = set(joining)
        self.gen_started = now
        for r in joining:
            rec = self.newcomers.pop(r)
            rec.update(generation=self.gen, step=self.step, donor=donor, admitted_at=now)
            self.joining[r] = rec
        heal = {"donor": donor, "joining": idranges.from_ids(joining)} if joining else None
        out = [Out(Act.EVENT, msg={"kind": "admitted", "replicas": joining, "generation": self.gen,
                                 "step": self.step, "donor": donor, "members": list(self.members), "at": now},
                   reason=f"generation {self.gen} admits replica(s) {joining} at step {self.step} "
                          f"(state from replica {donor})")] if joining else []
        return out + self._deal({"t": "gen", "gen": self.gen, "step": self.step, "members": self.member_ranges,
                                 "microbatches": self.M, "steps": self.S, **({"heal": heal} if heal else {})},
                                [list(iteration_range(self.step, self.M))])

    def _first_commits(self, now: float) -> list[Out]:
        """The join records of the newcomers that took part in the step just committed.

        Written at a newcomer's first commit, with the evidence that it was healed:
        every member's weights digest as their votes carried it (the first vote of an
        admitting generation always does), which the commit just found equal."""
        out = []
        for r in sorted(r for r in self.joining if r in self.member_set and "healed_at" in self.joining[r]):
            rec = self.joining.pop(r)
            rec.update(first_commit_at=now, first_commit_step=self.step,
                       start_to_first_commit_seconds=now - rec["started_at"],
                       member_digests={str(m): self.votes[m].weights_fingerprint for m in self.members})
            out.append(Out(Act.EVENT, msg={"kind": "join", **rec},
                           reason=f"replica {r} ({rec['why']}) committed its first step {self.step}: "
                                  f"{rec['bytes']} bytes in {rec['transfer_seconds']:.3f}s from replica "
                                  f"{rec['donor']}, {rec['start_to_first_commit_seconds']:.1f}s after its start"))
        return out
