"""core/coordinator/vote_tally.py: what one step's votes add up to, checked against the votes themselves."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recover.core.contract import idranges
from recover.core.contract.step_messages import Vote
from recover.core.coordinator.vote_tally import VoteTally

KEYS = [str(r) for r in range(16)]


def _vote(ledger, **optional) -> Vote:
    """An ok vote of step 0 with that ledger (the tally reads only what is named here)."""
    return Vote(0, 0, True, ledger, 1.0, **optional)


@settings(max_examples=200, deadline=None)
@given(ledgers=st.dictionaries(st.integers(0, 15), st.sets(st.integers(0, 60), max_size=12), min_size=1),
       seconds=st.lists(st.one_of(st.none(), st.floats(0.01, 5.0)), min_size=16, max_size=16))
def test_the_tally_is_what_the_votes_said(ledgers, seconds):
    tally = VoteTally(KEYS)
    for n, (r, ids) in enumerate(ledgers.items(), 1):
        msg = _vote(idranges.from_ids(ids), lr=0.1, mb_seconds=seconds[r])
        assert tally.add(r, msg) == n and tally[r] is msg
    assert len(tally) == len(ledgers) and list(tally.votes) == list(ledgers)  # arrival order
    assert tally.ledgers == {str(r): idranges.from_ids(ids) for r, ids in ledgers.items()}
    assert tally.seconds == {r: seconds[r] for r in ledgers if seconds[r]}
    assert tally.lrs == {0.1} and not tally.digested


@pytest.mark.parametrize("bad", [[0, 1], [[1.0, 2]], [[True, 2]], [[3, 3]], [[4, 2]], [[1, 2, 3]], "x",
                                 [[0, 2], [5]]])
def test_a_malformed_ledger_is_refused_and_nothing_is_taken(bad):
    tally = VoteTally(KEYS)
    with pytest.raises(ValueError):
        tally.add(3, _vote(bad))
    assert len(tally) == 0 and not tally.ledgers and not tally.votes


def test_digests_and_disagreeing_rates_are_noted_for_the_commit_to_judge():
    tally = VoteTally(KEYS)
    tally.add(0, _vote([[0, 2]], lr=0.1))
    tally.add(1, _vote([[2, 4]], lr=0.2, weights_fingerprint="ab"))
    assert tally.digested and tally.lrs == {0.1, 0.2}


def test_a_second_vote_of_one_member_replaces_its_first_in_every_sum():
    tally = VoteTally(KEYS)
    tally.add(0, _vote([[0, 2]], lr=0.1))
    tally.add(1, _vote([[2, 4]], lr=0.5, mb_seconds=0.3, weights_fingerprint="ab"))
    assert tally.add(1, _vote([[2, 3]], lr=0.1)) == 2
    assert tally.ledgers == {"0": [[0, 2]], "1": [[2, 3]]}
    assert tally.lrs == {0.1} and tally.seconds == {} and not tally.digested
