"""examples/hsdp_loop.py, a user's own FSDP2 loop, under `recover launch --shard 2`:
failure-free, and with one rank of one replica SIGKILLed by its PID mid-run."""
from __future__ import annotations

from pathlib import Path

import pytest

from conftest import run_killing_rank_1_of_replica_1, run_recover

from recover.core.storage.results import read_metrics

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
    metrics = run_killing_rank_1_of_replica_1(_args(out), out, STEPS, M)
    for m, ref_loss in zip(metrics, failure_free):
        assert m["loss"] == pytest.approx(ref_loss, rel=1e-5)
