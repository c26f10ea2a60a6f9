"""One schema for the wire: core/contract/messages.py.

What is held: docs/protocol.md's message table is the schema rendered; the coordinator's
checks (core/contract/wire.py) are built from it, for every message it receives; and (in
tests/test_protocol_property.py) every message the coordinator sends matches it strictly.
Pure: no process.
"""
from __future__ import annotations

import json
from pathlib import Path

from recover.core.contract import messages, wire

ROOT = Path(__file__).resolve().parents[1]


def test_the_docs_table_is_the_schema_rendered():
    page = (ROOT / "docs" / "protocol.md").read_text()
    inside = page.split("<!-- messages:begin -->\n")[1].split("<!-- messages:end -->")[0]
    assert inside == messages.table(), "docs/protocol.md's table is stale: paste messages.table() in"


def test_the_coordinators_checks_come_from_the_schema():
    received = {m.type for m in messages.received_by_coordinator()}
    assert set(wire._REQUIRED) == received
    for m in messages.received_by_coordinator():
        for f in m.fields:
            table = (wire._REQUIRED if f.required and not f.nullable else
                     wire._REQUIRED_NULLABLE if f.required else wire._OPTIONAL)[m.type]
            assert table[f.name] == f.kind, (m.type, f.name)


def test_the_two_digests_have_two_names():
    """A hello's sha256 and a vote's fingerprint are different checks with different names."""
    hello, vote = messages.BY_TYPE["hello"], messages.BY_TYPE["vote"]
    assert "weights_sha256" in {f.name for f in hello.fields} and "weights_fingerprint" in {f.name for f in vote.fields}
    assert not any(f.name == "weights_digest" for m in messages.MESSAGES for f in m.fields)
    line = json.dumps({"t": "vote", "gen": 0, "step": 0, "ok": True, "ledger": [[0, 2], [4, 5]], "loss_sum": 1.0,
                       "weights_fingerprint": 7}).encode()
    assert wire.parse_line(line) == (None, "vote: field 'weights_fingerprint' is not a str")


def test_the_strict_check_names_what_is_wrong():
    assert messages.schema_problem({"t": "go", "gen": 1, "step": 2}) == ""
    assert "not in core/contract/messages.py" in messages.schema_problem({"t": "go", "gen": 1, "step": 2, "extra": 0})
    assert "required field 'step'" in messages.schema_problem({"t": "go", "gen": 1})
    assert "unknown message type" in messages.schema_problem({"t": "nope"})
    assert messages.schema_problem({"t": "commit", "gen": 0, "step": 0, "loss": None, "skipped": True}) == ""
