"""What the protocol state machine answers with (`Out`, of a kind `Act`), and its own error.

Contract: these are the only values that cross from the pure state machine
(core/coordinator/protocol.py and the concern modules beside it: rebuild.py,
readiness.py, ...) to the service (core/coordinator/service.py), which carries
each `Out` out with one handler per `Act`. Nothing here decides anything; it sits
below every module of the machine so that they share it without importing each other.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class Act(str, Enum):
    """What the service does with an `Out` (core/coordinator/service.py has one handler per kind).

    A str enum: `a.kind == "commit"` reads as it did when kinds were bare strings."""

    SEND = "send"  # send `msg` to `replica` (a broadcast is one msg object to many: encoded once)
    CLOSE = "close"  # close `replica`'s connection, saying why (fenced, or a refused hello)
    COMMIT = "commit"  # record `msg`, a committed step's line, in metrics.jsonl
    RECOVERY = "recovery"  # record `msg`, a recovery, in events.jsonl (and the log)
    EVENT = "event"  # record `msg` in events.jsonl and `reason` in the log
    FINISH = "finish"  # the run is over: exit `code`, for `reason`


@dataclass(slots=True)  # one per message sent: R of them per step
class Out:
    """One action for the service to carry out."""

    kind: Act  # which handler carries it out
    replica: int = -1  # for send/close
    msg: dict[str, Any] = field(default_factory=dict)  # send: the message; commit/recovery/event: the record
    code: int = 0  # finish: exit code
    reason: str = ""  # close/finish; send/event: a line for the coordinator's log



class ProtocolError(RuntimeError):
    """The protocol's own invariant was about to be broken (a bug, never a fault)."""

