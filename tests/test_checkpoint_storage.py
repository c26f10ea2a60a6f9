"""A storage error is an event, not the end of the job replica by replica.

The checkpoint directory is a real tmpfs of 2 MiB: the first checkpoint (~1.6 MiB)
fits, every later one fills it (ENOSPC, or a short write). What is shown, with real processes:
- each failed save is a line of checkpoints.jsonl (its step and the error) and
  training goes on with every replica (no recovery: nobody was lost);
- after --checkpoint-failures (3) in a row the run stops: exit 1, the writer's
  exit code 6, and a reason naming the error and the last complete checkpoint;
- nothing committed is lost: metrics.jsonl holds every step committed before the
  stop, and the checkpoint the reason names resumes the run to its end once the
  storage has room again (the tmpfs grown in place).
Mounting needs root (CI runs as root); elsewhere the test is skipped.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from conftest import load_run, run_recover

from recover.core.storage.checkpoint_dir import CheckpointDir
from recover.core.storage.results import read_jsonl

pytestmark = [pytest.mark.procs, pytest.mark.timeout(300)]

STEPS = 12


@pytest.fixture
def small_tmpfs(tmp_path):
    where = tmp_path / "ckpts"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(where)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_full_disk_is_recorded_training_goes_on_and_the_run_stops_after_three(small_tmpfs, tmp_path):
    out = tmp_path / "run"
    proc = run_recover("train", "--system", "recover", "--replicas", "3", "--microbatches", "6", "--steps",
                       str(STEPS), "--seed", "3", "--no-progress", "--out", str(out), "--checkpoint-every", "2",
                       "--checkpoint-dir", str(small_tmpfs), timeout=200)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    _, metrics, summary = load_run(out)
    saves = read_jsonl(out / "checkpoints.jsonl")
    ckpts = CheckpointDir(small_tmpfs)
    assert ckpts.complete_steps() == [2]
    assert [s["step"] for s in saves] == [2, 4, 6, 8]
    assert "path" in saves[0] and not saves[0].get("failed")
    for n, s in enumerate(saves[1:], 1):
        # the error is the storage's: ENOSPC, or torch's own "unexpected pos" for a short write
        assert s["failed"] and s["in_a_row"] == n and s["error"], s
    assert saves[-1]["stops_run"] and not saves[-2].get("stops_run")
    assert summary["status"] == "failed" and summary["returncode"] == 1
    assert "3 checkpoint saves in a row failed" in summary["reason"]
    assert saves[-1]["error"] in summary["reason"] and str(ckpts.path(2)) in summary["reason"]
    workers = {p["replica"]: p for p in summary["processes"] if p["role"] == "worker"}
    assert workers[0]["returncode"] == 6  # the writer; the launcher then ended the others
    # training went on through the failures, with every replica: no one was lost
    assert not [e for e in read_jsonl(out / "events.jsonl") if e["kind"] == "recovery"]
    assert [m["step"] for m in metrics] == list(range(len(metrics))) and len(metrics) >= 9
    assert not list(small_tmpfs.glob(".tmp-*"))  # failed saves leave nothing behind

    # room again: the named checkpoint resumes the run to its end
    subprocess.run(["mount", "-o", "remount,size=16m", str(small_tmpfs)], check=True)
    run_recover("train", "--resume", str(out), "--no-progress", check=True, timeout=200)
    _, metrics, summary = load_run(out)
    assert summary["status"] == "ok" and [m["step"] for m in metrics] == list(range(STEPS))
