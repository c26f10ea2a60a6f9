"""`recover train --faults PLAN` on the real plain trainer: the faults happen inside real
gloo workers where the plan says, the launcher sees them, and the run records them.

(The plain trainer has no fault tolerance, so a crash or a link error ends its job; a
timed hang is survived because the peer simply waits in the all-reduce.)
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from conftest import load_run, run_recover

from recover.fault_injection.injector import process_state
from recover.fault_injection.record import read_records

pytestmark = pytest.mark.procs  # every test here starts processes


def _write_plan(tmp_path, faults: list[dict]):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"faults": faults}))
    return path


def _pids(out) -> dict[int, int]:
    return {int(r): ps[0] for r, ps in json.loads((out / "pids.json").read_text())["replicas"].items()}


def test_crash_at_a_microbatch_kills_the_worker_and_ends_the_plain_run(tmp_path, out_dir):
    faults = [{"kind": "crash", "replica": 1, "step": 2, "phase": "backward", "microbatch": 1}]
    plan = _write_plan(tmp_path, faults)
    proc = run_recover("train", "--replicas", "2", "--microbatches", "4", "--steps", "4", "--faults", str(plan),
                       "--out", str(out_dir), "--no-progress", timeout=120)
    assert proc.returncode == 1, proc.stderr
    victim = _pids(out_dir)[1]
    assert f"replica 1 (pid {victim}) killed by SIGKILL" in proc.stderr
    config, metrics, summary = load_run(out_dir)
    assert config["train"]["hooks"] == "recover.fault_injection.injector:worker_hooks"
    assert json.loads((out_dir / "fault_plan.json").read_text()) == {"faults": faults}
    [rec] = read_records(out_dir)
    assert (rec["index"], rec["kind"], rec["replica"], rec["pid"]) == (0, "crash", 1, victim)
    assert (rec["step"], rec["phase"], rec["microbatch"]) == (2, "backward", 1)
    assert rec["wall_time"] > 0
    assert [m["step"] for m in metrics] == [0, 1]  # step 2 never committed
    assert summary["status"] == "failed"
    assert {(e["replica"], e["how"]) for e in summary["processes"]} >= {(1, "killed by SIGKILL")}


def test_timed_hang_in_the_allreduce_freezes_the_worker_and_the_run_goes_on(tmp_path, out_dir):
    plan = _write_plan(tmp_path, [{"kind": "hang", "replica": 0, "step": 1, "phase": "allreduce", "seconds": 2}])
    proc = subprocess.Popen(
        [sys.executable, "-m", "recover.experiments.cli", "train", "--replicas", "2", "--microbatches", "2",
         "--steps", "3", "--faults", str(plan), "--out", str(out_dir), "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    states = set()
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None:
            assert time.monotonic() < deadline, "run did not finish"
            for rec in read_records(out_dir):
                states.add(process_state(rec["pid"]))
            time.sleep(0.01)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:  # the launcher's children die with it
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    [rec] = read_records(out_dir)
    assert (rec["kind"], rec["replica"], rec["pid"]) == ("hang", 0, _pids(out_dir)[0])
    assert (rec["step"], rec["phase"], rec["seconds"]) == (1, "allreduce", 2)
    assert "T" in states  # /proc/<pid>/stat: stopped
    _, metrics, summary = load_run(out_dir)
    assert summary["status"] == "ok" and [m["step"] for m in metrics] == [0, 1, 2]
    # Step 1 could not commit before the launcher's SIGCONT, seconds after the freeze.
    assert metrics[1]["wall_time"] >= rec["wall_time"] + 2
    assert all(e["how"] == "exited 0" for e in summary["processes"] if e["role"] == "worker")


def test_collective_error_fails_the_allreduce_and_slow_fault_is_recorded(tmp_path, out_dir):
    plan = _write_plan(tmp_path, [
        {"kind": "slow", "replica": 0, "step": 0, "phase": "forward", "factor": 2},
        {"kind": "collective_error", "replica": 1, "step": 1, "phase": "allreduce"},
    ])
    proc = run_recover("train", "--replicas", "2", "--microbatches", "4", "--steps", "3", "--faults", str(plan),
                       "--out", str(out_dir), "--no-progress", timeout=120)
    assert proc.returncode == 1
    pids = _pids(out_dir)
    assert f"replica 1 (pid {pids[1]}) exited with code 1" in proc.stderr
    slow, link = read_records(out_dir)
    assert (slow["index"], slow["kind"], slow["pid"], slow["factor"]) == (0, "slow", pids[0], 2)
    assert (slow["step"], slow["phase"], slow["microbatch"]) == (0, "forward", 0)
    assert (link["index"], link["kind"], link["pid"]) == (1, "collective_error", pids[1])
    assert (link["step"], link["phase"]) == (1, "allreduce")
    log = (out_dir / "logs" / "replica1.log").read_text()
    # core's Communicator turned the injected link failure into its CollectiveError.
    assert "CollectiveError" in log and "injected collective_error (fault 1)" in log
    # The error is raised after replica 1 issued its part of the all-reduce, so replica 0's
    # reduction of step 1 may still complete (and replica 0 writes the metrics); step 2
    # never can.
    assert [m["step"] for m in load_run(out_dir)[1]] in ([0], [0, 1])
