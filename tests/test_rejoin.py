"""Back to full strength: a replacement joins a running job, and a falsely-dead replica rejoins.

Real processes, gloo, the tiny model, 2 replicas. A replica is SIGKILLed (the
launcher starts a replacement in its slot, `--replace-after`) or SIGSTOPped past
the heartbeat deadline and SIGCONTed (it wakes to a closed connection and
rejoins). `--min-replicas 2` makes the next step wait at the boundary for the
newcomer, so the test does not depend on how fast this loaded machine starts a
process. Checked from what the workers reported: every step's ledgers are its M
ids, the loss equals the failure-free run's, the newcomer's weights digest at
its first vote equals the donor's, the join record says what moved, and both
replicas finish with the same weights.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import (USER_LOOP, assert_every_planned_fault_fired, load_run, run_recover, run_recover_killing,
                      user_loop_committed_every_step)

from recover.core.components.data import iteration_ids
from recover.core.storage.results import read_jsonl, reported_ids

pytestmark = pytest.mark.procs

R, M, STEPS, SEED = 2, 4, 8, 5
LOSS_RTOL = 1e-5  # as tests/test_resilient.py: summation order only; one id lost or doubled moves it >1e-3
COMMON = ["--replicas", str(R), "--microbatches", str(M), "--steps", str(STEPS), "--seed", str(SEED),
          "--heartbeat-timeout", "1.5", "--collective-timeout", "20", "--no-progress", "--min-replicas", "2"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[float]:
    """Failure-free losses (one replica: only the summation order differs)."""
    out = tmp_path_factory.mktemp("ref") / "plain"
    run_recover("train", "--system", "plain", *COMMON, "--replicas", "1", "--min-replicas", "1", "--out", str(out),
                check=True, timeout=120)
    return [m["loss"] for m in load_run(out)[1]]


def _run(tmp_path: Path, faults: list[dict], *extra: str) -> tuple[Path, list[dict], dict, list[dict]]:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"faults": faults}))
    out = tmp_path / "run"
    proc = run_recover("train", "--system", "recover", *COMMON, *extra, "--faults", str(plan), "--out", str(out),
                       timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr + (out / "logs" / "coordinator.log").read_text()
    _, metrics, summary = load_run(out)
    return out, metrics, summary, read_jsonl(out / "events.jsonl")


def _assert_trajectory(metrics: list[dict], reference: list[float]) -> None:
    assert [m["step"] for m in metrics] == list(range(STEPS))
    for m, ref in zip(metrics, reference):
        assert reported_ids(m) == iteration_ids(m["step"], M)  # what the members' votes said they folded
        assert sorted(map(int, m["ledgers"])) == m["members"]
        assert abs(m["loss"] - ref) <= LOSS_RTOL * abs(ref), (m["step"], m["loss"], ref)


def _assert_joined(events: list[dict], metrics: list[dict], summary: dict, why: str) -> dict:
    """One join of replica 1, healed from replica 0, digests equal; full strength to the end."""
    joins = [e for e in events if e["kind"] == "join"]
    assert len(joins) == 1, events
    j = joins[0]
    assert (j["replica"], j["why"], j["donor"]) == (1, why, 0)
    assert j["bytes"] > 4 * 100_000 and j["transfer_seconds"] > 0  # weights + AdamW moments: 3x the weights
    assert j["start_to_first_commit_seconds"] > 0
    # the newcomer's digest after the transfer is what every member's first vote reported
    assert set(j["member_digests"]) == {"0", "1"}
    assert set(j["member_digests"].values()) == {j["weights_digest"]}
    admitted = j["first_commit_step"]
    assert 0 < admitted < STEPS
    step_of = {m["step"]: m for m in metrics}
    assert 1 not in step_of[admitted - 1]["members"]  # it was out before the boundary ...
    assert all(step_of[s]["members"] == [0, 1] for s in range(admitted, STEPS))  # ... and in from it to the end
    assert step_of[admitted]["generation"] > step_of[admitted - 1]["generation"]
    finals = summary["final_checksums"]
    assert sorted(finals) == ["0", "1"] and len(set(finals.values())) == 1, finals
    return j


def test_a_killed_replica_is_replaced_and_the_run_ends_at_full_strength(tmp_path, reference):
    out, metrics, summary, events = _run(
        tmp_path, [{"kind": "crash", "replica": 1, "step": 2, "phase": "forward", "microbatch": 0}],
        "--replace-after", "0.2")
    fired = assert_every_planned_fault_fired(out)
    _assert_trajectory(metrics, reference)
    j = _assert_joined(events, metrics, summary, "replacement")
    assert j["first_commit_step"] >= 3  # never inside step 2, where it died
    ones = [p for p in summary["processes"] if p["role"] == "worker" and p["replica"] == 1]
    assert [p["how"] for p in ones] == ["killed by SIGKILL", "exited 0"], ones
    assert ones[0]["pid"] == fired[0]["pid"] and j["pid"] == ones[1]["pid"]  # a new process in the slot


def test_a_frozen_replica_declared_dead_rejoins_when_it_wakes(tmp_path, reference):
    out, metrics, summary, events = _run(
        tmp_path, [{"kind": "hang", "replica": 1, "step": 2, "phase": "backward", "microbatch": 0, "seconds": 3}])
    fired = assert_every_planned_fault_fired(out)
    _assert_trajectory(metrics, reference)
    recoveries = [e for e in events if e["kind"] == "recovery"]
    assert recoveries[0]["step"] == 2 and "no heartbeat" in recoveries[0]["fault"], recoveries
    j = _assert_joined(events, metrics, summary, "woken")
    # the same process came back (no replacement was asked for), and finished
    ones = [p for p in summary["processes"] if p["role"] == "worker" and p["replica"] == 1]
    assert [(p["pid"], p["how"]) for p in ones] == [(fired[0]["pid"], "exited 0")]
    assert j["pid"] == fired[0]["pid"]
    assert "rejoining as a newcomer" in (out / "logs" / "replica1.log").read_text()


def test_a_donor_killed_during_the_transfer_and_the_newcomer_is_healed_by_another(tmp_path, reference):
    # Three replicas: 2 dies at step 2 and is replaced; at its admission (step 3) the donor
    # (the fastest member: 0 or 1, so both carry the fault; only the donor reaches that point
    # at step 3) is SIGKILLed just before the state moves. The newcomer's transfer fails, it
    # waits for the next commit, and the survivor heals both newcomers at step 4.
    faults = [{"kind": "crash", "replica": 2, "step": 2, "phase": "forward", "microbatch": 0},
              {"kind": "crash", "replica": 0, "step": 3, "phase": "state_transfer"},
              {"kind": "crash", "replica": 1, "step": 3, "phase": "state_transfer"}]
    out, metrics, summary, events = _run(tmp_path, faults, "--replicas", "3", "--min-replicas", "3",
                                         "--replace-after", "0.2")
    fired = read_jsonl(out / "faults.jsonl")
    _assert_trajectory(metrics, reference)
    admitted = [e for e in events if e["kind"] == "admitted"]
    donor = admitted[0]["donor"]
    # exactly the donor of the first admission was killed, at step 3, before the state moved
    assert sorted((f["replica"], f["step"], f["phase"]) for f in fired) == sorted([
        (2, 2, "forward"), (donor, 3, "state_transfer")]), fired
    assert admitted[0]["replicas"] == [2] and admitted[0]["step"] == 3
    failed = [e for e in events if e["kind"] == "join_failed"]
    assert [e["replica"] for e in failed] == [2]  # dropped cleanly back to waiting, not stuck
    other = 1 - donor
    assert admitted[-1]["donor"] == other and admitted[-1]["replicas"] == sorted([2, donor])
    joins = {e["replica"]: e for e in events if e["kind"] == "join"}
    assert sorted(joins) == sorted([2, donor]) and all(j["donor"] == other for j in joins.values())
    assert joins[2]["attempts"] == 1  # its second admission healed it
    assert metrics[-1]["members"] == [0, 1, 2]  # back at full strength
    finals = summary["final_checksums"]
    assert sorted(finals) == ["0", "1", "2"] and len(set(finals.values())) == 1, finals


def test_recover_launch_replaces_a_killed_replica_of_a_users_loop(tmp_path):
    """`recover launch --replace-after`: the example loop's LambdaLR position moves with the state
    (a newcomer whose scheduler were at step 0 would report another rate, or be refused)."""
    import sys

    example = USER_LOOP
    out, steps = tmp_path / "launch", 40
    proc, victim = run_recover_killing(
        ["launch", "--replicas", "2", "--microbatches", "4", "--steps", str(steps), "--heartbeat-timeout", "2",
         "--replace-after", "0.2", "--min-replicas", "2", "--out", str(out), "--", sys.executable, example],
        out, replica=1, after_commits=3, timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    metrics = user_loop_committed_every_step(out, steps, 4)
    (join,) = [e for e in read_jsonl(out / "events.jsonl") if e["kind"] == "join"]
    assert join["replica"] == 1 and join["pid"] != victim and join["bytes"] > 0
    assert set(join["member_digests"].values()) == {join["weights_digest"]}
    assert metrics[-1]["members"] == [0, 1] and any(m["members"] == [0] for m in metrics)
    ones = [p for p in json.loads((out / "summary.json").read_text())["processes"] if p["replica"] == 1]
    assert [(p["pid"] == victim, p["how"]) for p in ones] == [(True, "killed by SIGKILL"), (False, "exited 0")]
