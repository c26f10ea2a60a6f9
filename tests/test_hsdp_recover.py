"""Replicas of many ranks under recover: `recover train --shard S`, real processes.

HSDP: FSDP2 shards the model over a replica's S ranks, the replicas all-reduce per
position. A rank killed by its PID takes its whole replica out; the other replicas
redo its ids. A checkpoint of such a replica holds every rank's shards, and `--resume`
from it continues the failure-free trajectory. Evidence from the workers' own reports:
the ledgers in metrics.jsonl, the faults each process recorded, the launcher's exits.
"""
from __future__ import annotations

import json
import shutil

import pytest

from conftest import assert_every_planned_fault_fired, load_run, pid_alive, run_recover

from recover.core.components.data import iteration_ids
from recover.core.storage.checkpoint_dir import CheckpointDir
from recover.core.storage.results import read_jsonl, read_metrics, reported_ids

pytestmark = pytest.mark.procs


def _train(out, *args: str, timeout: float = 300):
    proc = run_recover("train", *args, "--out", str(out), "--no-progress", timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, read_metrics(out / "metrics.jsonl")


@pytest.mark.parametrize("replicas", [2, 3])
def test_hsdp_failure_free_equals_plain_data_parallel(tmp_path, replicas):
    common = ["--replicas", str(replicas), "--microbatches", str(2 * replicas), "--steps", "3"]
    _, plain = _train(tmp_path / "plain", "--system", "plain", *common)
    _, hsdp = _train(tmp_path / "hsdp", "--system", "recover", "--shard", "2", *common)
    assert [m["step"] for m in hsdp] == [0, 1, 2]
    for m, ref in zip(hsdp, plain):
        assert m["loss"] == pytest.approx(ref["loss"], rel=1e-4)
        assert reported_ids(m) == iteration_ids(m["step"], 2 * replicas)
    if replicas == 2:  # plain runs the same layout too (recover's failure-free reference at S = 2)
        _, plain_hsdp = _train(tmp_path / "plain_hsdp", "--system", "plain", "--shard", "2", *common)
        for m, ref in zip(plain_hsdp, plain):
            assert m["loss"] == pytest.approx(ref["loss"], rel=1e-4)
    pids = json.loads((tmp_path / "hsdp" / "pids.json").read_text())["replicas"]
    assert all(len(p) == 2 for p in pids.values())  # two processes per replica
    logs = {p.name for p in (tmp_path / "hsdp" / "logs").iterdir()}
    assert {f"replica{r}_rank1.log" for r in range(replicas)} <= logs


@pytest.fixture(scope="module")
def failure_free_3x2_run(tmp_path_factory):
    """The failure-free 3 x S2 run (its directory, its metrics); it checkpoints at step 3, which
    changes nothing of its trajectory (a checkpoint reads the state, never writes it)."""
    out = tmp_path_factory.mktemp("ff") / "run"
    _, metrics = _train(out, "--system", "recover", "--replicas", "3", "--shard", "2", "--microbatches", "6",
                        "--steps", "5", "--checkpoint-every", "3")
    return out, metrics


@pytest.fixture(scope="module")
def failure_free_3x2(failure_free_3x2_run):
    return [m["loss"] for m in failure_free_3x2_run[1]]


@pytest.mark.timeout(200)
def test_a_sharded_replicas_checkpoint_resumes_to_the_failure_free_trajectory(tmp_path, failure_free_3x2_run):
    # Step 3's checkpoint: the lowest member's two ranks each wrote their FSDP2 shards (model
    # and AdamW) with DCP, one file per rank, and .metadata once both were durable. Resuming
    # from it (the run's last complete one) redoes steps 3 and 4: step 3's loss needs the
    # weights back, step 4's also AdamW's moments and the LR schedule.
    src, reference = failure_free_3x2_run
    out = tmp_path / "run"
    shutil.copytree(src, out)
    ckpts = CheckpointDir(out / "checkpoints")
    assert ckpts.complete_steps() == [3]
    assert sorted(p.name for p in ckpts.path(3).iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert [(r["step"], r["writer"]) for r in read_jsonl(out / "checkpoints.jsonl")] == [(3, 0)]
    run_recover("train", "--resume", str(out), "--no-progress", check=True, timeout=150)
    metrics = read_metrics(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(5))
    for m, ref in zip(metrics, reference):
        assert reported_ids(m) == reported_ids(ref) == iteration_ids(m["step"], 6)
        assert m["loss"] == pytest.approx(ref["loss"], rel=1e-5), m["step"]
    [resume] = [e for e in read_jsonl(out / "events.jsonl") if e["kind"] == "resume"]
    assert resume["from_step"] == 3


def test_a_rank_killed_mid_step_takes_its_replica_and_the_others_redo_its_ids(tmp_path, out_dir, failure_free_3x2):
    plan = tmp_path / "plan.json"
    # rank 1 (not the leader) of replica 1, in the backward of its second microbatch of step 2
    plan.write_text(json.dumps({"faults": [
        {"kind": "crash", "replica": 1, "rank": 1, "step": 2, "phase": "backward", "microbatch": 1}]}))
    _train(out_dir, "--system", "recover", "--replicas", "3", "--shard", "2", "--microbatches", "6", "--steps", "5",
           "--faults", str(plan))
    [fired] = assert_every_planned_fault_fired(out_dir)
    pids = json.loads((out_dir / "pids.json").read_text())["replicas"]
    assert fired["pid"] == pids["1"][1]  # the rank itself recorded it, by its own PID
    _, metrics, summary = load_run(out_dir)
    assert [m["step"] for m in metrics] == list(range(5))
    assert all(reported_ids(m) == iteration_ids(m["step"], 6) for m in metrics)  # the ledgers, each id once
    assert [m["members"] for m in metrics] == [[0, 1, 2]] * 2 + [[0, 2]] * 3
    [rec] = [e for e in read_jsonl(out_dir / "events.jsonl") if e["kind"] == "recovery"]
    assert rec["step"] == 2 and rec["survivors"] == [0, 2] and rec["redone"]  # the lost replica's ids, redone
    # the whole replica went: both of its processes, the killed rank first
    gone = {e["pid"]: e for e in summary["processes"] if e["role"] == "worker" and e["replica"] == 1}
    assert gone[pids["1"][0]]["how"] == "killed by SIGKILL", summary["processes"]
    for m, ref in zip(metrics, failure_free_3x2):
        assert m["loss"] == pytest.approx(ref, rel=1e-5)


def test_a_rank_frozen_for_good_takes_its_replica_out_past_the_heartbeat_deadline(tmp_path, out_dir,
                                                                                 failure_free_3x2):
    plan = tmp_path / "plan.json"
    # rank 1 of replica 2 SIGSTOPs itself in step 2; its leader's own heartbeat to the coordinator goes on,
    # so only the rank's silence to its leader (core/parallel/rank_beats.py) can tell
    plan.write_text(json.dumps({"faults": [
        {"kind": "hang", "replica": 2, "rank": 1, "step": 2, "phase": "forward", "microbatch": 0}]}))
    _train(out_dir, "--system", "recover", "--replicas", "3", "--shard", "2", "--microbatches", "6", "--steps", "5",
           "--heartbeat-timeout", "2", "--faults", str(plan))
    [fired] = assert_every_planned_fault_fired(out_dir)
    _, metrics, summary = load_run(out_dir)
    assert [m["step"] for m in metrics] == list(range(5))
    assert all(reported_ids(m) == iteration_ids(m["step"], 6) for m in metrics)
    assert [m["members"] for m in metrics] == [[0, 1, 2]] * 2 + [[0, 1]] * 3
    [rec] = [e for e in read_jsonl(out_dir / "events.jsonl") if e["kind"] == "recovery"]
    assert rec["step"] == 2 and rec["survivors"] == [0, 1]
    # not before the deadline: 2 s of silence, counted from the rank's last beat (up to one
    # interval, 0.1 s, before the fault fired; 0.5 s of room for the two clocks' reads)
    assert rec["detected_at"] - fired["wall_time"] >= 2 - 0.5
    log = (out_dir / "logs" / "replica2.log").read_text()
    assert "rank 1 silent for" in log, log
    for m, ref in zip(metrics, failure_free_3x2):
        assert m["loss"] == pytest.approx(ref, rel=1e-5)


def test_replica_loss_takes_every_rank_of_the_replica(tmp_path, out_dir, failure_free_3x2):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"faults": [
        {"kind": "replica_loss", "replica": 0, "step": 1, "phase": "forward", "microbatch": 1}]}))
    _train(out_dir, "--system", "recover", "--replicas", "3", "--shard", "2", "--microbatches", "6", "--steps", "5",
           "--faults", str(plan))
    assert_every_planned_fault_fired(out_dir)
    _, metrics, summary = load_run(out_dir)
    assert [m["members"] for m in metrics] == [[0, 1, 2]] + [[1, 2]] * 4  # replica 0, the first writer, is gone
    assert all(reported_ids(m) == iteration_ids(m["step"], 6) for m in metrics)
    pids = json.loads((out_dir / "pids.json").read_text())["replicas"]["0"]
    assert not any(pid_alive(p) for p in pids)  # both of its ranks
    for m, ref in zip(metrics, failure_free_3x2):
        assert m["loss"] == pytest.approx(ref, rel=1e-5)


@pytest.mark.parametrize("first,second", [("backward", "vote"), ("commit", "optimizer_step")])
def test_stalled_non_leader_ranks_take_their_replicas_out_by_the_progress_rule(tmp_path, out_dir, failure_free_3x2,
                                                                              first, second):
    # Rank 1 (not the leader) of replica 1 blocks for good at one phase of step 1, and rank 1 of
    # replica 2 at another of step 3 (heartbeats and its beats to its leader on, its training
    # thread stuck): each leader then waits on its rank in a collective of the replica (the
    # relay, or the next step's all-gathers) and never says ready. Nothing but the leader's own
    # stalled progress tells the coordinator.
    plan = tmp_path / "plan.json"
    faults = [{"kind": "stall", "replica": 1, "rank": 1, "step": 1, "phase": first},
              {"kind": "stall", "replica": 2, "rank": 1, "step": 3, "phase": second}]
    for f in faults:
        if f["phase"] in ("forward", "backward"):
            f["microbatch"] = 0
    plan.write_text(json.dumps({"faults": faults}))
    _train(out_dir, "--system", "recover", "--replicas", "3", "--shard", "2", "--microbatches", "6", "--steps", "5",
           "--collective-timeout", "2", "--faults", str(plan))
    _, metrics, _ = load_run(out_dir)
    assert [m["step"] for m in metrics] == list(range(5))
    assert all(reported_ids(m) == iteration_ids(m["step"], 6) for m in metrics)  # the workers' ledgers
    assert metrics[-1]["members"] == [0]
    assert_every_planned_fault_fired(out_dir)
    recoveries = [e for e in read_jsonl(out_dir / "events.jsonl") if e["kind"] == "recovery"]
    assert [e["fault"].split(":")[0] for e in recoveries] == ["replica 1 lost", "replica 2 lost"], recoveries
    assert all("no progress for" in e["fault"] for e in recoveries), recoveries
    for m, ref in zip(metrics, failure_free_3x2):
        assert m["loss"] == pytest.approx(ref, rel=1e-5)


def test_a_bit_flipped_in_a_followers_shard_gets_its_replica_fenced_by_the_vote_digest(tmp_path, out_dir,
                                                                                      failure_free_3x2):
    # Silent data corruption at rank 1 (not the leader) of replica 1, after step 1's optimizer step.
    # The vote's fingerprint sums every rank's shard, so replica 1's step-2 vote is off the majority:
    # it is fenced there, its ids redone, and the run stays on the failure-free trajectory.
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"faults": [
        {"kind": "bitflip", "replica": 1, "rank": 1, "step": 1, "phase": "optimizer_step"}]}))
    _train(out_dir, "--system", "recover", "--replicas", "3", "--shard", "2", "--microbatches", "6", "--steps", "5",
           "--faults", str(plan))
    [fired] = assert_every_planned_fault_fired(out_dir)
    pids = json.loads((out_dir / "pids.json").read_text())["replicas"]
    assert fired["pid"] == pids["1"][1]  # the follower itself flipped it
    assert "bitflip (fault 0) at step 1: bit 22" in (out_dir / "logs" / "replica1_rank1.log").read_text()
    _, metrics, summary = load_run(out_dir)
    assert [m["step"] for m in metrics] == list(range(5))
    assert all(reported_ids(m) == iteration_ids(m["step"], 6) for m in metrics)  # the ledgers, each id once
    assert [m["members"] for m in metrics] == [[0, 1, 2]] * 2 + [[0, 2]] * 3
    events = read_jsonl(out_dir / "events.jsonl")
    [fenced] = [e for e in events if e["kind"] == "fenced"]
    assert (fenced["replica"], fenced["step"]) == (1, 2), fenced
    assert fenced["weights_digest"] != fenced["majority_digest"]
    [rec] = [e for e in events if e["kind"] == "recovery"]
    assert rec["step"] == 2 and "replica 1 lost: fenced: weights digest" in rec["fault"] and rec["redone"], rec
    exits = {e["pid"]: e for e in summary["processes"] if e["role"] == "worker"}
    assert exits[pids["1"][0]]["returncode"] == 3  # its leader was told: fenced
    for m, ref in zip(metrics, failure_free_3x2):
        assert m["loss"] == pytest.approx(ref, rel=1e-5)
