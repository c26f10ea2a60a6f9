"""The fault-kinds table (fault_injection/kinds.py) is the one place a kind is defined: every
kind in it is accepted by plan validation, has a worker-side action, is recorded with its
parameters and has a simulator counterpart; an unknown kind is refused in one line listing
the table; and a kind added to a copy of the table is validated, fired and recorded without
any other module knowing its name."""
from __future__ import annotations

import json

import pytest

from conftest import run_recover

from recover.experiments.sim.failures import CRASH, HANG, events_from_plan
from recover.fault_injection import kinds as kinds_module
from recover.fault_injection.injector import FaultInjector
from recover.fault_injection.kinds import KINDS, PARAMS, SIM_EFFECTS, FaultKind
from recover.fault_injection.plan import FaultPlan, PlanError, validate_plan
from recover.fault_injection.record import read_records


def _fault_of(kind: FaultKind, replica: int = 0) -> dict:
    """The smallest point-triggered fault of `kind`: its phase, its required parameters at a legal value."""
    d = {"kind": kind.name, "replica": replica, "step": 1, "phase": kind.at_phase or "forward"}
    for name in kind.requires:
        d[name] = PARAMS[name].minimum + 1
    return d


@pytest.mark.parametrize("name", list(KINDS))
def test_every_kind_in_the_table_is_accepted_and_has_a_worker_action_and_a_simulator_counterpart(name):
    kind = KINDS[name]
    plan = FaultPlan.from_dict({"faults": [_fault_of(kind)]})
    validate_plan(plan, replicas=2, steps=4, microbatches=4)  # does not raise
    assert plan.faults[0].spec is kind
    assert FaultPlan.from_dict(plan.to_dict()) == plan
    assert callable(kind.worker)
    assert kind.sim_effect in SIM_EFFECTS
    events = events_from_plan(plan.to_dict())
    if kind.sim_effect == "none":
        assert len(events) == 0 and len(events.skipped) == 1 and kind.sim_why in events.skipped[0]
    else:
        assert len(events.step_faults) == 1 and not events.skipped
        assert events.step_faults[0].kind == {"crash": CRASH, "hang": HANG}[kind.sim_effect]


@pytest.mark.parametrize("name", [n for n, k in KINDS.items() if k.launcher is not None])
def test_a_wall_clock_fault_of_a_kind_with_a_launcher_action_is_fired_by_the_launcher(name):
    d = {k: v for k, v in _fault_of(KINDS[name]).items() if k not in ("step", "phase")}
    fault = FaultPlan.from_dict({"faults": [{**d, "at_seconds": 1.0}]}).faults[0]
    assert fault.fired_by_launcher
    assert not FaultPlan.from_dict({"faults": [_fault_of(KINDS[name])]}).faults[0].fired_by_launcher


@pytest.mark.procs
def test_an_unknown_kind_is_refused_in_one_line_naming_the_field_and_listing_the_table(tmp_path):
    with pytest.raises(PlanError) as e:
        FaultPlan.from_dict({"faults": [{"kind": "melt", "replica": 0, "step": 1, "phase": "forward"}]})
    assert e.value.field == "kind"
    assert str(e.value) == 'fault 0: kind: unknown kind "melt"; one of ' + ", ".join(KINDS)
    # As a user sees it: one line, exit 2.
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"faults": [{"kind": "melt", "replica": 0, "step": 1, "phase": "forward"}]}))
    proc = run_recover("faults", "check", str(plan), "--replicas", "2", "--steps", "4", timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "kind: unknown kind \"melt\"" in lines[0], proc.stderr
    assert all(name in lines[0] for name in KINDS)


def test_a_table_entry_that_cannot_work_is_refused_when_it_is_written():
    with pytest.raises(ValueError, match="sim_effect"):
        FaultKind("toy", "a toy", KINDS["crash"].worker, sim_effect="explode")
    with pytest.raises(ValueError, match="accepts 'volts'"):
        FaultKind("toy", "a toy", KINDS["crash"].worker, accepts=("volts",))
    with pytest.raises(ValueError, match="requires 'factor' without accepting it"):
        FaultKind("toy", "a toy", KINDS["crash"].worker, requires=("factor",))


# ---- a kind added in a copy of the table --------------------------------------------------------
FIRED: list[tuple[int, int, int]] = []


def _toy_worker(state, index, fault, step) -> None:
    """Stands for a new kind's real action (an in-process test: no signal, just proof it ran)."""
    FIRED.append((state.replica, index, step))


TOY = FaultKind(
    "toy_freeze", "a toy kind: only at commit, lasts seconds", _toy_worker,
    accepts=("seconds",), at_phase="commit", at_phase_why="strikes as the step is committed",
    freezes=True, sim_effect="hang",
)


def test_a_toy_kind_in_a_copy_of_the_table_flows_through_validation():
    table = {**KINDS, TOY.name: TOY}
    good = {"kind": "toy_freeze", "replica": 1, "step": 2, "phase": "commit", "seconds": 3}
    plan = FaultPlan.from_dict({"faults": [good]}, kinds=table)
    validate_plan(plan, replicas=2, steps=4)
    assert plan.faults[0].seconds == 3
    # Its own rules, from its entry alone.
    with pytest.raises(PlanError, match='phase: a toy_freeze strikes as the step is committed: use "commit"'):
        FaultPlan.from_dict({"faults": [{**good, "phase": "forward"}]}, kinds=table)
    with pytest.raises(PlanError, match="factor: only a slow or grad_spike fault has a factor, not a toy_freeze"):
        FaultPlan.from_dict({"faults": [{**good, "factor": 2}]}, kinds=table)
    # Other kinds' errors now name it among the owners of the parameter it shares.
    owners = [n for n, k in KINDS.items() if "seconds" in k.accepts]  # hang, pace, ... from the real table
    with pytest.raises(PlanError, match=f"seconds: only a {', '.join(owners)} or toy_freeze lasts seconds, not a crash"):
        FaultPlan.from_dict({"faults": [{"kind": "crash", "replica": 0, "step": 1, "phase": "forward",
                                         "seconds": 1}]}, kinds=table)
    # The real table knows nothing of it.
    with pytest.raises(PlanError, match='kind: unknown kind "toy_freeze"'):
        FaultPlan.from_dict({"faults": [good]})


def test_a_toy_kind_registered_in_the_table_is_fired_recorded_and_simulated(tmp_path, monkeypatch):
    monkeypatch.setitem(kinds_module.KINDS, TOY.name, TOY)
    FIRED.clear()
    plan = FaultPlan.from_dict({"faults": [
        {"kind": "toy_freeze", "replica": 0, "step": 2, "phase": "commit", "seconds": 3},
        {"kind": "toy_freeze", "replica": 1, "at_seconds": 0.0},
    ]})
    inj = FaultInjector(plan, replica=0, rank=0, out_dir=tmp_path, t0=0.0)
    inj.at(2, "forward", 0)
    assert FIRED == []
    inj.at(2, "commit")
    assert FIRED == [(0, 0, 2)]
    # A wall-clock one waits for its phase (it has no launcher action, so the worker fires it).
    assert not plan.faults[1].fired_by_launcher
    other = FaultInjector(plan, replica=1, rank=0, out_dir=tmp_path, t0=0.0)
    other.at(0, "allreduce")
    other.at(0, "commit")
    assert FIRED == [(0, 0, 2), (1, 1, 0)]
    records = read_records(tmp_path)
    assert [(r["kind"], r["seconds"]) for r in records] == [("toy_freeze", 3), ("toy_freeze", None)]
    events = events_from_plan(plan.to_dict())
    assert not events.skipped and [s.kind for s in events.step_faults] == [HANG] and list(events.kinds) == [HANG]


# ---- broken_link: a persistent fault -------------------------------------------
def test_a_broken_link_fails_every_later_allreduce_of_its_replica_for_its_seconds(tmp_path):
    from recover.fault_injection.kinds import InjectedLinkError

    plan = FaultPlan.from_dict({"faults": [
        {"kind": "broken_link", "replica": 0, "step": 1, "phase": "allreduce"},  # for good
        {"kind": "broken_link", "replica": 1, "step": 1, "phase": "allreduce", "seconds": 0.3},
    ]})
    for_good = FaultInjector(plan, replica=0, rank=0, out_dir=tmp_path, t0=0.0)
    timed = FaultInjector(plan, replica=1, rank=0, out_dir=tmp_path, t0=0.0)
    for inj in (for_good, timed):
        inj.at(0, "allreduce")  # before it fires: the link works
        inj.at(1, "forward", 0)
        with pytest.raises(InjectedLinkError, match="broken_link \\(fault"):
            inj.at(1, "allreduce")
        for step in (1, 1, 2):  # the same step redone, and the next: still broken
            with pytest.raises(InjectedLinkError, match="still broken"):
                inj.at(step, "allreduce")
        inj.at(2, "forward", 0)  # only the collectives fail
    records = read_records(tmp_path)
    assert [(r["index"], r["kind"], r["seconds"]) for r in records] == [(0, "broken_link", None),
                                                                         (1, "broken_link", 0.3)]  # once each
    import time

    time.sleep(0.35)
    timed.at(3, "allreduce")  # its seconds are over: the link works again
    with pytest.raises(InjectedLinkError):
        for_good.at(3, "allreduce")
    with pytest.raises(PlanError, match="phase"):
        FaultPlan.from_dict({"faults": [{"kind": "broken_link", "replica": 0, "step": 1, "phase": "forward"}]})
