"""Fault plans: the minimal JSON form is accepted exactly, bad plans are rejected before
anything starts with one line naming the fault and field, and plans round-trip."""
from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import run_recover

from recover.core.launch.hooks import PHASES
from recover.fault_injection.injector import FaultInjector, InjectedLinkError
from recover.fault_injection.kinds import KINDS as KIND_TABLE
from recover.fault_injection.plan import KINDS, MICROBATCH_PHASES, Fault, FaultPlan, PlanError, validate_plan
from recover.fault_injection.record import append_record, fault_record, fired_indices

MINIMAL = (
    '{"faults": [{"kind": "crash", "replica": 1, "step": 3, "phase": "backward"}, '
    '{"kind": "hang", "replica": 2, "step": 5, "phase": "allreduce", "seconds": 30}]}'
)


def test_minimal_form_is_accepted_exactly_and_written_back_as_read():
    plan = FaultPlan.from_json(MINIMAL)
    assert plan.faults == (
        Fault(kind="crash", replica=1, step=3, phase="backward"),
        Fault(kind="hang", replica=2, step=5, phase="allreduce", seconds=30),
    )
    assert plan.to_dict() == json.loads(MINIMAL)
    validate_plan(plan, replicas=4, steps=8)  # does not raise


@pytest.mark.parametrize(
    "fault, expected",
    [
        ({"kind": "boom", "replica": 0, "step": 0, "phase": "forward"}, "fault 1: kind: unknown kind \"boom\""),
        ({"replica": 0, "step": 0, "phase": "forward"}, "fault 1: kind: missing"),
        ({"kind": "crash", "step": 0, "phase": "forward"}, "fault 1: replica: missing"),
        ({"kind": "crash", "replica": "1", "step": 0, "phase": "forward"}, "fault 1: replica: must be an integer"),
        ({"kind": "crash", "replica": True, "step": 0, "phase": "forward"}, "fault 1: replica: must be an integer"),
        ({"kind": "crash", "replica": 0, "step": -1, "phase": "forward"}, "fault 1: step: must be >= 0"),
        ({"kind": "crash", "replica": 0, "step": 1, "phase": "fwd"}, "fault 1: phase: unknown phase \"fwd\""),
        ({"kind": "crash", "replica": 0, "step": 1}, "fault 1: phase: missing"),
        ({"kind": "crash", "replica": 0}, "fault 1: step: missing"),
        ({"kind": "crash", "replica": 0, "stpe": 1, "phase": "forward"}, "fault 1: stpe: unknown field"),
        ({"kind": "crash", "replica": 0, "step": 1, "phase": "forward", "at_seconds": 2},
         "fault 1: at_seconds: give either step+phase or at_seconds"),
        ({"kind": "crash", "replica": 0, "step": 1, "phase": "allreduce", "microbatch": 0},
         "fault 1: microbatch: only for phases"),
        ({"kind": "crash", "replica": 0, "step": 1, "phase": "between_microbatches", "microbatch": 0},
         "fault 1: microbatch: between_microbatches k is the gap before microbatch k"),
        ({"kind": "crash", "replica": 0, "step": 1, "phase": "forward", "seconds": 3},
         "fault 1: seconds: only a hang, stall, pace or broken_link lasts seconds"),
        ({"kind": "hang", "replica": 0, "step": 1, "phase": "forward", "seconds": 0},
         "fault 1: seconds: must be > 0"),
        ({"kind": "hang", "replica": 0, "step": 1, "phase": "forward", "seconds": "long"},
         "fault 1: seconds: must be a finite number"),
        ({"kind": "slow", "replica": 0, "step": 1, "phase": "forward"}, "fault 1: factor: missing"),
        ({"kind": "slow", "replica": 0, "step": 1, "phase": "forward", "factor": 0.5}, "fault 1: factor: must be >= 1"),
        ({"kind": "crash", "replica": 0, "step": 1, "phase": "forward", "factor": 2},
         "fault 1: factor: only a slow or grad_spike fault"),
        ({"kind": "collective_error", "replica": 0, "step": 1, "phase": "backward"},
         "fault 1: phase: a collective_error breaks the collective in flight"),
        ({"kind": "crash", "replica": 0, "at_seconds": -1}, "fault 1: at_seconds: must be >= 0"),
        ("crash", "fault 1: must be a JSON object"),
    ],
)
def test_malformed_fault_is_rejected_naming_its_index_and_field(fault, expected):
    good = {"kind": "crash", "replica": 0, "step": 0, "phase": "forward"}
    with pytest.raises(PlanError) as e:
        FaultPlan.from_dict({"faults": [good, fault]})
    assert str(e.value).startswith(expected), str(e.value)
    assert e.value.index == 1 and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "plan, message",
    [
        ([], 'a plan is a JSON object {"faults": [...]}, got []'),
        ({}, "faults: missing"),
        ({"faults": {}}, "faults: must be a list"),
        ({"faults": [], "seed": 1}, "seed: unknown top-level field"),
    ],
)
def test_malformed_plan_is_rejected(plan, message):
    with pytest.raises(PlanError) as e:
        FaultPlan.from_dict(plan)
    assert str(e.value).startswith(message) and e.value.index is None


@pytest.mark.parametrize(
    "fault, message",
    [
        ({"kind": "crash", "replica": 7, "step": 0, "phase": "forward"},
         "fault 1: replica: 7 is not a replica of this run (0..3)"),
        ({"kind": "crash", "replica": 0, "step": 8, "phase": "forward"},
         "fault 1: step: 8 is beyond this run (steps 0..7)"),
        ({"kind": "crash", "replica": 0, "rank": 1, "step": 0, "phase": "forward"},
         "fault 1: rank: 1 is not a rank of replica 0 (ranks 0..0)"),
        ({"kind": "crash", "replica": 0, "step": 0, "phase": "forward", "microbatch": 8},
         "fault 1: microbatch: 8 cannot happen"),
    ],
)
def test_plan_that_does_not_fit_the_run_is_rejected(fault, message):
    plan = FaultPlan.from_dict({"faults": [{"kind": "crash", "replica": 0, "step": 0, "phase": "forward"}, fault]})
    with pytest.raises(PlanError) as e:
        validate_plan(plan, replicas=4, steps=8, microbatches=8)
    assert str(e.value).startswith(message), str(e.value)


# ---- the same checks through `recover train --faults` ------------------------------------------
def _train_in_process(capsys, tmp_path, plan_text: str, *flags: str) -> tuple[int, list[str]]:
    from recover.experiments.cli import main

    path = tmp_path / "plan.json"
    path.write_text(plan_text)
    code = main(["train", "--faults", str(path), "--out", str(tmp_path / "never"), "--no-progress", *flags])
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize(
    "plan_text, flags, line",
    [
        ('{"faults": [{"kind": "crash", "replica": 1, "step": 3, "phase": "backward"}, '
         '{"kind": "crash", "replica": 7, "step": 3, "phase": "backward"}]}', (),
         "recover: error: --faults: fault 1: replica: 7 is not a replica of this run (0..3)"),
        ('{"faults": [{"kind": "crash", "replica": 1, "step": 3, "phase": "backward"}]}', ("--steps", "3"),
         "recover: error: --faults: fault 0: step: 3 is beyond this run (steps 0..2)"),
        ('{"faults": [{"kind": "melt", "replica": 1, "step": 3, "phase": "backward"}]}', (),
         "recover: error: --faults: fault 0: kind: unknown kind \"melt\"; one of " + ", ".join(KINDS)),
        ('{"faults": [{"kind": "crash", "replica": 1, "step": 3, "phase": "backward"}', (),
         "recover: error: --faults: not valid JSON (line 1, column 76: Expecting ',' delimiter)"),
    ],
)
def test_recover_train_rejects_a_bad_plan_before_starting(capsys, tmp_path, plan_text, flags, line):
    code, lines = _train_in_process(capsys, tmp_path, plan_text, *flags)
    assert code == 2 and lines == [line]
    assert not (tmp_path / "never").exists()  # nothing started, nothing written


@pytest.mark.procs
def test_recover_train_bad_plan_exit_code_from_the_real_command(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text('{"faults": [{"kind": "crash", "replica": 2, "step": 0, "phase": "forward"}]}')
    proc = run_recover("train", "--replicas", "2", "--faults", str(plan), "--out", str(tmp_path / "never"),
                       timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "recover: error: --faults: fault 0: replica: 2 is not a replica of this run (0..1)"
    ]
    assert not (tmp_path / "never").exists()


# ---- round trip (hypothesis) ------------------------------------------------------------------
@st.composite
def faults(draw) -> Fault:
    kind = draw(st.sampled_from(KINDS))
    replica = draw(st.integers(0, 64))
    spec = KIND_TABLE[kind]  # which parameters the kind takes, and which it needs
    seconds = factor = None
    if "seconds" in spec.accepts:
        seconds = draw(st.floats(0.001, 1e4) if "seconds" in spec.requires else st.one_of(st.none(), st.floats(0.001, 1e4)))
    if "factor" in spec.accepts:
        factor = draw(st.floats(1.0, 50.0))
    if draw(st.booleans()):
        return Fault(kind, replica, at_seconds=draw(st.floats(0.0, 1e5)), seconds=seconds, factor=factor)
    phase = spec.at_phase or draw(st.sampled_from(PHASES))
    mb = None
    if phase in MICROBATCH_PHASES and draw(st.booleans()):
        mb = draw(st.integers(1 if phase == "between_microbatches" else 0, 64))
    return Fault(kind, replica, step=draw(st.integers(0, 10**6)), phase=phase, microbatch=mb,
                 seconds=seconds, factor=factor)


@given(st.lists(faults(), max_size=8), st.one_of(st.none(), st.text(max_size=20)))
def test_any_valid_plan_round_trips_through_json(fs, description):
    plan = FaultPlan(tuple(fs), description=description)
    again = FaultPlan.from_json(plan.to_json())
    assert again == plan
    assert again.to_json() == plan.to_json()


# ---- at most once, in process (no signals: the raising kind) --------------------------------------
def test_a_fault_fires_once_even_when_its_point_repeats_or_the_worker_restarts(tmp_path):
    plan = FaultPlan.from_dict({"faults": [
        {"kind": "collective_error", "replica": 0, "step": 2, "phase": "allreduce"},
        {"kind": "slow", "replica": 0, "step": 1, "phase": "forward", "factor": 4},
        {"kind": "collective_error", "replica": 1, "step": 2, "phase": "allreduce"},
    ]})
    inj = FaultInjector(plan, replica=0, rank=0, out_dir=tmp_path, t0=0.0)
    inj.at(1, "forward", 0)
    assert inj.slow_factor == 4
    inj.at(2, "forward", 0)
    with pytest.raises(InjectedLinkError):
        inj.at(2, "allreduce")
    inj.at(2, "allreduce")  # a resilient trainer redoing step 2 reaches the point again: nothing
    assert fired_indices(tmp_path) == {0, 1}
    # A restarted worker (same run directory) does not fire them again, and stays slow.
    again = FaultInjector(plan, replica=0, rank=0, out_dir=tmp_path, t0=0.0)
    assert again.pending == [] and again.slow_factor == 4
    again.at(2, "allreduce")


def test_records_are_whole_lines_in_order(tmp_path):
    f = Fault("crash", 3, step=1, phase="forward")
    for i in range(3):
        append_record(tmp_path, fault_record(i, f, pid=100 + i, t0=0.0, step=1, phase="forward", microbatch=0))
    lines = (tmp_path / "faults.jsonl").read_text().splitlines()
    assert [json.loads(x)["pid"] for x in lines] == [100, 101, 102]
    assert fired_indices(tmp_path) == {0, 1, 2}


@pytest.mark.parametrize("kind, extra", [("bad_vote", {"phase": "vote"})])
def test_a_kind_only_a_leader_can_take_is_refused_at_another_rank_with_one_line(kind, extra):
    from recover.fault_injection.plan import FaultPlan, PlanError, validate_plan

    fault = {"kind": kind, "replica": 1, "rank": 1, "step": 2, "phase": "forward", **extra}
    plan = FaultPlan.from_dict({"faults": [fault]})
    with pytest.raises(PlanError, match=f"a {kind} fault strikes a replica's leader \\(rank 0\\) only"):
        validate_plan(plan, replicas=3, steps=5, ranks_per_replica=2)
    validate_plan(FaultPlan.from_dict({"faults": [{**fault, "rank": 0}]}), replicas=3, steps=5, ranks_per_replica=2)


@pytest.mark.parametrize("kind, extra", [("bitflip", {}), ("crash", {}), ("stall", {"seconds": 1.0}),
                                         ("slow", {"factor": 2.0}), ("pace", {"seconds": 0.1}),
                                         ("collective_error", {"phase": "allreduce"})])
def test_kinds_that_strike_any_rank_are_taken_at_a_follower(kind, extra):
    """The vote's digest sums every rank's shard, so a bitflip at rank 1 is seen (not refused)."""
    from recover.fault_injection.plan import FaultPlan, validate_plan

    fault = {"kind": kind, "replica": 1, "rank": 1, "step": 2, "phase": "forward", **extra}
    validate_plan(FaultPlan.from_dict({"faults": [fault]}), replicas=3, steps=5, ranks_per_replica=2)


def test_a_grad_spike_is_taken_at_any_rank_when_replicas_have_many_ranks():
    """--exact takes --shard and --tp, and a spike in one rank's shard is agreed on by the replica:
    the plan check takes grad_spike at any rank."""
    from recover.fault_injection.plan import FaultPlan, validate_plan

    for rank in (0, 1):
        fault = {"kind": "grad_spike", "replica": 1, "rank": rank, "step": 2, "phase": "backward", "factor": 1e6}
        validate_plan(FaultPlan.from_dict({"faults": [fault]}), replicas=3, steps=5, ranks_per_replica=2)
