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
  used before the classes (`make bench` times both, benchmarks/micro); a NamedTuple's build
  alone cost what the whole old build did, and its dict then had to be encoded. The
  coordinator builds R votes a step on its one thread, and a worker sends one a step.
- Messages off the step's round (hello, join, healed, abort, gen, ...) stay dicts: they
  come once per recovery, not once per step.
"""
from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from recover.core.contract.idranges import Ranges

_encode = msgspec.json.Encoder().encode


class _StepMessage(msgspec.Struct, frozen=True, tag_field="t", omit_defaults=True, gc=False):
    """What the four classes share: `to_line()` and `to_wire()` (see the module docstring), and how they encode,
    which each inherits: "t" (its tag) first, then its fields in order, each optional one only
    when it is not None (omit_defaults: every optional field's default is None)."""

    TYPE: ClassVar[str]

    def to_line(self) -> bytes:
        """The message as the control connection's line carries it (without the newline)."""
        return _encode(self)

    def to_wire(self) -> dict[str, Any]:
        """The message as a dict: "t", its required fields always, its optional ones when not None."""
        d: dict[str, Any] = {"t": self.TYPE}
        fields = self.__struct_fields__
        required = len(fields) - len(self.__struct_defaults__)  # the optional ones come last, with defaults
        for name in fields[:required]:
            d[name] = getattr(self, name)
        for name in fields[required:]:
            v = getattr(self, name)
            if v is not None:
                d[name] = v
        return d


class Ready(_StepMessage, tag="ready"):
    """worker -> coordinator: my quota of `step` is folded; I can start the all-reduce."""

    TYPE: ClassVar[str] = "ready"  # (a class attribute, not a field)

    gen: int  # the generation
    step: int  # the step

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Ready:
        """A ready message the wire accepted."""
        return cls(d["gen"], d["step"])


class Go(_StepMessage, tag="go"):
    """coordinator -> worker: every member is ready for step's all-reduce: start it."""

    TYPE: ClassVar[str] = "go"

    gen: int  # the generation
    step: int  # the step

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Go:
        """A go message as the worker received it."""
        return cls(d["gen"], d["step"])


class Vote(_StepMessage, tag="vote"):
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

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Vote:
        """A vote the wire accepted (`loss_sum` is there: the wire requires it)."""
        get = d.get
        return cls(d["gen"], d["step"], d["ok"], d["ledger"], d["loss_sum"], get("mb_seconds"),
                   get("progress_gap"), get("lr"), get("reason"), get("weights_fingerprint"), get("nonfinite"))


class Commit(_StepMessage, tag="commit"):
    """coordinator -> worker: the step is committed; the quota is for step+1."""

    TYPE: ClassVar[str] = "commit"

    gen: int  # the generation that committed
    step: int  # the committed step
    loss: float | None  # the step's mean loss; None: not finite (with skipped)
    split: Ranges | None = None  # step+1's ids all members share at equal speeds (policy.equal_share)
    quota: Ranges | None = None  # step+1's own ids of this member, while speeds differ
    next: int | None = None  # step+1 is generation `next`'s: its gen message follows
    skipped: bool | None = None  # the loss was not finite and --on-nonfinite is skip: no optimizer step

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Commit:
        """A commit message as the worker received it."""
        get = d.get
        return cls(d["gen"], d["step"], d["loss"], get("split"), get("quota"), get("next"), get("skipped"))


# message type -> its class (tests/test_step_messages.py holds each to its schema)
STEP_MESSAGES: dict[str, type] = {"ready": Ready, "go": Go, "vote": Vote, "commit": Commit}
