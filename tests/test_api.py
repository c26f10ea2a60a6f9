"""The public API (`recover.core.Replica`) in a user's own loop, under `recover launch`.

The README's example script runs as 3 real processes (3 prove the point: a killed
replica leaves two survivors that must share its work); one is SIGKILLed by PID in
the middle of the run and the survivors finish with the failure-free losses.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from conftest import pid_alive, run_recover, run_recover_killing

from recover.core.components.data import iteration_ids
from recover.core.storage.results import read_jsonl, read_metrics, reported_ids

pytestmark = pytest.mark.procs  # every test here starts processes

EXAMPLE = str(Path(__file__).resolve().parents[1] / "examples" / "user_loop.py")
STEPS = 16  # the kill lands after step 5; the example's warm-up is its first 5 steps
ARGS = ["--replicas", "3", "--microbatches", "8", "--steps", str(STEPS), "--heartbeat-timeout", "2"]


def test_user_loop_survives_a_killed_replica(tmp_path):
    ref = tmp_path / "ref"
    run_recover("launch", *ARGS, "--out", str(ref), "--", sys.executable, EXAMPLE, check=True)
    ref_loss = [m["loss"] for m in read_metrics(ref / "metrics.jsonl")]

    out = tmp_path / "killed"
    proc, victim = run_recover_killing(["launch", *ARGS, "--out", str(out), "--", sys.executable, EXAMPLE],
                                       out, replica=2, after_commits=5)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not pid_alive(victim)
    metrics = read_metrics(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(STEPS))
    assert any(2 not in m["members"] for m in metrics)
    for m, r in zip(metrics, ref_loss):
        assert reported_ids(m) == iteration_ids(m["step"], 8)  # from the members' reports
        assert abs(m["loss"] - r) <= 1e-5 * abs(r)
    # the example's LambdaLR, stepped only on commit: its 5-step warm-up, by committed step, kill or not
    assert [m["lr"] for m in metrics] == pytest.approx([0.05 * min(1.0, (s + 1) / 5) for s in range(STEPS)])
    events = [e for e in read_jsonl(out / "events.jsonl") if e["kind"] == "recovery"]
    # one recovery; a ring neighbour may report the broken all-reduce before the coordinator
    # sees the death, so the loss is among the recovery's faults, not always its first
    assert len(events) == 1 and any("replica 2 lost" in f for f in events[0]["faults"]), events


def test_launch_without_a_command_is_refused():
    proc = run_recover("launch", "--replicas", "2", timeout=60)
    assert proc.returncode == 2 and "COMMAND" in proc.stderr
