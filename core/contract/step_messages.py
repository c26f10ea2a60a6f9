"""The messages of every failure-free step as typed classes: what a worker builds and the coordinator reads.

Contract:
- One class per message of the step's round (docs/protocol.md): the worker's `Ready` and
  `Vote`, the coordinator's `Go` and `Commit`. Each one's fields are its schema's in
  core/contract/messages.py (`MESSAGES`, the one source of truth), in the schema's order: the
  required ones first, then the optional ones (default None). tests/test_step_messages.py
  fails if a class and its schema disagree on a field's name or on whether it is required.
- `to_line()` is the message as the line the control connection carries (JSON bytes, without
  the newline), encoded straight from the object; `to_wire()` is the same message as a dict,
  for code that edits a message before it goes (a fault plan's `bad_vote`) or adds to it (the
  coordinator's per-member fields). `loads(m.to_line()) == m.to_wire()`, key order included
  (tests/test_step_messages.py). `to_wire()`: the same keys and values
  the code built as a dict literal before these classes ("t" first, then the fields in the
  schema's order; JSON objects are unordered, and no reader depends on the order), so a
  worker and a coordinator of either kind read each other. A required field is always there (a nullable one as
  null: a vote's `loss_sum`, a commit's `loss`); an optional one only when it is not None.
- `from_wire(d)` reads a dict the coordinator's wire check (core/contract/wire.py
  `parse_line`) accepted, or a worker's control thread received; it checks nothing itself
  (the wire did, and a second check would be paid R times a step). The coordinator gets its
  votes and readies already read (wire.py `read_line`: the common vote is read in the pass
  that checks it). `TYPE` is the message's "t". An optional field that
  is null on the wire reads as absent (None): wire.py treats it so already, and no optional
  field of these messages gives null a meaning of its own.
- Why msgspec Structs: typed, immutable and named, and built and encoded in C. A vote is
  built and turned into its line in less time than the dict literal and orjson this code
  used before the classes (`make bench`, benchmarks/micro: about 370 ns against 410-430 ns
  on this machine, measured with timeit; a NamedTuple's build alone cost what the whole
  old build did, and its dict then had to be encoded). The coordinator builds R votes a
  step on its one thread, and a worker sends one a step.
- Messages off the step's round (hello, join, healed, abort, gen, ...) stay dicts: they
  come once per recovery, not once per step.
"""
from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from recover.core.contract.idranges import Ranges

# A Struct's encoding: "t" (its tag) first, then its fields in order, each optional one only
# when it is not None (omit_defaults: every optional field's default is None).
_OPTIONS = dict(frozen=True, tag_field="t", omit_defaults=True, gc=False)
_encode = msgspec.json.Encoder().encode


def _to_wire(msg: msgspec.Struct, required: int) -> dict[str, Any]:
    """The wire dict of a message: "t", its `required` first fields always, the others when not None."""
    d: dict[str, Any] = {"t": msg.TYPE}
    fields = msg.__struct_fields__
    for name in fields[:required]:
        d[name] = getattr(msg, name)
    for name in fields[required:]:
        v = getattr(msg, name)
        if v is not None:
            d[name] = v
    return d


class _StepMessage(msgspec.Struct, **_OPTIONS):
    """What the four classes share: `to_line()` (see the module docstring)."""

    TYPE: ClassVar[str]

    def to_line(self) -> bytes:
        """The message as the control connection's line carries it (without the newline)."""
        return _encode(self)


class Ready(_StepMessage, tag="ready", **_OPTIONS):
    """worker -> coordinator: my quota of `step` is folded; I can start the all-reduce."""

    TYPE: ClassVar[str] = "ready"  # (a class attribute, not a field)

    gen: int  # the generation
    step: int  # the step

    def to_wire(self) -> dict[str, Any]:
        """The message as the control connection carries it."""
        return {"t": "ready", "gen": self.gen, "step": self.step}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Ready:
        """A ready message the wire accepted."""
        return cls(d["gen"], d["step"])


class Go(_StepMessage, tag="go", **_OPTIONS):
    """coordinator -> worker: every member is ready for step's all-reduce: start it."""

    TYPE: ClassVar[str] = "go"

    gen: int  # the generation
    step: int  # the step

    def to_wire(self) -> dict[str, Any]:
        """The message as the control connection carries it."""
        return {"t": "go", "gen": self.gen, "step": self.step}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Go:
        """A go message as the worker received it."""
        return cls(d["gen"], d["step"])


class Vote(_StepMessage, tag="vote", **_OPTIONS):
    """worker -> coordinator: my all-reduce of `step` is done (ok) or failed."""

    TYPE: ClassVar[str] = "vote"

    gen: int  # the generation
    step: int  # the step
    ok: bool  # the all-reduce succeeded
    ledger: Ranges  # the ids this member folded (id ranges)
    loss_sum: float | None  # the reduced loss sum; None: not finite (core/contract/nonfinite.py)
    mb_seconds: float | None = None  # seconds per microbatch it measured
    progress_gap: float | None = None  # the longest seconds between two progress ticks of this step's work
    lr: float | None = None  # the learning rate the step will use
    reason: str | None = None  # why not ok
    weights_fingerprint: str | None = None  # every --digest-every steps: off the majority is fenced
    nonfinite: Ranges | None = None  # ids of its ledger whose own loss was not finite

    def to_wire(self) -> dict[str, Any]:
        """The message as the control connection carries it."""
        # written out, not a loop over the fields: a worker sends one a step, and this is half its build
        gen, step, ok, ledger, loss_sum = self.gen, self.step, self.ok, self.ledger, self.loss_sum
        mb_seconds, progress_gap, lr, reason = self.mb_seconds, self.progress_gap, self.lr, self.reason
        fingerprint, nonfinite = self.weights_fingerprint, self.nonfinite
        d: dict[str, Any] = {"t": "vote", "gen": gen, "step": step, "ok": ok, "ledger": ledger, "loss_sum": loss_sum}
        if mb_seconds is not None:
            d["mb_seconds"] = mb_seconds
        if progress_gap is not None:
            d["progress_gap"] = progress_gap
        if lr is not None:
            d["lr"] = lr
        if reason is not None:
            d["reason"] = reason
        if fingerprint is not None:
            d["weights_fingerprint"] = fingerprint
        if nonfinite is not None:
            d["nonfinite"] = nonfinite
        return d

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Vote:
        """A vote the wire accepted (`loss_sum` is there: the wire requires it)."""
        get = d.get
        return cls(d["gen"], d["step"], d["ok"], d["ledger"], d["loss_sum"], get("mb_seconds"),
                   get("progress_gap"), get("lr"), get("reason"), get("weights_fingerprint"), get("nonfinite"))


class Commit(_StepMessage, tag="commit", **_OPTIONS):
    """coordinator -> worker: the step is committed; the quota is for step+1."""

    TYPE: ClassVar[str] = "commit"

    gen: int  # the generation that committed
    step: int  # the committed step
    loss: float | None  # the step's mean loss; None: not finite (with skipped)
    split: Ranges | None = None  # step+1's ids all members share at equal speeds (policy.equal_share)
    quota: Ranges | None = None  # step+1's own ids of this member, while speeds differ
    next: int | None = None  # step+1 is generation `next`'s: its gen message follows
    skipped: bool | None = None  # the loss was not finite and --on-nonfinite is skip: no optimizer step

    def to_wire(self) -> dict[str, Any]:
        """The message as the control connection carries it."""
        return _to_wire(self, 3)

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Commit:
        """A commit message as the worker received it."""
        get = d.get
        return cls(d["gen"], d["step"], d["loss"], get("split"), get("quota"), get("next"), get("skipped"))


# message type -> its class (tests/test_step_messages.py holds each to its schema)
STEP_MESSAGES: dict[str, type] = {"ready": Ready, "go": Go, "vote": Vote, "commit": Commit}
