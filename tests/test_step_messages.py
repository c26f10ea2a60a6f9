"""The step's typed messages (core/contract/step_messages.py) are the schema's, and carry the same wire.

What is held: each class's fields are its message's fields in core/contract/messages.py, by
name, order and required/optional, so the classes and the schema cannot drift apart; any
message the schema allows reads and writes back as the same dict (`from_wire` then
`to_wire`), key for key and in the schema's order; a message built with a class passes the
schema's strict check and the coordinator's wire check, and reads back equal. Pure: no process.
"""
from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recover.core.contract import messages, wire
from recover.core.contract.step_messages import STEP_MESSAGES, Commit, Go, Ready, Vote


def test_the_step_round_has_a_class_for_each_of_its_messages():
    """ready, go, vote, commit: what a failure-free step sends (docs/protocol.md)."""
    assert set(STEP_MESSAGES) == {"ready", "go", "vote", "commit"}
    assert {messages.BY_TYPE[t].sender for t in ("ready", "vote")} == {"worker"}
    assert {messages.BY_TYPE[t].sender for t in ("go", "commit")} == {"coordinator"}


@pytest.mark.parametrize("kind", sorted(STEP_MESSAGES))
def test_each_class_has_its_schemas_fields_and_which_are_required(kind):
    cls, schema = STEP_MESSAGES[kind], messages.BY_TYPE[kind]
    fields = msgspec.structs.fields(cls)
    assert tuple(f.name for f in fields) == tuple(f.name for f in schema.fields), \
        f"{cls.__name__} and the schema of {kind} differ"
    required = {f.name for f in schema.fields if f.required}
    assert {f.name for f in fields if f.required} == required
    # an optional field is absent as None: the class's default says "not sent"
    assert all(f.default is None for f in fields if not f.required)
    assert cls.TYPE == kind


_KIND_VALUES = {
    messages.INT: st.integers(-2**40, 2**40),
    messages.NUM: st.one_of(st.integers(-10**6, 10**6), st.floats(allow_nan=False, allow_infinity=False)),
    messages.BOOL: st.booleans(),
    messages.STR: st.text(max_size=12),
    messages.IDS: st.lists(st.integers(0, 1000), max_size=6).map(
        lambda xs: [[a, a + 1 + b] for a, b in zip(sorted(set(xs))[::2], range(3))]),
}


@st.composite
def _wire_dict(draw, kind: str) -> dict:
    """A message of `kind` the schema allows, with its fields in the schema's order: every
    required field (a nullable one possibly null), each optional one present or not."""
    d = {"t": kind}
    for f in messages.BY_TYPE[kind].fields:
        if not f.required and not draw(st.booleans()):
            continue
        d[f.name] = None if f.nullable and draw(st.booleans()) else draw(_KIND_VALUES[f.kind])
    return d


@settings(max_examples=200, deadline=None)
@given(data=st.data(), kind=st.sampled_from(sorted(STEP_MESSAGES)))
def test_any_message_reads_and_writes_back_as_the_same_dict(data, kind):
    d = data.draw(_wire_dict(kind))
    assert messages.schema_problem(d) == ""
    msg = STEP_MESSAGES[kind].from_wire(d)
    back = msg.to_wire()
    assert back == d and list(back) == list(d)  # the same keys, values and order: the same line
    line = wire.loads(msg.to_line())  # the line encoded straight from the object says the same
    assert line == d and list(line) == list(d)


def test_a_vote_built_with_the_class_passes_the_coordinators_check_and_reads_back_equal():
    vote = Vote(3, 1200, True, [[4800, 4804]], 10.25, mb_seconds=0.031, progress_gap=0.002, lr=6e-4,
                weights_fingerprint="ab" * 32)
    line = wire.dumps(vote.to_wire())
    assert vote.to_line() == line  # the worker's own encoding is byte for byte orjson's of the dict
    assert line == (b'{"t":"vote","gen":3,"step":1200,"ok":true,"ledger":[[4800,4804]],"loss_sum":10.25,'
                    b'"mb_seconds":0.031,"progress_gap":0.002,"lr":0.0006,"weights_fingerprint":"' + b"ab" * 32 + b'"}')
    msg, why = wire.parse_line(line)
    assert why == "" and Vote.from_wire(msg) == vote
    # a null loss sum (not finite) is a value, sent as null; an absent optional field is not sent
    assert Vote(0, 0, True, [], None).to_wire() == {"t": "vote", "gen": 0, "step": 0, "ok": True, "ledger": [],
                                                    "loss_sum": None}


def test_an_optional_field_sent_as_null_reads_as_absent():
    """wire.py checks an optional field only "when present and not null"; the class agrees."""
    d = {"t": "vote", "gen": 0, "step": 1, "ok": True, "ledger": [[0, 2]], "loss_sum": 1.0, "lr": None}
    assert wire.parse_line(wire.dumps(d))[1] == ""
    vote = Vote.from_wire(d)
    assert vote.lr is None and "lr" not in vote.to_wire()


def test_the_coordinators_messages_built_with_the_classes_are_what_the_schema_allows():
    assert messages.schema_problem(Go(2, 9).to_wire()) == ""
    assert messages.schema_problem(Ready(2, 9).to_wire()) == ""
    boundary = Commit(2, 9, None, quota=[], next=3, skipped=True).to_wire()
    assert boundary == {"t": "commit", "gen": 2, "step": 9, "loss": None, "quota": [], "next": 3, "skipped": True}
    assert messages.schema_problem(boundary) == ""
    assert Commit.from_wire(boundary) == Commit(2, 9, None, None, [], 3, True)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), kind=st.sampled_from(["vote", "ready"]))
def test_the_coordinators_read_of_a_line_is_the_wires_verdict_and_the_class_read(data, kind):
    """wire.read_line (what the service calls) accepts and refuses what parse_line does, and a
    vote or ready it accepts is `from_wire` of parse_line's dict, whether the fast path read
    it or the tables checked it."""
    d = data.draw(_wire_dict(kind))
    if kind == "vote" and data.draw(st.booleans()):
        d["ledger"] = [[d["step"] % 50, d["step"] % 50 + 4]]  # the common shape: one range (the fast path)
    line = wire.dumps(d)
    msg, why = wire.parse_line(line)
    read, read_why = wire.read_line(line)
    assert read_why == why
    assert (read is None) if msg is None else read == STEP_MESSAGES[kind].from_wire(msg)
    assert read is None or type(read) is STEP_MESSAGES[kind]
