"""Checkpoints of replicas split into pipeline stages: `recover train --pp 2 --checkpoint-every K`, real processes.

Each stage rank writes its own shard of one DCP checkpoint, its blocks under the whole
model's names (the second stage's block 0 is the model's "blocks.1"), the first stage the
embeddings, the last the final norm and its copy of the tied weight as "head.weight", with
AdamW's state under the same names. A checkpoint is complete only when every stage's shard
is; `--resume` from one continues the failure-free trajectory (under --exact bit for bit,
losses and every stage's final shard), also at one stage per replica. Evidence from what the workers
wrote: the checkpoint's files and DCP metadata, checkpoints.jsonl, metrics.jsonl, faults.jsonl.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch.distributed.checkpoint as dcp

from conftest import assert_every_planned_fault_fired, load_run, run_recover, train_metrics

from recover.core.components.data import iteration_ids
from recover.core.storage.checkpoint_dir import CheckpointDir
from recover.core.storage.results import read_jsonl, read_metrics, reported_ids

pytestmark = pytest.mark.procs

STEPS, M = 4, 4
LAYOUT = ["--system", "recover", "--replicas", "2", "--pp", "2"]


@pytest.fixture(scope="module")
def failure_free(tmp_path_factory):
    """2 x PP2 under --exact, failure-free, checkpointing the state before step 2 (reading state
    changes no step). --exact: a resumed run must then give its losses and final shards bit for bit."""
    out = tmp_path_factory.mktemp("pp_ckpt") / "run"
    return out, train_metrics(out, *LAYOUT, "--exact", "--checkpoint-every", "2", steps=STEPS, microbatches=M)


def _same_trajectory(metrics: list[dict], reference: list[dict], rel: float = 1e-5) -> None:
    assert [m["step"] for m in metrics] == list(range(STEPS))
    for m, ref in zip(metrics, reference):
        assert reported_ids(m) == iteration_ids(m["step"], M)
        assert m["loss"] == pytest.approx(ref["loss"], rel=rel, abs=0), m["step"]


@pytest.mark.timeout(240)
def test_every_stage_writes_its_shard_under_global_names_and_resume_continues_the_trajectory(tmp_path,
                                                                                            failure_free):
    src, reference = failure_free
    out = tmp_path / "run"
    shutil.copytree(src, out)
    ckpts = CheckpointDir(out / "checkpoints")
    assert ckpts.complete_steps() == [2]
    # one data file per stage rank, and the metadata DCP writes once both are durable
    assert sorted(p.name for p in ckpts.path(2).iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert [(r["step"], r["writer"]) for r in read_jsonl(out / "checkpoints.jsonl")] == [(2, 0)]
    keys = set(dcp.FileSystemReader(str(ckpts.path(2))).read_metadata().state_dict_metadata)
    # the tiny model's two blocks, one per stage, each under its own index (no stage's "blocks.0" lost)
    for layer in (0, 1):
        assert f"model.blocks.{layer}.attn.qkv.weight" in keys
        assert f"optim.state.blocks.{layer}.attn.qkv.weight.exp_avg" in keys
    assert not any(k.startswith("model.blocks.2") for k in keys)
    # the tied weight's two copies: the first stage's embedding and the last stage's head, each with AdamW state
    for name in ("tok_emb.weight", "head.weight"):
        assert f"model.{name}" in keys and f"optim.state.{name}.exp_avg_sq" in keys

    run_recover("train", "--resume", str(out), "--no-progress", check=True, timeout=200)
    # steps 2 and 3 redone from the checkpoint: step 2's loss needs the weights of both stages
    # back, step 3's also their AdamW moments and the LR schedule
    _same_trajectory(read_metrics(out / "metrics.jsonl"), reference, rel=0)  # bit for bit (--exact)
    [resume] = [e for e in read_jsonl(out / "events.jsonl") if e["kind"] == "resume"]
    assert resume["from_step"] == 2
    for r in range(2):  # every stage's final shard, as each rank reported its digest
        final, ref = (json.loads((d / "final" / f"replica{r}.json").read_text()) for d in (out, src))
        assert final["shard_digests"] == ref["shard_digests"] and len(final["shard_digests"]) == 2


@pytest.mark.timeout(240)
def test_a_stage_killed_mid_save_leaves_no_checkpoint_that_resume_would_take(tmp_path, failure_free):
    out = tmp_path / "run"
    plan = tmp_path / "plan.json"
    # replica 0 writes (the lowest member); its last stage (rank 1) is SIGKILLed by its own PID
    # after writing its data of step 2's checkpoint, before the checkpoint is complete
    plan.write_text(json.dumps({"faults": [
        {"kind": "crash", "replica": 0, "rank": 1, "step": 1, "phase": "checkpoint_save"}]}))
    metrics = train_metrics(out, *LAYOUT, "--checkpoint-every", "1", "--faults", str(plan), steps=STEPS,
                            microbatches=M)
    [fired] = assert_every_planned_fault_fired(out)
    assert fired["pid"] == json.loads((out / "pids.json").read_text())["replicas"]["0"][1]
    ckpts = CheckpointDir(out / "checkpoints")
    partial = ckpts.tmp_path(2)
    assert list(partial.glob("*.distcp")) and not (partial / ".metadata").exists()  # really half-written
    # what --resume takes (experiments/run.py: the latest complete step) is never step 2's. Step 3's is
    # there when the kill was seen before step 2 committed (then the survivor, replica 1, is the lowest
    # member and writes it); when the dying stage had already sent its part of step 2, step 2's committing
    # generation still held replica 0, its writer, now gone, and nobody writes step 3's (either is right)
    complete = ckpts.complete_steps()
    assert complete in ([1], [1, 3]) and ckpts.latest() == complete[-1]
    lines = read_jsonl(out / "checkpoints.jsonl")
    assert [(r["step"], r["writer"]) for r in lines if not r.get("failed")] == [(1, 0), (3, 1)][:len(complete)]
    # replica 0's stage 0 may also see its save fail (its peer's connection closed) before its
    # replica is taken out: a failed save, recorded as one, its temp dir never renamed
    assert all(r["writer"] == 0 and r["step"] >= 2 for r in lines if r.get("failed"))
    for step in complete:  # each complete one holds both stages' shards
        assert sorted(p.name for p in ckpts.path(step).iterdir()) == [".metadata", "__0_0.distcp",
                                                                      "__1_0.distcp"]
    # and the survivor redid the dead replica's ids: the failure-free trajectory
    _same_trajectory(metrics, failure_free[1])
    _, _, summary = load_run(out)
    assert summary["status"] == "ok"


@pytest.mark.timeout(120)
def test_a_pp2_checkpoint_resumes_at_one_stage_per_replica(tmp_path, failure_free):
    # DCP loads by key: with the whole model's names, the whole model of a one-rank replica finds
    # both stages' parts (the tied weight's AdamW state under "tok_emb.weight", as it lists it)
    src, reference = failure_free
    out = tmp_path / "run"
    shutil.copytree(src, out)
    run_recover("train", "--resume", str(out), "--pp", "1", "--no-progress", check=True, timeout=100)
    assert json.loads((out / "config.json").read_text())["train"]["pp"] == 1
    pids = json.loads((out / "pids.json").read_text())["replicas"]
    assert all(len(p) == 1 for p in pids.values())  # one process per replica: the whole model
    _same_trajectory(read_metrics(out / "metrics.jsonl"), reference)
    assert [e["from_step"] for e in read_jsonl(out / "events.jsonl") if e["kind"] == "resume"] == [2]
