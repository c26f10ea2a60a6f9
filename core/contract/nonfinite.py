"""Non-finite losses: what a worker records and votes, and how the coordinator names them.

Contract:
- A loss that is NaN or infinite is an event, never a malformed line: the vote of
  the step says `loss_sum: null` (JSON has no NaN; the coordinator's orjson parser
  refuses one) and, from the replica that folded them, `nonfinite`: the id ranges
  of its ledger whose loss was not finite. Every member's reduced loss sum is then
  non-finite (the all-reduce carries the loss with the gradient), so every vote of
  the step says `loss_sum: null`, and the votes of the replicas that folded the bad
  microbatches name them.
- `NonfiniteLosses` is the worker's record: `record(id, loss)` on each fold (a
  finite loss for an id clears it: an id discarded and folded again counts by its
  last fold), `in_ledger(ledger)` the ids of the current ledger whose loss was not
  finite, as id ranges. Ids that left the ledger (a step committed, a discard, a
  rejoin) drop out by themselves, so nothing has to be told of every clear.
  `held(ledger)` is the same as a set of ids; `mark(ids)` records ids another rank
  of the replica folded with a non-finite loss part (its leader names them).
- `vote_fields(loss_sum, ledger, losses)` is what a vote carries of this: the
  loss sum (None when not finite) and, when any, `nonfinite`.
- `ON_NONFINITE` are the choices of `--on-nonfinite`: "stop" (the default) ends the
  run at once, everything committed kept; "skip" drops the step (no optimizer
  step, every member clears its accumulator) and the run goes on with the next
  step's own ids. `describe(step, generation, named)` is the line that names it.
- The learning-rate schedule on a skipped step: it moves on as if the step had
  run (a rate is a function of the step index, core/worker/recipe.py `CommittedStep.skip`).
  Why: the step index is the run's position in its data and its plan (the cosine
  schedule ends at --steps, warm-up is counted in steps), so a skipped step costs
  one update and nothing else; the rate each later step uses is the failure-free
  run's, and `lr` in metrics.jsonl keeps meaning "the rate of step s". Holding the
  schedule back instead would shift every later rate by one and end the run off
  its planned floor.
Importing this module imports no torch.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from recover.core.contract import idranges

ON_NONFINITE = ("stop", "skip")


class NonfiniteLosses:
    """The ids this worker folded with a loss that was not finite (their last fold's)."""

    __slots__ = ("_ids",)

    def __init__(self) -> None:
        self._ids: set[int] = set()

    def record(self, mb_id: int, loss: float) -> None:
        """One fold of `mb_id` with `loss` (O(1); a finite loss costs one set discard)."""
        if math.isfinite(loss):
            self._ids.discard(mb_id)
        else:
            self._ids.add(mb_id)

    def in_ledger(self, ledger: Sequence[int]) -> idranges.Ranges:
        """The ids of `ledger` folded with a non-finite loss, as id ranges ([] in the common case)."""
        if not self._ids:
            return []
        return idranges.from_ids(sorted(self.held(ledger)))

    def held(self, ledger: Sequence[int]) -> set[int]:
        """The ids of `ledger` folded with a non-finite loss, as a set (empty in the common case)."""
        if not self._ids:
            return set()
        self._ids &= set(ledger)  # ids that left the ledger are gone for good (a new step has new ids)
        return set(self._ids)

    def mark(self, ids: Sequence[int]) -> None:
        """Ids folded with a non-finite loss elsewhere in this replica (another rank's rows)."""
        self._ids.update(ids)


def vote_fields(loss_sum: float, ledger: Sequence[int], losses: NonfiniteLosses) -> dict[str, Any]:
    """The loss part of a vote: `loss_sum` (None if not finite) and `nonfinite` when any."""
    out: dict[str, Any] = {"loss_sum": loss_sum if math.isfinite(loss_sum) else None}
    bad = losses.in_ledger(ledger)
    if bad:
        out["nonfinite"] = bad
    return out


def describe(step: int, generation: int, named: Mapping[int, idranges.Ranges]) -> str:
    """The line naming a step whose loss was not finite: the replicas and their microbatch ids."""
    if not named:
        return (f"step {step} (generation {generation}): the loss sum was not finite, and no replica named a "
                f"microbatch whose own loss was not (an overflow of the sum)")
    parts = "; ".join(f"replica {r}: microbatch(es) {_ids_text(ids)}" for r, ids in sorted(named.items()))
    return f"step {step} (generation {generation}): non-finite loss at {parts}"


def _ids_text(ranges: idranges.Ranges, most: int = 20) -> str:
    ids = idranges.to_ids(ranges)
    shown = ", ".join(map(str, ids[:most]))
    return f"[{shown}{', ...' if len(ids) > most else ''}]" + (f" ({len(ids)} ids)" if len(ids) > most else "")
