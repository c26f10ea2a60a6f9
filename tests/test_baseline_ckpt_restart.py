"""Checkpoint-and-restart baseline: real DCP checkpoints, real SIGKILLs, whole-job restarts.

What is shown, each by a real fault (the fault-injection harness's in-worker
SIGKILL, or a SIGKILL sent by PID from the test):
- a crash restarts the job from exactly the last complete checkpoint's step, and
  the final weights equal a failure-free run's (bit for bit when a replacement
  keeps the group's size; to summation order with the survivors only);
- a crash in the middle of a checkpoint save (sync and async) leaves the previous
  checkpoint as the one loaded;
- a replica frozen for good (SIGSTOP) is caught by the survivors' collective
  timeout, blamed, and left out of the restarted job;
- metrics.jsonl holds every step once; events.jsonl records each restart;
- no survivor left ends the run with a clear reason and a non-zero exit.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import assert_every_planned_fault_fired, load_run, pid_alive, run_recover

from recover.core.config.train_config import TrainConfig
from recover.core.components.data import iteration_ids
from recover.core.storage.results import read_jsonl, step_ids

pytestmark = [pytest.mark.procs, pytest.mark.timeout(240)]  # every test here starts processes

# Fewer replicas only change the all-reduce's summation order: measured relative
# differences of ~1e-9 in the weights' checksum and ~1e-7 in losses over 6 steps.
RTOL = 1e-5

BASE = ["--replicas", "2", "--microbatches", "4", "--steps", "6", "--no-progress", "--seed", "3"]


def _train(out: Path, *flags: str, system: str = "ckpt-restart", check: bool = True):
    # plain writes no checkpoints (and says so when given --checkpoint-every)
    every = [] if system == "plain" else ["--checkpoint-every", "2"]
    return run_recover("train", "--system", system, *BASE, *every, "--out", str(out), *flags, check=check,
                       timeout=150)


def _plan(tmp_path: Path, *faults: dict) -> str:
    p = tmp_path / f"plan{len(list(tmp_path.glob('plan*')))}.json"
    p.write_text(json.dumps({"faults": list(faults)}))
    return str(p)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """A failure-free checkpoint-restart run and a plain run of the same workload."""
    root = tmp_path_factory.mktemp("ref")
    _train(root / "ckpt")
    _train(root / "plain", system="plain")
    _, metrics, summary = load_run(root / "ckpt")
    _, plain, _ = load_run(root / "plain")
    return {"losses": [m["loss"] for m in metrics], "plain": [m["loss"] for m in plain],
            "checksum": summary["weights_checksum"]}


def test_failure_free_run_is_the_plain_trajectory_and_checkpoints(reference, tmp_path):
    # The same workload code: same losses as --system plain, step by step.
    assert reference["losses"] == reference["plain"]
    assert reference["checksum"] is not None


def _steps_once(metrics: list[dict]) -> None:
    assert [m["step"] for m in metrics] == list(range(6))
    for m in metrics:
        assert step_ids(m) == iteration_ids(m["step"], 4)  # the global batch M is kept


def test_crash_with_replacement_resumes_at_the_checkpoint_and_ends_with_identical_weights(reference, tmp_path):
    out = tmp_path / "run"
    plan = _plan(tmp_path, {"kind": "crash", "replica": 1, "step": 3, "phase": "backward"})
    _train(out, "--faults", plan, "--restart-mode", "replace", "--replace-after", "0.2")
    assert_every_planned_fault_fired(out)
    config, metrics, summary = load_run(out)
    assert config["baseline"]["restart_mode"] == "replace" and config["baseline"]["ckpt_every"] == 2
    _steps_once(metrics)
    (event,) = read_jsonl(out / "events.jsonl")
    assert event["kind"] == "restart" and event["failed_replicas"] == [1]
    assert event["from_step"] == 2 and event["furthest_step"] == 3  # checkpoint of step 2; crash in step 3
    assert event["work_lost_steps"] == 1  # step 2 was committed, then redone
    assert 4 < event["work_lost_microbatches"] <= 8  # all of step 2, part of step 3
    assert event["detected_at"] <= event["relaunched_at"] <= event["started_at"] <= event["resumed_at"]
    assert event["relaunched_at"] - event["detected_at"] >= 0.2  # the replacement wait
    # Steps before the checkpoint are the first attempt's; from it on, the second's.
    assert [m["generation"] for m in metrics] == [0, 0, 1, 1, 1, 1]
    assert all(m["members"] == [0, 1] for m in metrics)
    # Same group size, same data, same order: bit-identical to the failure-free run.
    assert summary["weights_checksum"] == reference["checksum"]
    assert [m["loss"] for m in metrics] == reference["losses"]
    assert summary["restarts"] == 1 and summary["status"] == "ok"
    # the schedule state came back with the checkpoint: every step, redone or not, at its committed step's lr
    schedule = TrainConfig.from_dict(config["train"]).lr_schedule()
    assert [m["lr"] for m in metrics] == [schedule(m["step"]) for m in metrics]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_crash_during_checkpoint_save_loads_the_previous_complete_checkpoint(reference, tmp_path, mode):
    out = tmp_path / "run"
    # Checkpoints are taken after steps 1 and 3; the second save is killed midway
    # (this rank's data files written, the checkpoint not yet complete).
    plan = _plan(tmp_path, {"kind": "crash", "replica": 1, "step": 3, "phase": "checkpoint_save"})
    flags = ["--checkpoint-async"] if mode == "async" else ["--no-checkpoint-async"]
    _train(out, "--faults", plan, "--restart-mode", "replace", *flags)
    config, metrics, summary = load_run(out)
    assert config["baseline"]["ckpt_async"] is (mode == "async")
    (fault,) = assert_every_planned_fault_fired(out)
    assert fault["phase"] == "checkpoint_save" and fault["step"] == 3
    (event,) = read_jsonl(out / "events.jsonl")
    assert event["from_step"] == 2  # not 4: the killed save was never loaded
    # Sync: steps 2 and 3 are lost. Async: training went on while the background
    # save ran, so later steps may have committed too before the kill: how many
    # depends on how fast the write went (under load, steps 4 and 5 did), never
    # more than the steps begun since the checkpoint.
    if mode == "sync":
        assert event["work_lost_steps"] == 2, event
    else:
        assert 2 <= event["work_lost_steps"] <= event["furthest_step"] - event["from_step"] + 1, event
    _steps_once(metrics)
    assert summary["weights_checksum"] == reference["checksum"]
    # The restarted attempt wrote the checkpoint of step 4 again, completely.
    ckpts = sorted(p.name for p in (out / "baseline" / "checkpoints").iterdir())
    assert ckpts == ["step-00000002", "step-00000004"]


def test_survivors_keep_the_global_batch_and_the_trajectory(reference, tmp_path):
    out = tmp_path / "run"
    plan = _plan(tmp_path, {"kind": "crash", "replica": 0, "step": 4, "phase": "allreduce"})
    _train(out, "--faults", plan)  # survivors mode is the default
    assert_every_planned_fault_fired(out)
    _, metrics, summary = load_run(out)
    _steps_once(metrics)
    (event,) = read_jsonl(out / "events.jsonl")
    assert event["failed_replicas"] == [0] and event["members"] == [1] and event["from_step"] == 4
    assert [m["members"] for m in metrics] == [[0, 1]] * 4 + [[1]] * 2
    for a, b in zip([m["loss"] for m in metrics], reference["losses"]):
        assert abs(a - b) <= RTOL * abs(b)
    assert abs(summary["weights_checksum"] - reference["checksum"]) <= RTOL * abs(reference["checksum"])


def test_a_frozen_replica_is_caught_by_the_collective_timeout_and_left_out(reference, tmp_path):
    out = tmp_path / "run"
    # Frozen for good (SIGSTOP, no end): only the survivor's collective timeout sees it.
    plan = _plan(tmp_path, {"kind": "hang", "replica": 1, "step": 2, "phase": "allreduce"})
    _train(out, "--faults", plan, "--collective-timeout", "3")
    assert_every_planned_fault_fired(out)
    _, metrics, summary = load_run(out)
    _steps_once(metrics)
    (event,) = read_jsonl(out / "events.jsonl")
    assert event["failed_replicas"] == [1] and event["members"] == [0] and event["from_step"] == 2
    assert "replica 0" in event["fault"]  # the survivor's timeout ended the attempt; the frozen one is blamed
    assert [m["members"] for m in metrics] == [[0, 1]] * 2 + [[0]] * 4
    assert abs(summary["weights_checksum"] - reference["checksum"]) <= RTOL * abs(reference["checksum"])
    frozen = [p for p in summary["processes"] if p["replica"] == 1 and p["role"] == "worker"]
    assert frozen and frozen[0]["returncode"] < 0  # killed by the teardown, never ran on


def test_sigkill_by_pid_restarts_from_the_checkpoint_and_leaves_no_orphan(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "recover.experiments.cli", "train", "--system", "ckpt-restart",
           # --ckpt-every: the old flag, kept as a hidden alias of --checkpoint-every
           "--replicas", "2", "--microbatches", "4", "--steps", "18", "--ckpt-every", "3", "--no-progress",
           "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "baseline" / "checkpoints" / "step-00000003").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        first = json.loads((out / "pids.json").read_text())
        victim = first["replicas"]["1"][0]
        os.kill(victim, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=180)
        assert proc.returncode == 0, stdout + stderr
        _, metrics, summary = load_run(out)
        assert [m["step"] for m in metrics] == list(range(18))
        (event,) = read_jsonl(out / "events.jsonl")
        assert event["failed_replicas"] == [1] and event["members"] == [0]
        assert event["from_step"] >= 3 and event["from_step"] % 3 == 0
        assert f"replica 1 (pid {victim}) killed by SIGKILL" in event["fault"]
        # The first attempt's processes are all gone, and so are the second's.
        second = json.loads((out / "pids.json").read_text())
        for pids in (first, second):
            every = [pids["coordinator"], *(p for ps in pids["replicas"].values() for p in ps)]
            assert not [p for p in every if pid_alive(p)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_no_survivor_left_ends_with_a_clear_error(tmp_path):
    out = tmp_path / "run"
    plan = _plan(tmp_path, {"kind": "crash", "replica": 1, "step": 1, "phase": "forward"},
                 {"kind": "crash", "replica": 0, "step": 3, "phase": "forward"})
    proc = _train(out, "--faults", plan, check=False)
    assert proc.returncode == 1
    assert "no replica left to restart with" in proc.stdout
    assert_every_planned_fault_fired(out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and "no replica left" in summary["reason"]
    kinds = [e["kind"] for e in read_jsonl(out / "events.jsonl")]
    assert kinds == ["restart", "abort"]


def test_a_bad_baseline_setting_fails_at_once_naming_the_flag(tmp_path):
    proc = run_recover("train", "--system", "ckpt-restart", "--restart-mode", "pray", "--out",
                       str(tmp_path / "never"), timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--restart-mode" in lines[0]
    assert not (tmp_path / "never").exists()
