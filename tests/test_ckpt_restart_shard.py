"""Checkpoint-restart at replicas of many ranks: `recover train --system ckpt-restart --shard 2`, real processes.

What is shown: 2 replicas of 2 ranks (recover's rank grid in each, FSDP2 over the
replica's ranks, sharded DCP checkpoints written by every rank of replica 0). Rank 1
of replica 1 (not its replica's rank 0) is SIGKILLed by its PID mid-run; the
supervisor tears the whole job down and restarts it with the survivor, one replica
of 2 ranks, from the last complete checkpoint (every shard of it loaded by the rank
that owns it). Every step is committed once with its failure-free ids (the global
batch kept), and the losses are plain data parallelism's at the same layout (before
the fault to the bit, after it to summation order). Evidence from the workers' own
metrics.jsonl and events.jsonl.
"""
from __future__ import annotations

import json

import pytest

from conftest import load_run, pid_alive, run_recover, run_recover_killing

from recover.core.components.data import iteration_ids
from recover.core.storage.results import read_jsonl, step_ids

pytestmark = [pytest.mark.procs, pytest.mark.timeout(300)]

STEPS, M, EVERY = 8, 4, 2
BASE = ["--shard", "2", "--replicas", "2", "--microbatches", str(M), "--steps", str(STEPS), "--no-progress",
        "--seed", "3"]
# The survivor alone folds the same ids in another summation order: relative differences of
# ~1e-7 in the losses are measured; 1e-5 leaves room and still tells any other batch apart.
RTOL = 1e-5


def test_a_rank_killed_by_pid_restarts_the_job_from_its_sharded_checkpoint_with_the_survivor(tmp_path):
    out = tmp_path / "ckpt"
    proc, victim = run_recover_killing(
        ["train", "--system", "ckpt-restart", *BASE, "--checkpoint-every", str(EVERY), "--out", str(out)],
        out, replica=1, after_commits=3, rank=1, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    _, metrics, summary = load_run(out)
    assert [m["step"] for m in metrics] == list(range(STEPS))  # every step once
    assert all(step_ids(m) == iteration_ids(m["step"], M) for m in metrics)  # the global batch M kept
    (event,) = read_jsonl(out / "events.jsonl")
    assert event["kind"] == "restart" and event["failed_replicas"] == [1] and event["members"] == [0]
    # (the launcher names a replica of many by its rank 0's PID; the victim was its rank 1)
    assert event["fault"].startswith("replica 1 (pid ") and "killed by SIGKILL" in event["fault"]
    assert str(victim) not in event["fault"]
    start = event["from_step"]
    assert start >= 2 and start % EVERY == 0  # a complete checkpoint, taken after the 3 commits began
    assert [m["members"] for m in metrics] == [[0, 1]] * start + [[0]] * (STEPS - start)
    assert [m["generation"] for m in metrics] == [0] * start + [1] * (STEPS - start)
    # sharded: each of replica 0's 2 ranks wrote its own file into every checkpoint
    for ckpt in (out / "baseline" / "checkpoints").iterdir():
        assert sorted(p.name for p in ckpt.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert summary["status"] == "ok" and summary["restarts"] == 1 and summary["weights_checksum"] is not None
    # both attempts' processes are gone (the killed replica's other rank went with it)
    pids = json.loads((out / "pids.json").read_text())
    assert len(pids["replicas"]["0"]) == 2
    assert not [p for p in [pids["coordinator"], *(p for ps in pids["replicas"].values() for p in ps)]
                if pid_alive(p)]
    # plain at the same layout: the same losses (the steps before the checkpoint were the same
    # processes' work in the same order; after the restart, the survivor's sum of the same ids)
    ref = tmp_path / "plain"
    run_recover("train", "--system", "plain", *BASE, "--out", str(ref), check=True, timeout=120)
    _, plain, ref_summary = load_run(ref)
    assert [m["loss"] for m in metrics[:start]] == [m["loss"] for m in plain[:start]]
    for a, b in zip(metrics, plain):
        assert a["loss"] == pytest.approx(b["loss"], rel=RTOL)
