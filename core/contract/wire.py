"""What the coordinator accepts on a control connection: the messages' shapes and limits.

Contract:
- `parse_line(line)` turns one received line into a message dict, or says why it
  is refused: not JSON (or not UTF-8, or nested absurdly deep), not an object,
  an unknown type, or a field of a known type missing or of the wrong type (an
  int field must be a JSON integer, not a bool or a float; a ledger a list of
  id ranges, `[[start, stop], ...]` int pairs as `idranges.check` accepts; a vote's
  `loss_sum` must be there, a number or null: `_REQUIRED_NULLABLE`). It never raises: the control port is reachable by any machine on
  a cluster's network, and no line from it may crash the coordinator.
- A vote (R of them per step) is checked by `_vote_ok`, and a rejoin (R per
  recovery) by `_join_ok`: the same rules written out for the common shape (one
  ledger range, or none for a rejoin): True only where the tables below would
  accept it, and anything else goes through the tables, which give the reason. At
  R = 16,384 the tables' checks cost 30 ms a step, three times the JSON parse
  (`recover bench coordinator`); `tests/test_control_port.py` holds the two equal.
- `read_line(line)` is what the coordinator calls: `parse_line`'s verdict, with a vote and a
  ready read into their typed classes (core/contract/step_messages.py `Vote`, `Ready`), the
  common vote's read done in the same pass as its check (`_read_vote`).
- `MAX_LINE_BYTES` bounds one line (a vote's ledger is a few id ranges, so
  this is room, not a budget); `MAX_REFUSALS` is how many refused messages one connection may send
  before the coordinator closes it.
- The shapes here are those of the worker -> coordinator messages in `core/contract/messages.py` (the one schema); what
  a well-formed message means (its generation, its step) is the protocol's
  business, not this module's.
- `loads(bytes)` / `dumps(obj) -> bytes` are the control port's JSON codec: orjson
  when it is installed (a project dependency; ~5x faster than the standard library,
  which at R = 16,384 votes per step is most of a commit's cost), else `json`. Both
  refuse what parse_line must refuse (non-UTF-8, not JSON, nesting past the recursion
  limit); orjson is stricter still (no NaN/Infinity, integers within 64 bits).
"""
from __future__ import annotations

import json
from typing import Any

try:  # the fast codec; the standard library's is the fallback (same messages, slower)
    import orjson as _orjson
except ImportError:  # pragma: no cover - exercised where orjson is not installed
    _orjson = None

from recover.core.contract import idranges

MAX_LINE_BYTES = 4 << 20  # 4 MiB: even a ledger of 100k scattered ids (as ranges) fits
MAX_REFUSALS = 8  # refused messages one connection may send before it is closed

if _orjson is not None:
    loads = _orjson.loads  # JSONDecodeError is a ValueError, as json's is

    def dumps(obj: Any) -> bytes:
        """One message as its line's bytes (no newline)."""
        return _orjson.dumps(obj)
else:
    loads = json.loads

    def dumps(obj: Any) -> bytes:
        """One message as its line's bytes (no newline)."""
        return json.dumps(obj, separators=(",", ":")).encode()


from recover.core.contract.messages import BOOL as _BOOL, IDS as _IDS, INT as _INT, NUM as _NUM, REPORT as _REPORT_KIND, STR as _STR
from recover.core.contract.messages import OBJ as _OBJ, received_by_coordinator
from recover.core.contract.step_messages import Ready, Vote


# A hello's report (core/worker/replica.py `_report`): where the worker stands, for `ProtocolStateMachine.rebuild`.
# Every field is required; `awaiting` and `vote` may be null.
_REPORT: dict[str, str] = {"member": _BOOL, "step": _INT, "gen": _INT, "ledger": _IDS, "wait": _STR}
_REPORT_NULLABLE: dict[str, str] = {"awaiting": _INT}
_REPORT_VOTE: dict[str, str] = {"gen": _INT, "step": _INT, "ledger": _IDS}
_REPORT_VOTE_NULLABLE: dict[str, str] = {"loss_sum": _NUM}  # null: the step's loss was not finite

# The checks of every message the coordinator accepts, built from the one schema (core/contract/messages.py):
# type -> required fields and their kinds; required fields that may be null (null has a meaning of
# its own: a vote's loss_sum, core/contract/nonfinite.py); optional fields, checked when present and not null.
_REQUIRED: dict[str, dict[str, str]] = {
    m.type: {f.name: f.kind for f in m.fields if f.required and not f.nullable} for m in received_by_coordinator()}
_REQUIRED_NULLABLE: dict[str, dict[str, str]] = {
    m.type: {f.name: f.kind for f in m.fields if f.required and f.nullable}
    for m in received_by_coordinator() if any(f.required and f.nullable for f in m.fields)}
_OPTIONAL: dict[str, dict[str, str]] = {
    m.type: {f.name: f.kind for f in m.fields if not f.required}
    for m in received_by_coordinator() if any(not f.required for f in m.fields)}


def _fields_ok(obj: Any, required: dict[str, str], nullable: dict[str, str] | None = None) -> bool:
    if not isinstance(obj, dict):
        return False
    if not all(name in obj and _is(want, obj[name]) for name, want in required.items()):
        return False
    return all(obj.get(name) is None or _is(want, obj[name]) for name, want in (nullable or {}).items())


def _report_ok(v: Any) -> bool:
    if not _fields_ok(v, _REPORT, _REPORT_NULLABLE):
        return False
    # `vote`: the last vote sent; `committed_vote` (absent from older workers): the last committed one
    return all(vote is None or (_fields_ok(vote, _REPORT_VOTE, _REPORT_VOTE_NULLABLE) and "loss_sum" in vote
                                and (vote.get("lr") is None or _is(_NUM, vote["lr"])))
               for vote in (v.get("vote"), v.get("committed_vote")))


def _is(kind: str, v: Any) -> bool:
    if kind == _REPORT_KIND:
        return _report_ok(v)
    if kind == _INT:
        return isinstance(v, int) and not isinstance(v, bool)
    if kind == _BOOL:
        return isinstance(v, bool)
    if kind == _STR:
        return isinstance(v, str)
    if kind == _NUM:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if kind == _OBJ:
        return isinstance(v, dict)
    try:
        idranges.check(v)
    except ValueError:
        return False
    return True


_NUM_OR_NONE = frozenset((int, float, type(None)))
_STR_OR_NONE = frozenset((str, type(None)))
_BOOL_OR_NONE = frozenset((bool, type(None)))


def _read_vote(msg: dict[str, Any]) -> Vote | None:
    """A vote of the common shape, checked as the tables would and read into its class on the
    way (None: ask the tables). One pass over its fields for both: the coordinator reads R
    votes a step, and a check then a read of the same dict cost a quarter more (benchmarks/micro).

    Parsed JSON has exact types (int, float, bool, str, list), so `type(v) is int`
    is the tables' "an int, not a bool"."""
    get = msg.get
    # (one assignment each: a multiple assignment of four builds and unpacks a tuple, R times a step)
    ledger = get("ledger")
    gen = get("gen")
    step = get("step")
    ok = get("ok")
    if (type(ledger) is not list or len(ledger) != 1 or type(gen) is not int
            or type(step) is not int or type(ok) is not bool or "loss_sum" not in msg):
        return None
    p = ledger[0]
    loss_sum = get("loss_sum")
    mb_seconds = get("mb_seconds")
    progress_gap = get("progress_gap")
    lr = get("lr")
    reason = get("reason")
    fingerprint = get("weights_fingerprint")
    if (type(p) is list and len(p) == 2 and type(p[0]) is int and type(p[1]) is int and p[0] < p[1]
            and type(loss_sum) in _NUM_OR_NONE and type(mb_seconds) in _NUM_OR_NONE
            and type(lr) in _NUM_OR_NONE and type(progress_gap) in _NUM_OR_NONE
            and type(reason) in _STR_OR_NONE and type(fingerprint) in _STR_OR_NONE
            and get("nonfinite") is None):  # a vote naming non-finite losses (rare) goes through the tables
        # Vote's fields in the schema's order (tests/test_step_messages.py holds it), nonfinite None
        return Vote(gen, step, ok, ledger, loss_sum, mb_seconds, progress_gap, lr, reason, fingerprint, None)
    return None


def _vote_ok(msg: dict[str, Any]) -> bool:
    """Whether a vote of the common shape passes the tables' checks (False: ask the tables)."""
    return _read_vote(msg) is not None


def _join_ok(msg: dict[str, Any]) -> bool:
    """`_vote_ok` for a rejoin (R of them per recovery): the common shape, or False (ask the tables)."""
    get = msg.get
    ledger = get("ledger")
    if type(ledger) is not list or type(get("gen")) is not int or type(get("step")) is not int:
        return False
    if ledger:
        if len(ledger) != 1:
            return False
        p = ledger[0]
        if type(p) is not list or len(p) != 2 or type(p[0]) is not int or type(p[1]) is not int or not p[0] < p[1]:
            return False
    return type(get("healed")) in _BOOL_OR_NONE


def parse_line(line: bytes) -> tuple[dict[str, Any] | None, str]:
    """(message, "") for an acceptable line, else (None, why it is refused)."""
    if len(line) > MAX_LINE_BYTES:
        return None, f"oversized line ({len(line)} bytes > {MAX_LINE_BYTES})"
    try:
        msg = loads(line)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None, f"malformed line ({type(e).__name__}: {str(e)[:80]})"
    return _parsed(msg)


def _parsed(msg: Any) -> tuple[dict[str, Any] | None, str]:
    """parse_line's verdict on a decoded line."""
    if not isinstance(msg, dict):
        return None, f"not a JSON object ({type(msg).__name__})"
    kind = msg.get("t")
    if (kind == "vote" and _vote_ok(msg)) or (kind == "join" and _join_ok(msg)):
        return msg, ""
    if not isinstance(kind, str) or kind not in _REQUIRED:
        return None, f"unknown message type {str(kind)[:40]!r}"
    why = _table_problem(kind, msg)
    return (None, why) if why else (msg, "")


def read_line(line: bytes) -> tuple[dict[str, Any] | Vote | Ready | None, str]:
    """`parse_line`, with the step's messages from a worker read into their classes
    (core/contract/step_messages.py): a vote as a `Vote`, a ready as a `Ready`; any other
    message as its dict. What it accepts and refuses, and why, is parse_line's."""
    if len(line) > MAX_LINE_BYTES:
        return parse_line(line)
    try:
        msg = loads(line)
    except (ValueError, RecursionError):
        return parse_line(line)  # (it says why)
    if type(msg) is dict:
        kind = msg.get("t")
        if kind == "vote":
            if (vote := _read_vote(msg)) is not None:
                return vote, ""
        elif kind == "ready":
            gen, step = msg.get("gen"), msg.get("step")
            if type(gen) is int and type(step) is int:  # all the tables check of a ready
                return Ready(gen, step), ""
    msg, why = _parsed(msg)
    if msg is None:
        return None, why
    kind = msg["t"]
    return (Vote.from_wire(msg) if kind == "vote" else Ready.from_wire(msg) if kind == "ready" else msg), ""


def _table_problem(kind: str, msg: dict[str, Any]) -> str:
    """What the tables find wrong with a message of a known type ('' if nothing)."""
    for name, want in _REQUIRED[kind].items():
        if name not in msg or not _is(want, msg[name]):
            return f"{kind}: field {name!r} missing or not a {want}"
    for name, want in _REQUIRED_NULLABLE.get(kind, {}).items():
        if name not in msg or (msg[name] is not None and not _is(want, msg[name])):
            return f"{kind}: field {name!r} missing or not a {want} or null"
    for name, want in _OPTIONAL.get(kind, {}).items():
        if name in msg and msg[name] is not None and not _is(want, msg[name]):
            return f"{kind}: field {name!r} is not a {want}"
    return ""
