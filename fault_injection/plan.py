"""Fault plans: which faults a run gets, where, and how they are checked before it starts.

Contract:
- A plan is JSON `{"faults": [FAULT, ...]}` (optionally with "generator", the
  parameters a generated plan was drawn with, and "description"), and the same
  thing as Python objects: `FaultPlan` holding `Fault`s. `FaultPlan.from_dict`
  accepts exactly the JSON form, and `to_dict` writes it back, leaving out fields
  at their defaults, so `from_dict(to_dict(p)) == p` and a minimal plan such as
    {"faults": [{"kind": "crash", "replica": 1, "step": 3, "phase": "backward"}]}
  is written back exactly as it was read.
- Each fault has a kind (a name in fault_injection.kinds.KINDS), a target (`replica`, and `rank` within the
  replica, 0 by default), and one trigger: a point, `step` + `phase` (one of
  core.launch.hooks.PHASES, or for a kind aimed at the coordinator also one of
  core.launch.hooks.COORDINATOR_PHASES: "commit_sent", where the coordinator itself
  fires it right after sending the step's commit to `replica`) and optionally `microbatch` k, or a wall-clock time,
  `at_seconds` since the run started. Steps count from 0, as metrics.jsonl does;
  k counts this replica's microbatches within the step from 0, in the order it
  folds them (`between_microbatches` k is the gap before microbatch k, so k >= 1).
  A named microbatch always exists in a failure-free stretch: quotas stay equal
  (sizes within 1) until one replica has been measured the slowest beyond
  tolerance for several consecutive steps (core.coordinator.balancing.SPEED_WINDOW), so load
  noise does not move them. Should a replica still fold fewer microbatches in
  that step than the trigger names (a sustained straggler, or no microbatch
  at all), the fault fires at that step's "commit" point, once this replica's
  share of the step is complete; faults.jsonl records where it really fired.
- Two levels of checks, both raising `PlanError(index, field, message)` whose
  text is one line naming the fault's index (from 0) and the field:
  `from_dict` checks the form (types, known kinds, phases and fields, and the
  kind's own rules from the kinds table: the parameters it accepts and requires,
  the phase it must strike at); `validate_plan` checks the plan against the run (the
  replica exists, the step is inside the run, the microbatch can exist).
- Wall-clock faults of a kind with a launcher-side action (crash, hang,
  replica_loss) are fired by the launcher by PID; those of any other kind (slow,
  collective_error, broken_link) are armed in the worker and take effect at its first hook
  point after that time (or, for a kind with `at_phase`, at that phase).
- `from_dict` takes the kinds table as an argument (the real one by default), so
  a kind added to a copy of it is validated like the others.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from recover.core.launch.hooks import COORDINATOR_PHASES, PHASES

from .kinds import KIND_NAMES as KINDS, KINDS as KIND_TABLE, PARAMS, FaultKind

__all__ = ["KINDS", "MICROBATCH_PHASES", "Fault", "FaultPlan", "PlanError", "load_plan", "validate_plan"]

MICROBATCH_PHASES = ("forward", "backward", "between_microbatches")
PLAN_KEYS = ("faults", "generator", "description")


class PlanError(ValueError):
    """A bad fault plan: `index` is the fault's position (None: the plan as a whole)."""

    def __init__(self, index: int | None, field: str | None, message: str):
        where = "".join([f"fault {index}: " if index is not None else "", f"{field}: " if field else ""])
        super().__init__(where + message)
        self.index = index
        self.field = field
        self.message = message


@dataclass(frozen=True)
class Fault:
    """One fault: what happens, to whom, and when."""

    kind: str  # a name in fault_injection.kinds.KINDS
    replica: int  # target replica id (0..R-1)
    rank: int = 0  # rank within the replica (today every replica has one rank, 0)
    step: int | None = None  # point trigger: the iteration, from 0
    phase: str | None = None  # point trigger: one of core.launch.hooks.PHASES
    microbatch: int | None = None  # point trigger: this replica's k-th microbatch of the step (None = first time)
    at_seconds: float | None = None  # wall-clock trigger: seconds since the run started
    seconds: float | None = None  # hang only: how long it stays frozen (None = for good)
    factor: float | None = None  # slow: each microbatch takes this many times as long; grad_spike: gradient x factor

    @property
    def wall_clock(self) -> bool:
        """True for a wall-clock trigger, False for a (step, phase) point."""
        return self.at_seconds is not None

    @property
    def spec(self) -> FaultKind:
        """This fault's entry in the kinds table."""
        return KIND_TABLE[self.kind]

    @property
    def fired_by_launcher(self) -> bool:
        """Wall-clock faults of a kind with a launcher-side action are fired from outside, by PID."""
        return self.wall_clock and self.spec.launcher is not None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if v != f.default:
                out[f.name] = v
        return out

    @classmethod
    def from_dict(cls, d: Any, index: int = 0, kinds: dict[str, FaultKind] = KIND_TABLE) -> "Fault":
        """Parse one fault, checking its form against `kinds`; `index` only labels errors."""
        if not isinstance(d, dict):
            raise PlanError(index, None, f"must be a JSON object, got {_show(d)}")
        known = [f.name for f in fields(cls)]
        for key in d:
            if key not in known:
                raise PlanError(index, key, f"unknown field; known fields: {', '.join(known)}")
        if "kind" not in d:
            raise PlanError(index, "kind", f"missing; one of {', '.join(kinds)}")
        kind = d["kind"]
        if not isinstance(kind, str) or kind not in kinds:
            raise PlanError(index, "kind", f"unknown kind {_show(kind)}; one of {', '.join(kinds)}")
        spec = kinds[kind]
        if "replica" not in d:
            raise PlanError(index, "replica", "missing; the target replica id")
        ints = {k: _int(d, k, index, minimum=0) for k in ("replica", "rank", "step", "microbatch")}
        at_seconds = _number(d, "at_seconds", index, minimum=0.0, strict=False)
        params = {p.name: _number(d, p.name, index, p.minimum, p.strict) for p in PARAMS.values()}
        phase = d.get("phase")
        if phase is not None and phase not in PHASES + COORDINATOR_PHASES:
            raise PlanError(index, "phase", f"unknown phase {_show(phase)}; one of {', '.join(PHASES + COORDINATOR_PHASES)}")

        # Exactly one trigger.
        point = ints["step"] is not None or phase is not None or ints["microbatch"] is not None
        if point and at_seconds is not None:
            raise PlanError(index, "at_seconds", "give either step+phase or at_seconds, not both")
        if not point and at_seconds is None:
            raise PlanError(index, "step", "missing; give step and phase, or at_seconds")
        if point:
            if ints["step"] is None:
                raise PlanError(index, "step", "missing; a point trigger needs step and phase")
            if phase is None:
                raise PlanError(index, "phase", f"missing; one of {', '.join(PHASES)}")
        mb = ints["microbatch"]
        if mb is not None and phase not in MICROBATCH_PHASES:
            raise PlanError(index, "microbatch", f"only for phases {', '.join(MICROBATCH_PHASES)}, not {phase!r}")
        if mb == 0 and phase == "between_microbatches":
            raise PlanError(index, "microbatch", "between_microbatches k is the gap before microbatch k, so k >= 1")

        # The kind's own rules (fault_injection.kinds): its parameters, its phase.
        for p in PARAMS.values():
            if p.name in spec.requires and params[p.name] is None:
                raise PlanError(index, p.name, f"missing; a {kind} fault needs {p.needed_as}")
            if params[p.name] is not None and p.name not in spec.accepts:
                names = [n for n, k in kinds.items() if p.name in k.accepts]
                owners = " or ".join(filter(None, (", ".join(names[:-1]), names[-1])))
                raise PlanError(index, p.name, f"{p.only.format(owners=owners)}, not a {kind}")
        if phase in COORDINATOR_PHASES and not spec.targets_coordinator:
            raise PlanError(index, "phase", f"{phase!r} is the coordinator's point; a {kind} fault strikes a worker "
                                            f"(one of {', '.join(PHASES)})")
        if spec.at_phase is not None and point and phase != spec.at_phase:
            raise PlanError(
                index, "phase", f"a {kind} {spec.at_phase_why}: use \"{spec.at_phase}\", not {phase!r}"
            )
        return cls(
            kind=kind, replica=ints["replica"], rank=ints["rank"] or 0, step=ints["step"], phase=phase,
            microbatch=mb, at_seconds=at_seconds, **params,
        )


@dataclass(frozen=True)
class FaultPlan:
    """A run's faults, in plan order (a fault's index is its position)."""

    faults: tuple[Fault, ...] = ()  # the faults; index i is faults[i]
    generator: dict[str, Any] | None = None  # how a generated plan was drawn (generated plans)
    description: str | None = None  # free text for the reader

    def __post_init__(self) -> None:
        object.__setattr__(self, "faults", tuple(self.faults))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"faults": [f.to_dict() for f in self.faults]}
        if self.generator is not None:
            out["generator"] = self.generator
        if self.description is not None:
            out["description"] = self.description
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, d: Any, kinds: dict[str, FaultKind] = KIND_TABLE) -> "FaultPlan":
        """Parse a plan, checking each fault's form against the kinds table `kinds`."""
        if not isinstance(d, dict):
            raise PlanError(None, None, f'a plan is a JSON object {{"faults": [...]}}, got {_show(d)}')
        for key in d:
            if key not in PLAN_KEYS:
                raise PlanError(None, key, f"unknown top-level field; known: {', '.join(PLAN_KEYS)}")
        if "faults" not in d:
            raise PlanError(None, "faults", "missing; a plan is {\"faults\": [...]}")
        if not isinstance(d["faults"], list):
            raise PlanError(None, "faults", f"must be a list, got {_show(d['faults'])}")
        generator = d.get("generator")
        if generator is not None and not isinstance(generator, dict):
            raise PlanError(None, "generator", f"must be an object, got {_show(generator)}")
        description = d.get("description")
        if description is not None and not isinstance(description, str):
            raise PlanError(None, "description", f"must be a string, got {_show(description)}")
        return cls(tuple(Fault.from_dict(f, i, kinds) for i, f in enumerate(d["faults"])), generator, description)

    @classmethod
    def from_json(cls, text: str) -> "FaultPlan":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(None, None, f"not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
        return cls.from_dict(d)

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(self.to_json() + "\n")


def load_plan(path: str | os.PathLike) -> FaultPlan:
    """Read and form-check a plan file (raises PlanError; a missing file too)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise PlanError(None, None, f"cannot read {path}: {e.strerror or e}") from None
    return FaultPlan.from_json(text)


def validate_plan(
    plan: FaultPlan, replicas: int, steps: int, microbatches: int | None = None, ranks_per_replica: int = 1
) -> None:
    """Check `plan` against a run of `replicas` replicas and `steps` steps; raise the first PlanError.

    `microbatches` (M), when given, bounds `microbatch`: a replica can fold at
    most M microbatches in one step (all of them, once every other replica is gone).
    """
    for i, f in enumerate(plan.faults):
        if not 0 <= f.replica < replicas:
            raise PlanError(i, "replica", f"{f.replica} is not a replica of this run (0..{replicas - 1})")
        if not 0 <= f.rank < ranks_per_replica:
            raise PlanError(
                i, "rank", f"{f.rank} is not a rank of replica {f.replica} (ranks 0..{ranks_per_replica - 1})"
            )
        why = KIND_TABLE[f.kind].leader_only if f.kind in KIND_TABLE else ""
        if why and f.rank != 0:
            raise PlanError(i, "rank", f"a {f.kind} fault strikes a replica's leader (rank 0) only: {why}")
        why = KIND_TABLE[f.kind].one_rank_only if f.kind in KIND_TABLE else ""
        if why and ranks_per_replica > 1:
            raise PlanError(i, "kind", f"a {f.kind} fault needs replicas of one rank (this run's have "
                                       f"{ranks_per_replica}): {why}")
        if f.step is not None and not 0 <= f.step < steps:
            raise PlanError(i, "step", f"{f.step} is beyond this run (steps 0..{steps - 1})")
        if f.microbatch is not None and microbatches is not None and f.microbatch >= microbatches:
            raise PlanError(
                i, "microbatch",
                f"{f.microbatch} cannot happen: a replica folds at most M={microbatches} microbatches a step",
            )


# ---- field parsing ---------------------------------------------------------------------
def _show(v: Any) -> str:
    s = json.dumps(v) if isinstance(v, (str, int, float, bool, type(None), list, dict)) else repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


def _int(d: dict, key: str, index: int, minimum: int) -> int | None:
    if key not in d:
        return None
    v = d[key]
    # bool is an int in Python but never a sensible step or replica.
    if isinstance(v, bool) or not isinstance(v, int):
        raise PlanError(index, key, f"must be an integer, got {_show(v)}")
    if v < minimum:
        raise PlanError(index, key, f"must be >= {minimum}, got {v}")
    return v


def _number(d: dict, key: str, index: int, minimum: float, strict: bool) -> float | None:
    if key not in d or (key == "seconds" and d[key] is None):  # a hang's "seconds": null = frozen for good
        return None
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise PlanError(index, key, f"must be a finite number, got {_show(v)}")
    if v < minimum or (strict and v == minimum):
        raise PlanError(index, key, f"must be {'>' if strict else '>='} {minimum:g}, got {v}")
    return float(v) if isinstance(v, float) else v
