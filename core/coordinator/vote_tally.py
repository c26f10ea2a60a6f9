"""One step's ok votes, summed as they arrive: what the commit needs, without a pass over R votes.

Contract:
- `add(r, msg)` takes member r's ok vote for the step being voted, after checking
  its ledger by core.contract.idranges.check's rules (ValueError, and nothing taken, if it
  is not a range list), and answers how many votes it holds. It keeps the vote
  (`votes`, in arrival order) and what the commit's metrics line and the speed
  policy read from it: r's ledger (keyed by str(r), as the line writes them), the learning rates seen, and the seconds per microbatch
  it reported (`seconds`, where it reported any). O(1) per vote (O(pairs) for a
  ledger of several ranges). A member's second vote for the step replaces its
  first in all of these (O(R), for a case no worker makes).
- `digested`: some vote carries a weights digest, so the commit must compare them.
- Nothing here decides anything: the state machine (core/coordinator/protocol.py) checks the
  ledgers' exactness, the learning rates' agreement and the digests at the commit,
  and turns the seconds into speeds (vectorized, core/coordinator/speeds.py) only if the step
  commits.
- Why it exists: the coordinator reads each vote once, when it is parsed and still
  in the CPU's cache. At R = 16,384 one pass over all votes at the commit, in any
  order, cost ~13 ms (cache misses on ~10 MB of vote objects), a quarter of
  vote-to-commit; done per vote as it arrives, it costs what the vote's parse
  already paid to bring it in (`recover bench coordinator` measures both).
"""
from __future__ import annotations

from typing import Any

from recover.core.contract import idranges
from recover.core.contract.step_messages import Vote


class VoteTally:
    """The ok votes of one (generation, step), and their sums."""

    __slots__ = ("votes", "ledgers", "lrs", "seconds", "digested", "_keys")

    def __init__(self, keys: list[str]):
        self._keys = keys  # replica -> its str key (made once per run, not per vote)
        self.votes: dict[int, Vote] = {}  # replica -> its vote, in arrival order
        self.ledgers: dict[str, idranges.Ranges] = {}  # str(replica) -> the ledger it voted
        self.lrs: set[Any] = set()  # the learning rates the votes name (one, unless replicas disagree)
        self.seconds: dict[int, float] = {}  # replica -> the seconds per microbatch it reported (if any)
        self.digested = False  # some vote carries a weights digest

    def __len__(self) -> int:
        return len(self.votes)

    def __getitem__(self, r: int) -> Vote:
        return self.votes[r]

    def add(self, r: int, vote: Vote) -> int:
        """Take r's ok vote; the number of votes held now. ValueError (nothing taken) if its
        ledger is not a range list."""
        ledger = vote.ledger
        if type(ledger) is list and len(ledger) == 1:
            # one range, the common case: checked and counted inline (idranges.check's rules)
            p = ledger[0]
            if type(p) is not list or len(p) != 2 or type(p[0]) is not int or type(p[1]) is not int or p[0] >= p[1]:
                idranges.check(ledger)  # raises, naming what is wrong
        else:
            idranges.check(ledger)
        votes = self.votes
        again = r in votes
        votes[r] = vote
        if again:
            # A second vote of one member for one step (no worker sends one): its last vote
            # counts alone, as when the commit read each member's vote from `votes`.
            self.seconds.pop(r, None)
            self.lrs = {v.lr for v in votes.values()}
            self.digested = any(v.weights_fingerprint is not None for v in votes.values())
        key = self._keys[r]
        self.ledgers[key] = ledger
        self.lrs.add(vote.lr)
        s = vote.mb_seconds
        if s:
            self.seconds[r] = s  # the arithmetic on them is done once per step, vectorized (core/coordinator/speeds.py)
        if vote.weights_fingerprint is not None:
            self.digested = True
        return len(votes)
