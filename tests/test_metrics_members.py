"""A metrics line's members and ledgers do not grow with R, losslessly.

core/storage/results.py packs recover's per-member ledgers run-length encoded (`pack_members`)
and `expand_members` / `read_metrics` give readers `members`, `ledgers` and `folded`
exactly as the votes said them. Pure: no process.
"""
from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from recover.core.contract import idranges, wire
from recover.core.contract.policy import equal_share
from recover.core.storage.results import expand_members, pack_members, read_metrics


@st.composite
def voted_ledgers(draw):
    """Members (sorted, not necessarily consecutive) and ledgers of one or several ranges,
    some empty: what a step's votes can say after any recovery."""
    members = sorted(draw(st.sets(st.integers(0, 40), min_size=1, max_size=12)))
    ledgers, next_id = {}, draw(st.integers(0, 100))
    for m in members:
        ids = []
        for _ in range(draw(st.integers(0, 3))):
            next_id += draw(st.integers(0, 3))  # gaps: another member's, or a redone share
            n = draw(st.integers(1, 4))
            ids += range(next_id, next_id + n)
            next_id += n
        ledgers[str(m)] = idranges.from_ids(ids)
    return members, ledgers


@given(voted_ledgers())
def test_packing_is_lossless(case):
    members, ledgers = case
    line = {"step": 3, **pack_members(members, ledgers)}
    line = json.loads(json.dumps(line))  # as a reader of the file gets it
    back = expand_members(line)
    assert back["members"] == members
    assert back["ledgers"] == {str(m): ledgers[str(m)] for m in members}
    assert back["folded"] == {str(m): idranges.count(ledgers[str(m)]) for m in members}


def test_equal_quotas_at_16384_replicas_are_a_few_runs_not_a_megabyte():
    R, M = 16384, 16384 * 4 + 100  # 100 left over: some members take one id more
    members = idranges.from_ids(range(R))
    ids = [[0, M]]
    ledgers = {str(r): equal_share(ids, members, r) for r in range(R)}
    packed = pack_members(range(R), ledgers)
    size = len(wire.dumps(packed))
    assert len(packed["ledger_runs"]) <= 2 and not packed["ledger_rest"] and size < 200, (packed, size)
    # the plain form, for scale: what each line carried before
    folded = {k: idranges.count(v) for k, v in ledgers.items()}
    assert len(wire.dumps({"members": list(range(R)), "ledgers": ledgers, "folded": folded})) > 600_000
    assert expand_members(packed)["ledgers"] == ledgers


def test_a_line_in_the_old_form_reads_as_it_was(tmp_path):
    old = {"step": 0, "members": [0, 2], "ledgers": {"0": [[0, 2]], "2": [[2, 4]]}, "folded": {"0": 2, "2": 2}}
    new = {"step": 1, **pack_members([0, 2], {"0": [[4, 6]], "2": [[6, 8]]})}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(old) + "\n" + json.dumps(new) + "\n")
    a, b = read_metrics(tmp_path / "metrics.jsonl")
    assert a == old
    assert b["members"] == [0, 2] and b["ledgers"] == {"0": [[4, 6]], "2": [[6, 8]]} and b["folded"] == {"0": 2, "2": 2}
