"""torchft baseline (shrink in place): the real torchft lighthouse and Manager, real SIGKILLs.

What is shown:
- a replica killed mid-step (harness SIGKILL): the in-flight step is discarded,
  the survivors go on with fewer participants, every step is committed once, and
  the global batch shrinks to the survivors' shares (torchft's semantics, unlike
  --system recover which keeps M);
- a replica killed after its share of the all-reduce and its commit, before it
  could write the step's metrics line (the lowest replica, which used to be the only
  writer): the survivors committed that step, and its line is there, written once by
  one of them (the cause of "only 29 of 30 steps committed" under load);
- the lowest replica killed by PID from the test at a moment the test does not
  choose: the run completes with every step written once;
- a replica frozen for good (SIGSTOP): the survivors' all-reduce times out, the
  lighthouse drops it, and they go on without it;
- every replica gone: the run ends with a clear reason and a non-zero exit.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import assert_every_planned_fault_fired, load_run, pid_alive, run_recover

from recover.core.components.data import iteration_ids
from recover.core.contract.policy import assign_quotas
from recover.core.storage.results import read_jsonl, read_metrics, step_ids

pytest.importorskip("torchft", reason="the torchft extra is not installed: pip install -e '.[torchft]'")
pytestmark = [pytest.mark.procs, pytest.mark.timeout(240)]  # every test here starts processes

BASE = ["--replicas", "3", "--microbatches", "6", "--no-progress", "--seed", "5"]


def _share(step: int, replicas: list[int]) -> list[int]:
    quotas = assign_quotas(iteration_ids(step, 6), [0, 1, 2])
    return sorted(i for r in replicas for i in quotas[r])


def test_a_crash_discards_the_step_and_the_survivors_continue_with_a_smaller_batch(tmp_path):
    """Two faults in one job: replica 1 dies mid-step 3 (the step is discarded and
    retried by 0 and 2); replica 0 dies at step 5 after the commit, before any write
    of step 5's line (the step stays committed with [0, 2]; 2 goes on alone)."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"faults": [{"kind": "crash", "replica": 1, "step": 3, "phase": "backward"},
                                           {"kind": "crash", "replica": 0, "step": 5, "phase": "optimizer_step"}]}))
    out, ref = tmp_path / "run", tmp_path / "plain"
    # A 3 s join timeout: on a loaded machine a live replica can reach a quorum more than the
    # default 1 s after the others, and torchft then (rightly) forms it without that replica,
    # which is not what this test is about. The dead replicas are dropped by the heartbeat
    # timeout (1 s), so the recoveries below do not wait for it.
    run_recover("train", "--system", "torchft", *BASE, "--steps", "7", "--out", str(out), "--faults", str(plan),
                "--torchft-join-timeout-ms", "3000", check=True, timeout=180)
    run_recover("train", "--system", "plain", *BASE, "--steps", "3", "--out", str(ref), check=True, timeout=120)
    config, metrics, summary = load_run(out)
    assert config["baseline"]["torchft_join_timeout_ms"] == 3000
    assert_every_planned_fault_fired(out)
    assert [m["step"] for m in metrics] == list(range(7))  # step 5 too: written by the survivor
    for m in metrics:
        members = [0, 1, 2] if m["step"] < 3 else [0, 2] if m["step"] < 6 else [2]
        assert m["members"] == members
        assert step_ids(m) == _share(m["step"], members)  # replica 1's share is dropped
        assert m["tokens"] == len(step_ids(m)) * 4 * 64
    # Before the fault: the same workload as plain data parallelism, step for step.
    plain = [m["loss"] for m in load_run(ref)[1]]
    for a, b in zip([m["loss"] for m in metrics[:3]], plain):
        assert abs(a - b) <= 1e-5 * abs(b)
    event, after_commit = read_jsonl(out / "events.jsonl")
    assert event["kind"] == "quorum_change" and event["step"] == 3
    assert event["lost_replicas"] == [1] and event["members"] == [0, 2]
    assert event["discarded_attempts"] >= 1 and event["work_lost_microbatches"] >= 6
    assert event["global_batch"] == 4
    assert event["detected_at"] <= event["resumed_at"]
    # replica 0 died between two steps: nothing in flight was discarded
    assert after_commit["kind"] == "quorum_change" and after_commit["step"] == 6
    assert after_commit["lost_replicas"] == [0] and after_commit["members"] == [2]
    assert after_commit["discarded_attempts"] == 0 and after_commit["global_batch"] == 2
    assert summary["status"] == "ok" and summary["weights_checksum"] is not None


def test_the_metrics_writer_killed_by_pid_hands_over_and_the_run_completes(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "recover.experiments.cli", "train", "--system", "torchft", *BASE,
           "--steps", "15", "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 150
        while len(read_metrics(out / "metrics.jsonl")) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        pids = json.loads((out / "pids.json").read_text())
        victim = pids["replicas"]["0"][0]
        os.kill(victim, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=150)
        assert proc.returncode == 0, stdout + stderr
        _, metrics, _ = load_run(out)
        assert [m["step"] for m in metrics] == list(range(15))  # each once, whenever the kill struck
        assert metrics[-1]["members"] == [1, 2]
        changes = [e for e in read_jsonl(out / "events.jsonl") if e["kind"] == "quorum_change"]
        assert [e["lost_replicas"] for e in changes] == [[0]]
        every = [pids["coordinator"], *(p for ps in pids["replicas"].values() for p in ps)]
        assert not [p for p in every if pid_alive(p)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_replica_frozen_for_good_is_dropped_by_the_lighthouse(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"faults": [{"kind": "hang", "replica": 2, "step": 2, "phase": "allreduce"}]}))
    out = tmp_path / "run"
    run_recover("train", "--system", "torchft", *BASE, "--steps", "5", "--out", str(out), "--faults", str(plan),
                "--torchft-timeout", "3", check=True, timeout=180)
    _, metrics, summary = load_run(out)
    assert_every_planned_fault_fired(out)
    assert [m["step"] for m in metrics] == list(range(5))
    # The freeze strikes while replica 2's all-reduce is in flight: depending on how
    # far its share had gone, step 2 still commits with it or is discarded and
    # retried without it. Either way it is gone from then on.
    gone = next(m["step"] for m in metrics if 2 not in m["members"])
    assert gone in (2, 3)
    assert [m["members"] for m in metrics] == [[0, 1, 2]] * gone + [[0, 1]] * (5 - gone)
    (event,) = read_jsonl(out / "events.jsonl")
    assert event["lost_replicas"] == [2] and event["step"] == gone
    frozen = [p for p in summary["processes"] if p["replica"] == 2 and p["role"] == "worker"]
    assert frozen[0]["returncode"] < 0  # still frozen when the survivors finished; the cleanup killed it


def test_no_replica_left_ends_with_a_clear_error(tmp_path):
    plan = tmp_path / "plan.json"
    faults = [{"kind": "crash", "replica": r, "step": 1, "phase": "forward"} for r in range(3)]
    plan.write_text(json.dumps({"faults": faults}))
    out = tmp_path / "run"
    proc = run_recover("train", "--system", "torchft", *BASE, "--steps", "4", "--out", str(out),
                       "--faults", str(plan), timeout=180)
    assert proc.returncode == 1
    assert "no replica left" in proc.stdout
    assert_every_planned_fault_fired(out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["steps"] == 1
