"""The resilient core under real faults: SIGKILLed and SIGSTOPped worker processes.

Each run is `recover train --system recover --faults PLAN` on the tiny model with
real processes and gloo; the reference is the plain trainer with the same seed.
Checked from the results, not by trusting the code: every committed step's
ids (`step_ids`) are exactly its M ids, every step's loss equals the failure-free
run's, each fault in faults.jsonl fired where the plan says, and the faulty
replicas never appear among a later step's members.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import assert_every_planned_fault_fired, load_run, run_recover

from recover.core.components.data import iteration_ids
from recover.core.storage.results import read_jsonl, reported_ids, step_ids

pytestmark = pytest.mark.procs  # every test here starts processes

R, M, STEPS, SEED = 4, 8, 20, 11
# Measured: with faults the gradient of a step is summed in another order (3, 2
# or 1 partial sums instead of 4); over 20 steps of the tiny model the largest
# relative loss difference from the failure-free run was ~2e-6 (fp32). 1e-5
# leaves room for other machines' BLAS without admitting a wrong gradient: a
# single microbatch dropped or counted twice moves the loss by >1e-3.
LOSS_RTOL = 1e-5
COMMON = ["--replicas", str(R), "--microbatches", str(M), "--steps", str(STEPS), "--seed", str(SEED),
          "--heartbeat-timeout", "1.5", "--collective-timeout", "20", "--no-progress"]


def plain_losses(out: Path, common: list[str]) -> list[float]:
    """The failure-free losses: the plain trainer with the same workload on one replica
    (one process to start, not R). The replica count only changes the gradient's
    summation order (test_plain_training checks 1 vs 3 at this tolerance), which
    LOSS_RTOL already allows for."""
    run_recover("train", "--system", "plain", *common, "--replicas", "1", "--out", str(out), check=True)
    return [m["loss"] for m in load_run(out)[1]]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[float]:
    return plain_losses(tmp_path_factory.mktemp("ref") / "plain", COMMON)


def run_with_faults(
    tmp_path: Path, faults: list[dict], common: list[str] = COMMON,
) -> tuple[list[dict], dict, list[dict], list[dict]]:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"faults": faults}))
    out = tmp_path / "run"
    proc = run_recover("train", "--system", "recover", *common, "--faults", str(plan), "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr + (out / "logs" / "coordinator.log").read_text()
    _, metrics, summary = load_run(out)
    events = [e for e in read_jsonl(out / "events.jsonl") if e["kind"] == "recovery"]
    return metrics, summary, events, assert_every_planned_fault_fired(out)


def assert_same_trajectory(metrics: list[dict], reference: list[float]) -> None:
    assert [m["step"] for m in metrics] == list(range(STEPS))
    for m, ref in zip(metrics, reference):
        # exactly M ids, each once, from what the members' votes reported folding
        assert reported_ids(m) == iteration_ids(m["step"], M)
        assert sorted(map(int, m["ledgers"])) == m["members"]
        assert abs(m["loss"] - ref) <= LOSS_RTOL * abs(ref), (m["step"], m["loss"], ref)


def first_step_without(metrics: list[dict], replica: int) -> int:
    return next(m["step"] for m in metrics if replica not in m["members"])


def test_crash_in_forward_crash_in_allreduce_and_a_fenced_hang(tmp_path, reference):
    """Replica 0 (nothing special) dies in forward, 1 during the all-reduce; 2 freezes
    past the heartbeat deadline and wakes up later: it is fenced and, with --no-rejoin, never votes again."""
    faults = [
        {"kind": "crash", "replica": 0, "step": 3, "phase": "forward", "microbatch": 1},
        {"kind": "crash", "replica": 1, "step": 8, "phase": "allreduce"},
        {"kind": "hang", "replica": 2, "step": 13, "phase": "backward", "seconds": 2.5},
        # the survivor's last 6 steps take >= 4.8 s, so replica 2 wakes while the run goes on (a
        # replica still frozen when the run ends is no member: the launcher stops it at once)
        {"kind": "pace", "replica": 3, "step": 14, "phase": "forward", "seconds": 0.1},
    ]
    # --no-rejoin: the woken replica leaves instead of rejoining (tests/test_rejoin.py has the default)
    metrics, summary, events, fired = run_with_faults(tmp_path, faults, COMMON + ["--no-rejoin"])
    assert_same_trajectory(metrics, reference)
    fired = [f for f in fired if f["kind"] != "pace"]
    assert [(f["replica"], f["step"], f["phase"]) for f in fired] == [(0, 3, "forward"), (1, 8, "allreduce"),
                                                                       (2, 13, "backward")]
    # the faulty replica leaves at exactly the step of its fault, and never returns
    for f in fired:
        assert first_step_without(metrics, f["replica"]) == f["step"]
        assert all(f["replica"] not in m["members"] for m in metrics if m["step"] >= f["step"])
    # one recovery per fault (a ring neighbour may report the broken all-reduce
    # before the coordinator sees the death: both land in the same recovery)
    assert [e["step"] for e in events] == [3, 8, 13]
    assert any("replica 1 lost" in f for f in events[1]["faults"])
    for e in events:
        assert e["redone"], e  # something died with the replica and was redone
        assert e["recovery_seconds"] > 0
    exits = {p["replica"]: p for p in summary["processes"] if p["role"] == "worker"}
    assert exits[0]["how"] == exits[1]["how"] == "killed by SIGKILL"
    # the frozen replica woke to a closed control connection and left: fenced (exit 3)
    assert exits[2]["returncode"] == 3, exits[2]
    assert exits[3]["returncode"] == 0
    assert summary["status"] == "ok" and summary["steps"] == STEPS
    assert list(summary["final_checksums"]) == ["3"]  # only the survivor finished


def test_two_crashes_in_one_iteration_and_a_third_during_its_recovery(tmp_path, reference):
    """1 and 2 die in the same step; 3 dies while redoing their microbatches; a link
    error later forces one more generation; replica 0 finishes alone."""
    faults = [
        {"kind": "crash", "replica": 1, "step": 4, "phase": "forward", "microbatch": 0},
        {"kind": "crash", "replica": 2, "step": 4, "phase": "between_microbatches", "microbatch": 1},
        # replica 3's third microbatch of step 4 can only be a redo of the dead ones' work
        {"kind": "crash", "replica": 3, "step": 4, "phase": "forward", "microbatch": 2},
        {"kind": "collective_error", "replica": 0, "step": 9, "phase": "allreduce"},
    ]
    metrics, summary, events, fired = run_with_faults(tmp_path, faults)
    assert_same_trajectory(metrics, reference)
    assert sorted(f["replica"] for f in fired) == [0, 1, 2, 3]
    step4 = metrics[4]
    assert step4["members"] == [0] and step4["recoveries"] >= 2
    assert all(m["members"] == [0] for m in metrics[4:])
    gens = [m["generation"] for m in metrics]
    assert gens == sorted(gens) and gens[9] > gens[8]  # the link error re-formed the group
    assert any("replica 0 reported" in e["fault"] for e in events)
    assert summary["status"] == "ok"


def test_a_straggler_gets_fewer_microbatches(tmp_path, reference):
    """Layer 3 end to end: replica 3's microbatches last at least 0.3 s from step 2 on
    (several times the others' on the tiny model, whatever the machine's load: `pace`,
    not `slow`, whose factor a loaded machine's noise can swamp; seen beside three other
    test runs: balancing began at step 14); the quota policy moves work to the others
    while every step still folds M ids."""
    faults = [{"kind": "pace", "replica": 3, "step": 2, "phase": "forward", "seconds": 0.3}]
    metrics, summary, events, fired = run_with_faults(tmp_path, faults)
    assert_same_trajectory(metrics, reference)
    assert events == [] and all(m["members"] == [0, 1, 2, 3] for m in metrics)
    # every replica ends with bit-identical weights, whatever quotas each one folded
    assert set(summary["final_checksums"]) == {"0", "1", "2", "3"} and "weights_checksum" in summary
    assert metrics[0]["folded"] == {"0": 2, "1": 2, "2": 2, "3": 2}  # no speeds measured yet: equal quotas
    # The speed estimate is smoothed (one noisy step must not reshuffle quotas), so it
    # takes a few slow steps to cross the balancing threshold; from step 10 on the
    # straggler has been measured slow 8 times.
    late = [m["folded"] for m in metrics[10:]]
    assert all(f["3"] < 2 and sum(f.values()) == M for f in late), late


def test_the_last_replica_dying_ends_the_run_with_a_clear_error(tmp_path):
    faults = [
        {"kind": "crash", "replica": 0, "step": 2, "phase": "forward"},
        {"kind": "replica_loss", "replica": 1, "step": 5, "phase": "backward"},
    ]
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"faults": faults}))
    out = tmp_path / "run"
    proc = run_recover("train", "--system", "recover", "--replicas", "2", "--microbatches", "4", "--steps", "10",
                       "--no-progress", "--faults", str(plan), "--out", str(out))
    assert proc.returncode == 1
    assert "no replica left" in proc.stdout
    assert_every_planned_fault_fired(out)
    _, metrics, summary = load_run(out)
    assert [m["step"] for m in metrics] == [0, 1, 2, 3, 4]  # everything committed is on disk
    assert summary["status"] == "failed" and summary["steps"] == 5


def test_an_abort_is_seen_between_microbatches_when_a_quota_outlasts_the_deadline(tmp_path):
    """Every microbatch lasts 0.8 s (a `pace` fault on all three
    replicas, so quotas stay equal), so a quota of 4 takes 3.2 s, longer than the
    2 s collective timeout, which is also the rejoin deadline; one microbatch does
    not. Replica 2 is killed in step 1: the survivors must answer the abort at their
    next microbatch, not after their quota, or they miss the deadline and the run
    ends with no replica left."""
    r, m, steps, timeout, pace = 3, 12, 3, 2.0, 0.8
    common = ["--replicas", str(r), "--microbatches", str(m), "--steps", str(steps), "--seed", str(SEED),
              "--heartbeat-timeout", "3", "--collective-timeout", str(timeout), "--no-progress"]
    reference = plain_losses(tmp_path / "plain", common)
    faults = [{"kind": "pace", "replica": i, "step": 0, "phase": "forward", "seconds": pace} for i in range(r)]
    faults.append({"kind": "crash", "replica": 2, "step": 1, "phase": "forward", "microbatch": 1})
    metrics, summary, _, fired = run_with_faults(tmp_path, faults, common)
    assert sorted((f["kind"], f["replica"]) for f in fired) == [("crash", 2), ("pace", 0), ("pace", 1), ("pace", 2)]
    assert [(f["step"], f["microbatch"]) for f in fired if f["kind"] == "crash"] == [(1, 1)]
    # precondition, from what the workers measured: a quota outlasts the deadline
    assert metrics[0]["folded"] == {"0": 4, "1": 4, "2": 4}
    assert 4 * metrics[0]["slowest_microbatch_seconds"] > timeout, metrics[0]
    assert [x["step"] for x in metrics] == list(range(steps))
    assert metrics[0]["members"] == [0, 1, 2]
    assert all(x["members"] == [0, 1] for x in metrics[1:])  # both survivors kept going
    for x, ref in zip(metrics, reference):
        assert abs(x["loss"] - ref) <= LOSS_RTOL * abs(ref), (x["step"], x["loss"], ref)
    exits = {p["replica"]: p for p in summary["processes"] if p["role"] == "worker"}
    assert exits[0]["returncode"] == exits[1]["returncode"] == 0


def test_a_flipped_weight_bit_is_caught_at_the_next_vote_and_the_replica_fenced(tmp_path, reference):
    """Silent data corruption. Replica 1's weights flip a bit after
    step 5's optimizer step, replica 2's in the middle of step 12's forward passes.
    Nothing fails; only the votes' weights digests (every step, the default) differ.
    Each corrupt replica is fenced at the vote of the step its corrupt weights would
    have fed (6 and 12), its share is redone, and the trajectory stays failure-free."""
    faults = [
        {"kind": "bitflip", "replica": 1, "step": 5, "phase": "optimizer_step"},
        {"kind": "bitflip", "replica": 2, "step": 12, "phase": "forward", "microbatch": 1},
    ]
    metrics, summary, events, fired = run_with_faults(tmp_path, faults)  # each fault fired, as planned
    assert_same_trajectory(metrics, reference)
    assert first_step_without(metrics, 1) == 6 and first_step_without(metrics, 2) == 12
    assert all(not {1, 2} & set(m["members"]) for m in metrics if m["step"] >= 12)
    assert [e["step"] for e in events] == [6, 12]
    for e, r in zip(events, (1, 2)):
        assert f"replica {r} lost: fenced: weights digest" in e["fault"], e
        assert e["redone"], e
    fenced = [e for e in read_jsonl(tmp_path / "run" / "events.jsonl") if e["kind"] == "fenced"]
    assert [(e["replica"], e["step"]) for e in fenced] == [(1, 6), (2, 12)], fenced
    assert all(e["weights_digest"] != e["majority_digest"] for e in fenced)
    exits = {p["replica"]: p for p in summary["processes"] if p["role"] == "worker"}
    assert exits[1]["returncode"] == exits[2]["returncode"] == 3  # fenced, told by a closed connection
    assert summary["status"] == "ok" and sorted(summary["final_checksums"]) == ["0", "3"]


def test_a_permanently_broken_link_gets_its_replica_fenced_and_the_others_finish(tmp_path):
    """Replica 2's all-reduces fail from step 1 on, for good. Re-forming
    the same members cannot help; it is fenced after --fence-after (3) failed generations
    it was the first to report, and 0 and 1 finish with the failure-free trajectory."""
    r, m, steps = 3, 6, 4
    common = ["--replicas", str(r), "--microbatches", str(m), "--steps", str(steps), "--seed", str(SEED),
              "--heartbeat-timeout", "3", "--collective-timeout", "20", "--no-progress"]
    reference = plain_losses(tmp_path / "plain", common)
    faults = [{"kind": "broken_link", "replica": 2, "step": 1, "phase": "allreduce"}]
    metrics, summary, events, fired = run_with_faults(tmp_path, faults, common)
    assert [(f["kind"], f["replica"], f["step"], f["phase"]) for f in fired] == [("broken_link", 2, 1, "allreduce")]
    assert [x["step"] for x in metrics] == list(range(steps))
    for x, ref in zip(metrics, reference):
        assert reported_ids(x) == iteration_ids(x["step"], m)  # from what the members reported folding
        assert abs(x["loss"] - ref) <= LOSS_RTOL * abs(ref), (x["step"], x["loss"], ref)
    assert metrics[0]["members"] == [0, 1, 2]
    assert all(x["members"] == [0, 1] for x in metrics[1:])
    # three generations of step 1 failed on replica 2's reports; the fourth, without it, committed
    assert metrics[1]["generation"] == metrics[0]["generation"] + 3
    fenced = [e for e in read_jsonl(tmp_path / "run" / "events.jsonl") if e["kind"] == "fenced"]
    assert [(e["replica"], e["step"], len(e["generations"])) for e in fenced] == [(2, 1, 3)], fenced
    assert fenced[0]["reason"].startswith("replica 2 fenced: implicated in 3 consecutive failed generations")
    assert all("replica 2 reported" in e["fault"] for e in events)  # every recovery was its report
    assert events[-1]["step"] == 1 and events[-1]["survivors"] == [0, 1] and events[-1]["redone"]
    exits = {p["replica"]: p for p in summary["processes"] if p["role"] == "worker"}
    assert exits[2]["returncode"] == 3, exits[2]  # told it was fenced: the connection closed
    assert exits[0]["returncode"] == exits[1]["returncode"] == 0
    assert summary["status"] == "ok" and summary["steps"] == steps


def test_a_loss_at_step_0_does_not_stall_the_next_rendezvous(tmp_path):
    """Replica 2's microbatches last 1 s, so replicas 0 and 1 finish
    their step-0 quota and are in generation 0's rendezvous, waiting for 2, when it is
    killed; each abandons that rendezvous with a wait still inside the backend. In
    generation 1 replica 1 freezes for 1.5 s at its redo microbatch (its third of
    step 0) and is then killed, so replica 0 abandons a second rendezvous. With one store client shared across
    generations the two dead waits sit ahead of generation 2's rendezvous in that
    client, and it times out (then a generation 3 forms); with a client per
    communicator generation 2 forms at once and commits step 0.

    Since readiness (a rendezvous starts only once every member said `ready`),
    replicas 0 and 1 wait for `go` instead of sitting in a rendezvous when 2 dies, so no
    dead wait is left behind at all; the test still holds the outcome: one generation
    per loss, nothing timed out, the failure-free trajectory."""
    r, m, steps, timeout = 3, 6, 2, 3.0
    common = ["--replicas", str(r), "--microbatches", str(m), "--steps", str(steps), "--seed", str(SEED),
              "--heartbeat-timeout", "3", "--collective-timeout", str(timeout), "--no-progress"]
    reference = plain_losses(tmp_path / "plain", common)
    faults = [
        {"kind": "pace", "replica": 2, "step": 0, "phase": "forward", "seconds": 1.0},
        {"kind": "crash", "replica": 2, "step": 0, "phase": "forward", "microbatch": 1},
        # only a redo of replica 2's work (one id each for 0 and 1) is a third microbatch of step 0;
        # replica 1 freezes there for 1.5 s first, so replica 0 has folded its redo and waits in
        # generation 1's rendezvous when 1 dies, however loaded the machine (beside stress-ng
        # replica 1 once died before 0 got there, and this test's precondition did not hold)
        {"kind": "hang", "replica": 1, "step": 0, "phase": "forward", "microbatch": 2, "seconds": 1.5},
        {"kind": "crash", "replica": 1, "step": 0, "phase": "forward", "microbatch": 2},
    ]
    metrics, summary, events, fired = run_with_faults(tmp_path, faults, common)
    assert sorted((f["kind"], f["replica"], f["step"], f["microbatch"]) for f in fired) == [
        ("crash", 1, 0, 2), ("crash", 2, 0, 1), ("hang", 1, 0, 2), ("pace", 2, 0, 0)]
    # no rendezvous waited out its deadline: exactly one generation per loss
    everything = [f for e in events for f in e["faults"]]
    assert not any("timed out" in f for f in everything), everything
    assert [(e["from_generation"], e["generation"]) for e in events] == [(0, 1), (1, 2)], events
    assert [(x["step"], x["generation"], x["members"]) for x in metrics] == [(0, 2, [0]), (1, 2, [0])]
    assert metrics[0]["folded"] == {"0": m}  # the dead replicas' ledgers were redone, all by replica 0
    for x, ref in zip(metrics, reference):
        assert step_ids(x) == iteration_ids(x["step"], m)
        assert abs(x["loss"] - ref) <= LOSS_RTOL * abs(ref), (x["step"], x["loss"], ref)
    exits = {p["replica"]: p for p in summary["processes"] if p["role"] == "worker"}
    assert exits[1]["how"] == exits[2]["how"] == "killed by SIGKILL" and exits[0]["returncode"] == 0
    # from the survivor's own log: nothing it started waited out a deadline
    log = (tmp_path / "run" / "logs" / "replica0.log").read_text()
    assert "timed out" not in log, log
