"""Pipeline parallelism inside a replica under recover (PP slice): `recover train --pp P`.

Each replica is P processes, one pipeline stage each (core/parallel/pp.py); a replica's
quota of global microbatch ids is its pipeline's microbatches, run through one schedule
(afab = GPipe, or 1f1b) with scale_grads=False, and the stages at one position of every
replica all-reduce their stage's gradient sum. A stage SIGKILLed mid-step takes its whole
replica out; the survivor redoes its ids through the same schedule. Evidence from the
workers' own reports: metrics.jsonl (losses, ledgers), faults.jsonl, pids.json, events.jsonl.
"""
from __future__ import annotations

import json

import pytest

from conftest import assert_every_planned_fault_fired, assert_plain_is_the_reference, load_run, train_metrics

from recover.core.components.data import iteration_ids
from recover.core.storage.results import read_jsonl, reported_ids

pytestmark = pytest.mark.procs

STEPS, M = 5, 4


def _train(out, *args: str, timeout: float = 300):
    return train_metrics(out, *args, steps=STEPS, microbatches=M, timeout=timeout)


@pytest.fixture(scope="module")
def plain_2(tmp_path_factory):
    """Plain data parallel, 2 replicas of one rank: the reference."""
    out = tmp_path_factory.mktemp("plain") / "run"
    return out, _train(out, "--system", "plain", "--replicas", "2")


@pytest.fixture(scope="module")
def pp_2x2(tmp_path_factory):
    """2 replicas x PP2 with the default schedule (1f1b), failure-free."""
    out = tmp_path_factory.mktemp("pp") / "run"
    return out, _train(out, "--system", "recover", "--replicas", "2", "--pp", "2")


def _equals_plain(out, metrics, plain_2):
    assert [m["step"] for m in metrics] == list(range(STEPS))
    for m, ref in zip(metrics, plain_2[1]):
        assert m["loss"] == pytest.approx(ref["loss"], rel=1e-4)
        assert reported_ids(m) == iteration_ids(m["step"], M)
    pids = json.loads((out / "pids.json").read_text())["replicas"]
    assert all(len(p) == 2 for p in pids.values())  # two processes per replica: P = 2
    # the final weights: each replica's checksum counts every parameter once (the tied one on stage 0)
    ref = json.loads((plain_2[0] / "final" / "replica0.json").read_text())["weights_checksum"]
    for r in range(2):
        final = json.loads((out / "final" / f"replica{r}.json").read_text())
        assert final["weights_checksum"] == pytest.approx(ref, rel=1e-6)


def test_two_replicas_of_pp2_1f1b_equal_plain_data_parallel(pp_2x2, plain_2):
    _equals_plain(*pp_2x2, plain_2)


def test_two_replicas_of_pp2_afab_equal_plain_data_parallel(tmp_path, plain_2):
    out = tmp_path / "run"
    _equals_plain(out, _train(out, "--system", "recover", "--replicas", "2", "--pp", "2", "--pp-schedule", "afab"),
                  plain_2)


def test_a_non_leader_stage_killed_mid_step_takes_its_replica_and_the_survivor_redoes_its_ids(
        tmp_path, out_dir, pp_2x2):
    plan = tmp_path / "plan.json"
    # rank 1 (the last stage, not the leader) of replica 1, in the backward of its second microbatch of step 2
    plan.write_text(json.dumps({"faults": [
        {"kind": "crash", "replica": 1, "rank": 1, "step": 2, "phase": "backward", "microbatch": 1}]}))
    _train(out_dir, "--system", "recover", "--replicas", "2", "--pp", "2", "--faults", str(plan))
    [fired] = assert_every_planned_fault_fired(out_dir)
    pids = json.loads((out_dir / "pids.json").read_text())["replicas"]
    assert fired["pid"] == pids["1"][1]  # the rank itself recorded it, by its own PID
    _, metrics, summary = load_run(out_dir)
    assert [m["step"] for m in metrics] == list(range(STEPS))
    assert all(reported_ids(m) == iteration_ids(m["step"], M) for m in metrics)  # the ledgers, each id once
    assert [m["members"] for m in metrics] == [[0, 1]] * 2 + [[0]] * 3
    [rec] = [e for e in read_jsonl(out_dir / "events.jsonl") if e["kind"] == "recovery"]
    assert rec["step"] == 2 and rec["survivors"] == [0] and rec["redone"]
    gone = {e["pid"]: e for e in summary["processes"] if e["role"] == "worker" and e["replica"] == 1}
    assert gone[pids["1"][0]]["how"] == "killed by SIGKILL", summary["processes"]  # the leader went with it
    for m, ref in zip(metrics, pp_2x2[1]):
        assert m["loss"] == pytest.approx(ref["loss"], rel=1e-5)


@pytest.mark.parametrize("phase", ["backward", "vote", "commit", "optimizer_step"])
def test_a_stage_stalled_for_good_at_any_phase_takes_its_replica_out_by_the_progress_rule(
        tmp_path, out_dir, pp_2x2, phase):
    # rank 1 (the last stage, not the leader) of replica 1 blocks for good in step 2, its
    # heartbeats on: its leader waits on it (in the schedule's sends, in the replica's relay, or,
    # after an optimizer step, in the next step's schedule) and stops progressing; that, and
    # nothing else, tells the coordinator.
    plan = tmp_path / "plan.json"
    fault = {"kind": "stall", "replica": 1, "rank": 1, "step": 2, "phase": phase}
    if phase == "backward":
        fault["microbatch"] = 0
    plan.write_text(json.dumps({"faults": [fault]}))
    _train(out_dir, "--system", "recover", "--replicas", "2", "--pp", "2", "--collective-timeout", "2",
           "--faults", str(plan))
    assert_every_planned_fault_fired(out_dir)
    _, metrics, _ = load_run(out_dir)
    assert [m["step"] for m in metrics] == list(range(STEPS))
    assert all(reported_ids(m) == iteration_ids(m["step"], M) for m in metrics)
    assert metrics[-1]["members"] == [0]
    [rec] = [e for e in read_jsonl(out_dir / "events.jsonl") if e["kind"] == "recovery"]
    assert rec["fault"].startswith("replica 1 lost: no progress for "), rec
    for m, ref in zip(metrics, pp_2x2[1]):
        assert m["loss"] == pytest.approx(ref["loss"], rel=1e-5)


@pytest.fixture(scope="module")
def tp2_pp2(tmp_path_factory):
    """2 replicas x (TP2 x PP2), 8 processes, failure-free."""
    out = tmp_path_factory.mktemp("tppp") / "run"
    return out, _train(out, "--system", "recover", "--replicas", "2", "--tp", "2", "--pp", "2", timeout=400)


def test_two_replicas_of_tp2_x_pp2_equal_plain_data_parallel(tp2_pp2, plain_2):
    # each replica a (pp 2, tp 2) grid, tp innermost: local rank = pp_index * 2 + tp_index
    out, metrics = tp2_pp2
    assert [m["step"] for m in metrics] == list(range(STEPS))
    for m, ref in zip(metrics, plain_2[1]):
        assert m["loss"] == pytest.approx(ref["loss"], rel=1e-4)
        assert reported_ids(m) == iteration_ids(m["step"], M)
    assert all(len(p) == 4 for p in json.loads((out / "pids.json").read_text())["replicas"].values())
    ref = json.loads((plain_2[0] / "final" / "replica0.json").read_text())["weights_checksum"]
    for r in range(2):
        final = json.loads((out / "final" / f"replica{r}.json").read_text())
        assert final["weights_checksum"] == pytest.approx(ref, rel=1e-6)


def test_the_last_stages_tp_rank_killed_in_a_tp2_x_pp2_replica_takes_it_out(tmp_path, out_dir, tp2_pp2):
    plan = tmp_path / "plan.json"
    # rank 3 = (stage 1, tp 1) of replica 1, in the forward of its first microbatch of step 3
    plan.write_text(json.dumps({"faults": [
        {"kind": "crash", "replica": 1, "rank": 3, "step": 3, "phase": "forward", "microbatch": 0}]}))
    _train(out_dir, "--system", "recover", "--replicas", "2", "--tp", "2", "--pp", "2", "--faults", str(plan),
           timeout=400)
    [fired] = assert_every_planned_fault_fired(out_dir)
    assert fired["pid"] == json.loads((out_dir / "pids.json").read_text())["replicas"]["1"][3]
    _, metrics, _ = load_run(out_dir)
    assert all(reported_ids(m) == iteration_ids(m["step"], M) for m in metrics)
    assert [m["members"] for m in metrics] == [[0, 1]] * 3 + [[0]] * 2
    for m, ref in zip(metrics, tp2_pp2[1]):
        assert m["loss"] == pytest.approx(ref["loss"], rel=1e-5)


def test_a_stage_rank_killed_in_a_pp2_x_shard2_replica_takes_it_out_and_the_trajectory_is_plains(
        tmp_path, out_dir, plain_2):
    # each replica a (pp 2, shard 2) grid of FSDP2 stages: local rank = pp_index * 2 + shard_index
    plan = tmp_path / "plan.json"
    # rank 3 = (stage 1, shard 1) of replica 1, in the backward of its first microbatch of step 2
    plan.write_text(json.dumps({"faults": [
        {"kind": "crash", "replica": 1, "rank": 3, "step": 2, "phase": "backward", "microbatch": 0}]}))
    _train(out_dir, "--system", "recover", "--replicas", "2", "--pp", "2", "--shard", "2", "--faults", str(plan),
           timeout=400)
    [fired] = assert_every_planned_fault_fired(out_dir)
    pids = json.loads((out_dir / "pids.json").read_text())["replicas"]
    assert all(len(p) == 4 for p in pids.values()) and fired["pid"] == pids["1"][3]
    _, metrics, _ = load_run(out_dir)
    assert all(reported_ids(m) == iteration_ids(m["step"], M) for m in metrics)
    assert [m["members"] for m in metrics] == [[0, 1]] * 2 + [[0]] * 3
    # failure-free, 2 x (PP2 x S2) equals plain data parallel to 1.4e-7 (measured); with the kill,
    # the survivor's redo keeps it on plain's trajectory, and its final weights are plain's
    for m, ref in zip(metrics, plain_2[1]):
        assert m["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    ref = json.loads((plain_2[0] / "final" / "replica0.json").read_text())["weights_checksum"]
    final = json.loads((out_dir / "final" / "replica0.json").read_text())
    assert final["weights_checksum"] == pytest.approx(ref, rel=1e-6)


def test_survivors_finishing_a_long_schedule_after_a_crash_are_waited_for_not_removed(tmp_path):
    # Every microbatch paced to 0.5 s, a quota of 6 to 9 of them run as one schedule, and a 1 s
    # collective timeout: after replica 1 dies, each survivor answers the abort only once its
    # schedule is through (3 s later). A fixed rejoin deadline (the collective timeout plus two
    # microbatches) removed both of them ("no replica left"); their progress (a tick at each
    # microbatch of the schedule) keeps them members.
    steps, m = 3, 18
    ref = _ref_3x_pp2(tmp_path, steps, m)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"faults": [
        *({"kind": "pace", "replica": r, "step": 0, "phase": "forward", "seconds": 0.5} for r in range(3)),
        {"kind": "crash", "replica": 1, "step": 1, "phase": "forward"}]}))
    out = tmp_path / "run"
    metrics = train_metrics(out, "--system", "recover", "--replicas", "3", "--pp", "2", "--collective-timeout", "1",
                            "--faults", str(plan), steps=steps, microbatches=m, timeout=400)
    assert [x["step"] for x in metrics] == list(range(steps))
    assert all(reported_ids(x) == iteration_ids(x["step"], m) for x in metrics)
    assert metrics[-1]["members"] == [0, 2]
    recoveries = [e for e in read_jsonl(out / "events.jsonl") if e["kind"] == "recovery"]
    assert len(recoveries) == 1 and recoveries[0]["faults"] == [
        "replica 1 lost: control connection closed (process gone)"], recoveries
    for x, r in zip(metrics, ref):
        assert x["loss"] == pytest.approx(r["loss"], rel=1e-5)


def _ref_3x_pp2(tmp_path, steps: int, m: int) -> list[dict]:
    """The same layout failure-free (no pace: pacing changes the time, not the numbers)."""
    return train_metrics(tmp_path / "ref", "--system", "recover", "--replicas", "3", "--pp", "2",
                         steps=steps, microbatches=m)


def test_plain_at_2_x_pp2_is_recovers_failure_free_trajectory(tmp_path, pp_2x2):
    # plain builds the same PP2 partition (1f1b, the default schedule) from core/parallel/ and deals each replica the same
    # ids, so it is recover's failure-free reference at this very layout, not at one rank per replica
    out = tmp_path / "run"
    metrics = _train(out, "--system", "plain", "--replicas", "2", "--pp", "2")
    assert_plain_is_the_reference(out, metrics, pp_2x2, STEPS, M, ranks_per_replica=2)
