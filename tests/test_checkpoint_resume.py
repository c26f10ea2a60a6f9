"""recover's checkpoints and `recover train --resume`: real processes, real SIGKILLs.

What is shown:
- the whole job SIGKILLed by PID (launcher, coordinator, every worker) after a
  checkpoint, then `--resume DIR`: metrics.jsonl holds every step once, and the
  trajectory (same microbatch ids per step, loss to 1e-5 relative) and the final
  weights equal an uninterrupted run's;
- the checkpoint writer SIGKILLed in the middle of a save (a planned fault at the
  checkpoint_save point) leaves a temp dir that is never loaded; when the last
  replica dies too, the last line names the last complete checkpoint and the
  command that resumes from it, and that command continues the run from there;
- bad input (--checkpoint-every 0 or negative, --resume of a directory with no
  complete checkpoint) is one line naming the flag, exit 2, nothing started.
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import assert_every_planned_fault_fired, load_run, pid_alive, run_recover

from recover.core.storage.checkpoint_dir import CheckpointDir
from recover.core.storage.results import read_jsonl, read_metrics, step_ids

pytestmark = [pytest.mark.procs, pytest.mark.timeout(300)]

RTOL = 1e-5  # a generation of one replica sums the gradient in another order than two
STEPS = 6
BASE = ["--system", "recover", "--replicas", "2", "--microbatches", "4", "--steps", str(STEPS), "--seed", "3",
        "--no-progress"]


def _train(out: Path, *flags: str, check: bool = True) -> subprocess.CompletedProcess:
    return run_recover("train", *BASE, "--out", str(out), *flags, check=check, timeout=150)


def _resume(out: Path) -> subprocess.CompletedProcess:
    return run_recover("train", "--resume", str(out), "--no-progress", check=True, timeout=150)


def _plan(tmp_path: Path, *faults: dict) -> str:
    p = tmp_path / "plan.json"
    p.write_text(json.dumps({"faults": list(faults)}))
    return str(p)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """An uninterrupted run of the same workload, without checkpoints."""
    out = tmp_path_factory.mktemp("ref") / "run"
    _train(out)
    _, metrics, summary = load_run(out)
    return {"metrics": metrics, "checksum": summary["weights_checksum"]}


def _assert_same_trajectory(metrics: list[dict], reference: dict) -> None:
    assert [m["step"] for m in metrics] == list(range(STEPS))  # no gap, no duplicate
    for m, r in zip(metrics, reference["metrics"]):
        assert step_ids(m) == step_ids(r)
        assert m["loss"] == pytest.approx(r["loss"], rel=RTOL), m["step"]


def test_whole_job_killed_by_pid_resumes_from_its_last_checkpoint_with_the_same_trajectory(reference, tmp_path):
    out = tmp_path / "run"
    # Replica 1 crawls from step 4 on (each microbatch >= 60 s), so the job is surely
    # still running, its step-4 checkpoint written, when the test kills it.
    plan = _plan(tmp_path, {"kind": "pace", "replica": 1, "step": 4, "phase": "forward", "seconds": 60})
    cmd = [sys.executable, "-m", "recover.experiments.cli", "train", *BASE, "--out", str(out),
           "--checkpoint-every", "2", "--faults", plan, "--collective-timeout", "120"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    ckpts = CheckpointDir(out / "checkpoints")
    pids: dict = {}
    try:
        deadline = time.monotonic() + 150
        while not (ckpts.latest() == 4 and (out / "faults.jsonl").exists()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        assert_every_planned_fault_fired(out)
        pids = json.loads((out / "pids.json").read_text())
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher, then every process it started
        for pid in [pids["coordinator"], *(p for ps in pids["replicas"].values() for p in ps)]:
            os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert ckpts.complete_steps() == [2, 4]
    killed = read_metrics(out / "metrics.jsonl")
    assert [m["step"] for m in killed] == [0, 1, 2, 3]  # step 4 never committed: replica 1 was crawling

    _resume(out)
    _, metrics, summary = load_run(out)
    _assert_same_trajectory(metrics, reference)
    assert summary["status"] == "ok" and summary["weights_checksum"] == pytest.approx(reference["checksum"], rel=RTOL)
    resumes = [e for e in read_jsonl(out / "events.jsonl") if e["kind"] == "resume"]
    assert resumes == [{"kind": "resume", "from_step": 4, "checkpoint": str(ckpts.path(4)), "dropped_steps": [],
                        "at": 0.0}]
    assert not [p for p in [pids["coordinator"], *(p for ps in pids["replicas"].values() for p in ps)] if pid_alive(p)]


def test_a_save_killed_midway_is_ignored_and_the_last_replicas_death_names_the_resume_command(reference, tmp_path):
    out = tmp_path / "run"
    # Replica 0, the lowest member, writes each checkpoint; it dies after writing the
    # data of step 4's and before it is complete. Replica 1 trains on alone and dies
    # at step 5: no replica is left.
    plan = _plan(tmp_path, {"kind": "crash", "replica": 0, "step": 3, "phase": "checkpoint_save"},
                 {"kind": "crash", "replica": 1, "step": 5, "phase": "forward"})
    proc = _train(out, "--checkpoint-every", "2", "--faults", plan, check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert_every_planned_fault_fired(out)
    ckpts = CheckpointDir(out / "checkpoints")
    partial = ckpts.tmp_path(4)
    assert list(partial.glob("*.distcp")) and not (partial / ".metadata").exists()  # really half-written
    assert ckpts.complete_steps() == [2]
    last = proc.stdout.strip().splitlines()[-1]
    command = f"recover train --resume {shlex.quote(str(out))}"
    assert last == f"last checkpoint: {ckpts.path(2)} (step 2); resume with: {command}"
    summary = json.loads((out / "summary.json").read_text())
    assert "no replica left" in summary["reason"] and summary["resume_command"] == command

    _resume(out)  # the command the message named
    assert not partial.exists()  # a dead save's leftovers are cleared, never loaded
    _, metrics, summary = load_run(out)
    _assert_same_trajectory(metrics, reference)
    assert summary["weights_checksum"] == pytest.approx(reference["checksum"], rel=RTOL)
    (resume,) = [e for e in read_jsonl(out / "events.jsonl") if e["kind"] == "resume"]
    assert resume["from_step"] == 2 and resume["dropped_steps"] == [2, 3, 4]
    # the resumed run's writer (replica 0 again) wrote the checkpoint of step 4 anew
    assert [r["step"] for r in read_jsonl(out / "checkpoints.jsonl")] == [2, 4]


@pytest.mark.parametrize("flags, field", [
    (["--checkpoint-every", "0"], "--checkpoint-every"),
    (["--checkpoint-every", "-2"], "--checkpoint-every"),
])
def test_a_bad_checkpoint_interval_fails_at_once_naming_the_flag(tmp_path, flags, field):
    proc = run_recover("train", *BASE, "--out", str(tmp_path / "never"), *flags, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"recover: error: {field}:"), proc.stderr
    assert not (tmp_path / "never").exists()


def test_resume_without_a_complete_checkpoint_fails_at_once_naming_the_flag(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"train": {"system": "recover", "replicas": 2, "microbatches": 4,
                                                           "steps": 6, "out": str(out)}}))
    CheckpointDir(out / "checkpoints").tmp_path(2).mkdir(parents=True)  # a save that never completed
    for target in (out, tmp_path / "not-a-run"):
        proc = run_recover("train", "--resume", str(target), timeout=60)
        assert proc.returncode == 2
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("recover: error: --resume:"), proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "config.json"]  # nothing started


@pytest.mark.parametrize("flags, field", [
    (["--checkpoint-every", "0"], "--checkpoint-every"),
    (["--steps", "4"], "--steps"),  # too few for iterations both with and without a save at K=2
])
def test_a_bad_stall_benchmark_flag_fails_at_once_naming_it(tmp_path, flags, field):
    proc = run_recover("bench", "checkpoint-stall", "--out", str(tmp_path / "never"), *flags, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"recover: error: {field}:"), proc.stderr
    assert not (tmp_path / "never").exists()
