"""Every control message, once: its type, who sends it, its fields and what they mean.

Contract:
- `MESSAGES` is the single schema of the control connection (worker <-> coordinator, and the
  launcher's line). Each `Message` names its sender, its fields (`Field`: name, kind, whether
  it is required, whether null means something) and one line of meaning per field.
- `core/contract/wire.py` builds the checks of what the coordinator accepts from it (the worker's and
  the launcher's messages), so a field added here is checked there; `table()` renders it as
  the reference table of docs/protocol.md, and tests/test_messages.py holds the page to it and
  checks every message the coordinator's state machine sends in the property test against it.
- Two digests, two names: a hello carries `weights_sha256` (sha256 of every weight's bytes:
  the start-up check that every replica begins from the same weights), while votes and
  `healed` carry `weights_fingerprint` (integer sums of the weights' bits, computed on the
  device, every --digest-every steps: the check for silent corruption). Before, both were
  called `weights_digest`.
- Ids on the wire (quota, ledger, members, nonfinite) are `core.contract.idranges` range lists,
  [[start, stop], ...]: a few numbers per message whatever M and R are.
"""
from __future__ import annotations

from dataclasses import dataclass

# field kinds (what core/contract/wire.py checks)
INT, BOOL, STR, NUM, IDS = "int", "bool", "str", "number", "list of [start, stop] id ranges"
REPORT = "report object (see wire._REPORT)"
OBJ = "object"


@dataclass(frozen=True)
class Field:
    """One field of a message."""

    name: str  # the JSON key
    kind: str  # one of the kinds above
    doc: str  # what it means, one line
    required: bool = True  # must be present
    nullable: bool = False  # null is a value with a meaning of its own (a required field may be null)


@dataclass(frozen=True)
class Message:
    """One message type ("t" on the wire)."""

    type: str  # the value of "t"
    sender: str  # "coordinator" (to a worker), "service" (the coordinator's socket service), "worker", "launcher"
    doc: str  # what it says, one line
    fields: tuple[Field, ...] = ()


def _opt(name: str, kind: str, doc: str) -> Field:
    return Field(name, kind, doc, required=False)


MESSAGES: tuple[Message, ...] = (
    # ---- coordinator -> worker ----
    Message("gen", "coordinator", "a generation starts: fold your quota of `step`", (
        Field("gen", INT, "the generation"), Field("step", INT, "the step it works on"),
        Field("members", IDS, "its members"),
        _opt("split", IDS, "the ids all members share at equal speeds: each takes its policy.equal_share"),
        _opt("quota", IDS, "this member's own ids, while speeds differ (policy.quota_of reads either)"),
        Field("microbatches", INT, "M"), Field("steps", INT, "the run's steps"),
        _opt("digest", BOOL, "the first vote carries the weights fingerprint (an admitting generation)"),
        _opt("heal", OBJ, "{donor, joining}: the donor sends its state to the newcomers `joining`"))),
    Message("commit", "coordinator", "the step is committed; the quota is for step+1", (
        Field("gen", INT, "the generation that committed"), Field("step", INT, "the committed step"),
        Field("loss", NUM, "the step's mean loss (null: not finite, with skipped)", nullable=True),
        _opt("split", IDS, "step+1's shared ids (as in gen)"), _opt("quota", IDS, "step+1's own ids (as in gen)"),
        _opt("next", INT, "step+1 is this generation's: its gen message follows"),
        _opt("skipped", BOOL, "the loss was not finite and --on-nonfinite is skip: clear, no optimizer step"))),
    Message("pending", "coordinator", "answer to a newcomer's hello: admitted at the next commit", (
        Field("step", INT, "the step being worked on"),)),
    Message("abort", "coordinator", "the generation failed: rejoin `next` with your ledger", (
        Field("gen", INT, "the failed generation"), Field("step", INT, "its step"),
        Field("next", INT, "the generation to join"), Field("reason", STR, "what failed"))),
    Message("startup", "coordinator", "answer to a hello: start-up ends within `wait` seconds", (
        Field("wait", NUM, "seconds the worker waits for generation 0"),
        Field("connected", INT, "replicas connected so far"), Field("of", INT, "replicas expected"),
        _opt("heartbeat_interval", NUM, "beat every this many seconds (core/contract/heartbeat.py)"))),
    Message("go", "coordinator", "every member is ready for step's all-reduce: start it", (
        Field("gen", INT, "the generation"), Field("step", INT, "the step"))),
    Message("done", "coordinator", "the last step is committed and recorded: exit 0", ()),
    Message("stop", "coordinator", "the run cannot go on: exit non-zero", (
        Field("reason", STR, "why"),
        _opt("committed", INT, "(a non-finite stop) every member holds the state after this many steps, "
                               "untouched: a checkpoint writer may save it"))),
    Message("fenced", "service", "(before closing) declared dead: rejoin or exit", (Field("reason", STR, "why"),)),
    Message("refused", "service", "(before closing) this hello is refused: exit", (Field("reason", STR, "why"),)),
    Message("rebuilt", "service", "(a restarted coordinator) answer to a hello: the report is taken", (
        _opt("heartbeat_interval", NUM, "beat every this many seconds"),)),
    Message("ended", "service", "(to the launcher, as it exits) the run is over", (
        Field("members", OBJ, "list of the replicas still members: the launcher stops any other worker"),)),
    # ---- worker -> coordinator ----
    Message("hello", "worker", "first message; generation 0's join; later a newcomer's request for admission", (
        Field("replica", INT, "the replica's slot"), Field("token", STR, "the run's join token"),
        _opt("pid", INT, "the worker's process id"), _opt("tokens_per_mb", INT, "tokens per microbatch"),
        _opt("weights_sha256", STR, "sha256 of the weights: generation 0 forms only if every replica's agree"),
        _opt("can_heal", BOOL, "it can be admitted into a running job (healed from a donor)"),
        _opt("rejoin", BOOL, "a woken replica"), _opt("started_at", NUM, "its process's start"),
        _opt("report", REPORT, "where it stands, for a restarted coordinator's rebuild"),
        _opt("standby", BOOL, "from the heartbeat thread after a lost connection: only a rebuilding coordinator "
                              "takes it; a live one closes it without a word"))),
    Message("join", "worker", "rejoin after an abort", (
        Field("gen", INT, "the generation joined"), Field("step", INT, "its step"),
        Field("ledger", IDS, "the ids of step it holds folded"),
        _opt("healed", BOOL, "false: a newcomer without the state"))),
    Message("healed", "worker", "a newcomer's state arrived", (
        Field("gen", INT, "the generation"), Field("step", INT, "the step"),
        _opt("donor", INT, "who sent it"), _opt("bytes", INT, "its size"), _opt("seconds", NUM, "how long it took"),
        _opt("weights_fingerprint", STR, "the fingerprint of the weights received"),
        _opt("shard_fingerprints", OBJ, "(a replica of many ranks) {local rank: its shard's fingerprint}, each "
                                        "checked against the donor's rank at its position"))),
    Message("ready", "worker", "my quota of step is folded: I can start the all-reduce", (
        Field("gen", INT, "the generation"), Field("step", INT, "the step"))),
    Message("vote", "worker", "my all-reduce of step is done (ok) or failed", (
        Field("gen", INT, "the generation"), Field("step", INT, "the step"), Field("ok", BOOL, "it succeeded"),
        Field("ledger", IDS, "the ids this member folded"),
        Field("loss_sum", NUM, "the reduced loss sum (null: not finite)", nullable=True),
        _opt("mb_seconds", NUM, "seconds per microbatch it measured"),
        _opt("progress_gap", NUM, "the longest seconds between two progress ticks of this step's work"),
        _opt("lr", NUM, "the learning rate the step will use"), _opt("reason", STR, "why not ok"),
        _opt("weights_fingerprint", STR, "every --digest-every steps: off the majority is fenced"),
        _opt("nonfinite", IDS, "ids of its ledger whose own loss was not finite (core/contract/nonfinite.py)"))),
    Message("fail", "worker", "my collective failed", (
        Field("gen", INT, "the generation"), Field("step", INT, "the step"), _opt("reason", STR, "what failed"))),
    Message("stop_run", "worker", "stop the run for a reason of this member's own (failing checkpoint saves)", (
        Field("reason", STR, "why: the run's end reason"),)),
    Message("hb", "worker", "heartbeat (handled by the service)", (
        _opt("p", INT, "the training thread's progress count: unchanged while its work is stuck"),)),
    # ---- launcher -> coordinator (the service's launcher connection) ----
    Message("launcher", "launcher", "the launcher says who it is", (Field("token", STR, "the run's join token"),)),
    Message("exited", "launcher", "that replica's process exited", (
        Field("replica", INT, "the replica"), Field("how", STR, "e.g. killed by SIGKILL"))),
    Message("rank_lost", "launcher", "a rank other than the leader of that replica failed: the launcher is "
                                     "killing the replica's other ranks, so the replica is lost now", (
        Field("replica", INT, "the replica"), Field("rank", INT, "the rank that failed first"),
        Field("pid", INT, "the replica's leader's pid (news of an earlier process set in that slot is dropped)"),
        Field("how", STR, "e.g. killed by SIGKILL"))),
)

BY_TYPE: dict[str, Message] = {m.type: m for m in MESSAGES}


def received_by_coordinator() -> tuple[Message, ...]:
    """The messages the coordinator's control port accepts (a worker's or the launcher's)."""
    return tuple(m for m in MESSAGES if m.sender in ("worker", "launcher"))


def table() -> str:
    """The reference table (docs/protocol.md holds exactly this; tests/test_messages.py checks it)."""
    out = ["| message | sender | fields | meaning |", "|---|---|---|---|"]
    for m in MESSAGES:
        fields = ", ".join(f.name + ("?" if not f.required else "") + ("|null" if f.nullable else "") for f in m.fields)
        out.append(f"| `{m.type}` | {m.sender} | {fields or '-'} | {m.doc} |")
        for f in m.fields:
            out.append(f"| | | `{f.name}` | {f.kind}: {f.doc} |")
    return "\n".join(out) + "\n"


def _kind_ok(kind: str, v: object) -> bool:
    """A shallow check of one value's kind (core/contract/wire.py checks received messages in depth)."""
    if kind == INT:
        return isinstance(v, int) and not isinstance(v, bool)
    if kind == NUM:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if kind == BOOL:
        return isinstance(v, bool)
    if kind == STR:
        return isinstance(v, str)
    if kind == IDS:
        return isinstance(v, list) and all(isinstance(p, list) and len(p) == 2 for p in v)
    return isinstance(v, dict)  # OBJ, REPORT


def schema_problem(msg: dict) -> str:
    """What is wrong with `msg` against its schema, strictly ('' if nothing): an unknown type, a
    required field missing, a field of the wrong kind, or a field the schema does not name (so the
    schema stays complete: tests check every message the state machine sends with it)."""
    m = BY_TYPE.get(msg.get("t"))  # type: ignore[arg-type]
    if m is None:
        return f"unknown message type {msg.get('t')!r}"
    names = {f.name for f in m.fields}
    extra = sorted(set(msg) - names - {"t"})
    if extra:
        return f"{m.type}: fields {extra} are not in core/contract/messages.py"
    for f in m.fields:
        if f.name not in msg:
            if f.required:
                return f"{m.type}: required field {f.name!r} missing"
        elif not ((f.nullable and msg[f.name] is None) or _kind_ok(f.kind, msg[f.name])):
            return f"{m.type}: field {f.name!r} is not a {f.kind}"
    return ""
