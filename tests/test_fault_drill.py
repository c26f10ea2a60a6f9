"""Every fault kind, at every phase, really happens where the plan says.

One drill (real core Launcher, real injector, real signals; stand-in workers that walk
every hook point without training) carries fifteen faults on fifteen replicas, so one
run of a few seconds shows them all. Each stand-in writes the point it reaches *before*
the hook runs, so a killed or frozen worker's last trace line is where its fault fired.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import pid_alive

from recover.fault_injection.drill import read_trace, trace_path
from recover.fault_injection.injector import process_state
from recover.fault_injection.record import read_records

pytestmark = pytest.mark.procs  # every test here starts processes

STEPS, MICROBATCHES = 3, 30  # 15 replicas: two microbatches each per step

CRASH_POINTS = {  # replica -> (step, phase, microbatch as planned, microbatch it lands on)
    0: (1, "forward", 1, 1),
    1: (2, "backward", None, 0),  # no microbatch: the first one
    2: (1, "between_microbatches", 1, 1),
    3: (0, "allreduce", None, None),
    4: (1, "commit", None, None),
    5: (2, "optimizer_step", None, None),
    6: (1, "checkpoint_save", None, None),
}
PLAN = {"faults": [
    *({"kind": "crash", "replica": r, "step": s, "phase": p, **({} if k is None else {"microbatch": k})}
      for r, (s, p, k, _) in CRASH_POINTS.items()),
    {"kind": "hang", "replica": 7, "step": 1, "phase": "backward", "microbatch": 0, "seconds": 1.5},  # 7
    {"kind": "hang", "replica": 8, "step": 2, "phase": "allreduce"},  # 8: frozen for good
    {"kind": "replica_loss", "replica": 9, "step": 1, "phase": "forward"},  # 9
    {"kind": "collective_error", "replica": 10, "step": 1, "phase": "allreduce"},  # 10
    {"kind": "slow", "replica": 11, "step": 1, "phase": "forward", "factor": 3},  # 11
    {"kind": "crash", "replica": 12, "at_seconds": 1.0},  # 12: by the launcher, by PID
    {"kind": "hang", "replica": 13, "at_seconds": 1.0, "seconds": 1.0},  # 13: by the launcher
    {"kind": "slow", "replica": 14, "at_seconds": 0.5, "factor": 2},  # 14: armed in the worker
]}
REPLICAS = len(PLAN["faults"])


@pytest.fixture(scope="module")
def drill(tmp_path_factory) -> SimpleNamespace:
    base = tmp_path_factory.mktemp("drill")
    plan, out = base / "plan.json", base / "run"
    plan.write_text(json.dumps(PLAN))
    proc = subprocess.Popen(
        [sys.executable, "-m", "recover.fault_injection.drill", "run", str(plan), "--replicas", str(REPLICAS),
         "--steps", str(STEPS), "--microbatches", str(MICROBATCHES), "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    seen: dict[int, set] = {}  # hung replica -> process states seen while it was hung
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None:
            assert time.monotonic() < deadline, "drill did not finish"
            for rec in read_records(out):
                if rec["kind"] == "hang":
                    seen.setdefault(rec["replica"], set()).add(process_state(rec["pid"]))
            time.sleep(0.01)
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:  # its children die with it (PR_SET_PDEATHSIG)
            proc.kill()
            proc.wait()
    summary = json.loads((out / "summary.json").read_text())
    return SimpleNamespace(
        out=out, code=proc.returncode, stderr=stderr, seen=seen, summary=summary,
        records={r["index"]: r for r in read_records(out)},
        exits={e["replica"]: e for e in summary["processes"]},
        traces={r: read_trace(out, r) for r in range(REPLICAS)},
    )


def _points(trace: list[dict]) -> list[tuple]:
    return [(e["step"], e["phase"], e["microbatch"]) for e in trace if e["event"] == "point"]


def _sidecar_events(out: Path, replica: int) -> list[str]:
    p = Path(str(trace_path(out, replica)) + ".sidecar")
    return [json.loads(x)["event"] for x in p.read_text().splitlines()]


def test_the_drill_ran_and_every_fault_fired_once(drill):
    assert drill.code == 0, drill.stderr
    assert sorted(drill.records) == list(range(REPLICAS))
    lines = (drill.out / "faults.jsonl").read_text().splitlines()
    assert len(lines) == REPLICAS  # each once
    assert json.loads((drill.out / "fault_plan.json").read_text()) == PLAN
    pids = json.loads((drill.out / "pids.json").read_text())["replicas"]
    for i, rec in drill.records.items():
        assert rec["replica"] == PLAN["faults"][i]["replica"] and rec["kind"] == PLAN["faults"][i]["kind"]
        assert rec["pid"] == pids[str(rec["replica"])][0]  # the process it hit


@pytest.mark.parametrize("replica", sorted(CRASH_POINTS))
def test_crash_kills_the_worker_exactly_at_its_point(drill, replica):
    step, phase, _, lands_on = CRASH_POINTS[replica]
    rec = drill.records[replica]
    assert (rec["step"], rec["phase"], rec["microbatch"]) == (step, phase, lands_on)
    assert _points(drill.traces[replica])[-1] == (step, phase, lands_on)  # it got no further
    assert drill.exits[replica]["how"] == "killed by SIGKILL"
    assert drill.exits[replica]["pid"] == rec["pid"]
    # Only the worker died: its sidecar (the replica's other process) outlived it.
    assert _sidecar_events(drill.out, replica) == ["start", "parent_gone"]


def test_timed_hang_freezes_the_worker_then_it_resumes_and_finishes(drill):
    rec = drill.records[7]
    assert (rec["step"], rec["phase"], rec["microbatch"]) == (1, "backward", 0)
    assert "T" in drill.seen[7]  # /proc/<pid>/stat said stopped
    trace = drill.traces[7]
    at = next(i for i, e in enumerate(trace) if e["event"] == "point" and e.get("step") == 1
              and e["phase"] == "backward" and e["microbatch"] == 0)
    assert trace[at + 1]["t"] >= rec["time"] + 1.5  # nothing ran until the launcher's SIGCONT
    assert trace[-1]["event"] == "end" and drill.exits[7]["how"] == "exited 0"


def test_hang_for_good_stays_frozen_until_the_launcher_cleans_up(drill):
    rec = drill.records[8]
    assert (rec["step"], rec["phase"], rec["seconds"]) == (2, "allreduce", None)
    assert "T" in drill.seen[8]
    assert _points(drill.traces[8])[-1] == (2, "allreduce", None)
    assert drill.exits[8]["how"] == "killed by SIGTERM"  # the launcher's cleanup, never resumed


def test_replica_loss_kills_every_process_of_the_replica_at_once(drill):
    rec = drill.records[9]
    assert (rec["step"], rec["phase"], rec["microbatch"]) == (1, "forward", 0)
    assert _points(drill.traces[9])[-1] == (1, "forward", 0)
    assert drill.exits[9]["how"] == "killed by SIGKILL"
    assert _sidecar_events(drill.out, 9) == ["start"]  # SIGKILLed with it: never saw it go
    assert not pid_alive(drill.traces[9][0]["sidecar_pid"])


def test_collective_error_breaks_the_allreduce_in_flight(drill):
    rec = drill.records[10]
    assert (rec["step"], rec["phase"]) == (1, "allreduce")
    failed = [e for e in drill.traces[10] if e["event"] == "collective_failed"]
    assert len(failed) == 1 and failed[0]["step"] == 1 and "InjectedLinkError" in failed[0]["error"]
    assert drill.exits[10]["how"] == "exited with code 1"


@pytest.mark.parametrize("replica, factor", [(11, 3), (14, 2)])
def test_slow_makes_every_later_microbatch_take_factor_times_as_long(drill, replica, factor):
    rec = drill.records[replica]
    if replica == 11:
        assert (rec["step"], rec["phase"], rec["microbatch"]) == (1, "forward", 0)
    else:  # armed by wall clock: fires at the first point after 0.5 s
        assert rec["wall_time"] >= 0.5
    done = [e for e in drill.traces[replica] if e["event"] == "microbatch_done"]
    after = [e for e in done if e["t"] > rec["time"]]
    assert after and len(after) + sum(1 for e in done if e["t"] <= rec["time"]) == len(done)
    for e in after:  # (factor - 1) x measured was slept on top of the measured time
        assert e["total"] >= factor * e["measured"]
    assert drill.traces[replica][-1]["event"] == "end"


def test_wall_clock_faults_are_fired_by_the_launcher_by_pid(drill):
    crash, hang = drill.records[12], drill.records[13]
    for rec in (crash, hang):
        assert rec["fired_by"] == "launcher" and rec["wall_time"] >= 1.0
        assert rec["step"] is None and rec["phase"] is None
    assert drill.exits[12]["how"] == "killed by SIGKILL" and drill.exits[12]["pid"] == crash["pid"]
    assert "T" in drill.seen[13]
    assert drill.exits[13]["how"] == "exited 0"  # resumed after its 1.0 s and finished


def test_no_process_of_the_drill_is_left_behind(drill):
    pids = json.loads((drill.out / "pids.json").read_text())
    every = [pids["coordinator"], *(p for ps in pids["replicas"].values() for p in ps),
             *(t[0]["sidecar_pid"] for t in drill.traces.values() if t)]
    end = time.monotonic() + 10
    while time.monotonic() < end and any(pid_alive(p) for p in every):
        time.sleep(0.05)
    left = [p for p in every if pid_alive(p)]
    for p in left:  # never leave them running, even when failing
        os.kill(p, signal.SIGKILL)
    assert not left


def test_a_restarted_worker_does_not_fire_a_fault_again(tmp_path):
    """Checkpoint-restart systems restart workers in the same run directory."""
    plan = {"faults": [{"kind": "crash", "replica": 0, "step": 1, "phase": "backward"}]}
    (tmp_path / "fault_plan.json").write_text(json.dumps(plan))
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"train": {
        "out": str(tmp_path), "replicas": 1, "steps": 2, "microbatches": 1, "faults": "",
        "hooks": "recover.fault_injection.injector:worker_hooks", "work_seconds": 0.0,
    }}))
    argv = [sys.executable, "-m", "recover.fault_injection.drill", "worker", "--config", str(config), "--replica", "0"]
    first = subprocess.run(argv, timeout=60)
    assert first.returncode == -signal.SIGKILL
    second = subprocess.run(argv, timeout=60)  # the restart replays step 1
    assert second.returncode == 0
    assert len(read_records(tmp_path)) == 1
    assert (1, "backward", 0) in _points(read_trace(tmp_path, 0))[-6:]  # it did pass the point this time
