"""examples/hsdp_loop.py, a user's own FSDP2 loop, under `recover launch --shard 2`:
failure-free, and with one rank of one replica SIGKILLed by its PID mid-run."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_recover, run_recover_killing

from recover.core.data import iteration_ids
from recover.core.results import read_jsonl, read_metrics, reported_ids

pytestmark = pytest.mark.procs

EXAMPLE = str(Path(__file__).resolve().parents[1] / "examples" / "hsdp_loop.py")
STEPS, M = 16, 6  # the kill lands after 4 commits, with 12 steps (seconds of 6 busy processes) still to run:
# the killer polls every 20 ms, so it lands mid-run even on a loaded machine. 30 steps made this the
# suite's longest test (59 s) for no more evidence.


def _args(out: Path) -> list[str]:
    import sys
    return ["launch", "--replicas", "3", "--shard", "2", "--microbatches", str(M), "--steps", str(STEPS),
            "--out", str(out), "--", sys.executable, EXAMPLE]


def test_a_users_fsdp2_loop_loses_a_rank_and_keeps_its_trajectory(tmp_path):
    ref = run_recover(*_args(tmp_path / "ff"), timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]
    failure_free = [m["loss"] for m in read_metrics(tmp_path / "ff" / "metrics.jsonl")]
    out = tmp_path / "kill"
    proc, victim = run_recover_killing(_args(out), out, replica=1, after_commits=4, rank=1, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert victim == json.loads((out / "pids.json").read_text())["replicas"]["1"][1]  # rank 1, not the leader
    metrics = read_metrics(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(STEPS))
    assert all(reported_ids(m) == iteration_ids(m["step"], M) for m in metrics)  # the leaders' ledgers
    assert metrics[-1]["members"] == [0, 2]  # the killed rank's whole replica went
    recoveries = [e for e in read_jsonl(out / "events.jsonl") if e["kind"] == "recovery"]
    assert len(recoveries) == 1 and recoveries[0]["survivors"] == [0, 2]
    for m, ref_loss in zip(metrics, failure_free):
        assert m["loss"] == pytest.approx(ref_loss, rel=1e-5)
