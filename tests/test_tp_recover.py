"""Tensor parallelism inside a replica under recover (first slice): `recover train --tp T`.

Each replica is S x T processes: torch's DTensor TP splits every block's heads and MLP
over the "tp" ranks (core/parallel/tp.py), FSDP2 shards over "shard" when S > 1, and
the ranks at one position of every replica all-reduce their local parts. A rank
SIGKILLed mid-step takes its whole replica out; the survivors redo its ids. Evidence
from the workers' own reports: metrics.jsonl (losses, ledgers), faults.jsonl, pids.json.
A checkpoint of a TP replica holds both tp ranks' parts, and `--resume` from it continues
the failure-free trajectory.
"""
from __future__ import annotations

import json
import shutil

import pytest

from conftest import (assert_every_planned_fault_fired, assert_plain_is_the_reference, load_run, run_recover,
                      train_metrics)

from recover.core.components.data import iteration_ids
from recover.core.storage.checkpoint_dir import CheckpointDir
from recover.core.storage.results import read_jsonl, read_metrics, reported_ids

pytestmark = pytest.mark.procs

STEPS, M = 5, 4


def _train(out, *args: str, timeout: float = 300):
    return train_metrics(out, *args, steps=STEPS, microbatches=M, timeout=timeout)


@pytest.fixture(scope="module")
def plain_2(tmp_path_factory):
    """Plain data parallel, 2 replicas of one rank (S = T = 1): the reference."""
    out = tmp_path_factory.mktemp("plain") / "run"
    return out, _train(out, "--system", "plain", "--replicas", "2")


@pytest.fixture(scope="module")
def tp_2x2(tmp_path_factory):
    """2 x TP2, failure-free; its checkpoint at step 3 reads the state only (the trajectory is unchanged)."""
    out = tmp_path_factory.mktemp("tp") / "run"
    return out, _train(out, "--system", "recover", "--replicas", "2", "--tp", "2", "--checkpoint-every", "3")


@pytest.mark.timeout(200)
def test_a_tp_replicas_checkpoint_resumes_to_the_failure_free_trajectory(tmp_path, tp_2x2):
    # both tp ranks of the writer saved their halves of each block (weights and AdamW) with DCP;
    # resuming from step 3 redoes steps 3 and 4 (step 4 needs the moments and the schedule too)
    src, reference = tp_2x2
    out = tmp_path / "run"
    shutil.copytree(src, out)
    ckpts = CheckpointDir(out / "checkpoints")
    assert ckpts.complete_steps() == [3]
    assert sorted(p.name for p in ckpts.path(3).iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    run_recover("train", "--resume", str(out), "--no-progress", check=True, timeout=150)
    metrics = read_metrics(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(STEPS))
    for m, ref in zip(metrics, reference):
        assert reported_ids(m) == reported_ids(ref) == iteration_ids(m["step"], M)
        assert m["loss"] == pytest.approx(ref["loss"], rel=1e-5), m["step"]


def test_two_replicas_of_tp2_equal_plain_data_parallel(tp_2x2, plain_2):
    out, metrics = tp_2x2
    assert [m["step"] for m in metrics] == list(range(STEPS))
    for m, ref in zip(metrics, plain_2[1]):
        assert m["loss"] == pytest.approx(ref["loss"], rel=1e-4)
        assert reported_ids(m) == iteration_ids(m["step"], M)
    pids = json.loads((out / "pids.json").read_text())["replicas"]
    assert all(len(p) == 2 for p in pids.values())  # two processes per replica: T = 2
    # the final weights: each replica's checksum counts every part once (the replicated ones on tp index 0)
    ref = json.loads((plain_2[0] / "final" / "replica0.json").read_text())["weights_checksum"]
    for r in range(2):
        final = json.loads((out / "final" / f"replica{r}.json").read_text())
        assert final["weights_checksum"] == pytest.approx(ref, rel=1e-6)


def test_a_non_leader_tp_rank_killed_mid_step_takes_its_replica_and_the_survivor_redoes_its_ids(
        tmp_path, out_dir, tp_2x2):
    plan = tmp_path / "plan.json"
    # rank 1 (tp index 1, not the leader) of replica 1, in the backward of its second microbatch of step 2
    plan.write_text(json.dumps({"faults": [
        {"kind": "crash", "replica": 1, "rank": 1, "step": 2, "phase": "backward", "microbatch": 1}]}))
    _train(out_dir, "--system", "recover", "--replicas", "2", "--tp", "2", "--faults", str(plan))
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
    for m, ref in zip(metrics, tp_2x2[1]):
        assert m["loss"] == pytest.approx(ref["loss"], rel=1e-5)


def test_two_replicas_of_shard2_x_tp2_equal_plain_data_parallel(tmp_path, plain_2):
    # 8 processes: each replica a 2 x 2 grid (FSDP2 over "shard", TP over "tp")
    metrics = _train(tmp_path / "run", "--system", "recover", "--replicas", "2", "--shard", "2", "--tp", "2",
                     timeout=400)
    assert [m["step"] for m in metrics] == list(range(STEPS))
    for m, ref in zip(metrics, plain_2[1]):
        assert m["loss"] == pytest.approx(ref["loss"], rel=1e-4)
        assert reported_ids(m) == iteration_ids(m["step"], M)


def test_plain_at_2_x_tp2_is_recovers_failure_free_trajectory(tmp_path, tp_2x2):
    # plain builds the same TP2 partition from core/parallel/ and deals each replica the same
    # ids, so it is recover's failure-free reference at this very layout, not at one rank per replica
    out = tmp_path / "run"
    metrics = _train(out, "--system", "plain", "--replicas", "2", "--tp", "2")
    assert_plain_is_the_reference(out, metrics, tp_2x2, STEPS, M, ranks_per_replica=2)
