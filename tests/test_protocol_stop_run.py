"""A member that ends the run for a reason of its own (`stop_run`) stops it, no recovery.

A checkpoint writer whose saves failed --checkpoint-failures times in a row says
`stop_run` before it exits (core/training/resilient.py). Pure: the real `ProtocolStateMachine`. What
is held: every live replica hears `stop` with the member's reason, the run finishes
with exit 1, and the member's connection closing afterwards is not a lost replica
(before this message it was: a "recovery" record raced the launcher's end of the job).
"""
from __future__ import annotations

from recover.core.contract import wire
from recover.core.coordinator.protocol import ProtocolStateMachine


def formed(R: int = 3) -> ProtocolStateMachine:
    proto = ProtocolStateMachine(R, 6, 10, join_timeout=1.0, now=0.0)
    for r in range(R):
        proto.on_hello(r, {"tokens_per_mb": 1}, 0.0)
    assert proto.state == "running"
    return proto


def test_stop_run_stops_every_replica_and_the_closing_connection_is_no_recovery():
    proto = formed()
    out = proto.on_stop_run(0, {"t": "stop_run", "reason": "3 checkpoint saves in a row failed"}, 1.0)
    stops = {a.replica: a.msg for a in out if a.kind == "send"}
    assert sorted(stops) == [0, 1, 2] and all(m["t"] == "stop" for m in stops.values())
    assert all("replica 0 stopped the run: 3 checkpoint saves" in m["reason"] for m in stops.values())
    finish = [a for a in out if a.kind == "finish"]
    assert len(finish) == 1 and finish[0].code == 1 and "3 checkpoint saves" in finish[0].reason
    assert [a.msg["kind"] for a in out if a.kind == "event"] == ["stop_run"]
    # the writer exits: its connection closes after the stop, and nothing is recovered
    later = proto.on_lost(0, "control connection closed (process gone)", 1.1)
    assert not [a for a in later if a.kind in ("recovery", "finish", "send")]
    assert proto.on_stop_run(1, {"t": "stop_run", "reason": "again"}, 1.2) == []  # one end only


def test_stop_run_from_a_replica_already_lost_is_ignored():
    proto = formed()
    proto.on_lost(2, "heartbeats stopped", 0.5)
    assert proto.on_stop_run(2, {"t": "stop_run", "reason": "late"}, 0.6) == []
    assert proto.state != "finished"


def test_the_wire_takes_stop_run_with_a_reason_only():
    assert wire.parse_line(b'{"t": "stop_run", "reason": "disk full"}')[0] == {"t": "stop_run", "reason": "disk full"}
    refused = wire.parse_line(b'{"t": "stop_run"}')
    assert refused[0] is None and "reason" in refused[1]
