"""examples/tp_loop.py, a user's own tensor-parallel loop, under `recover launch --tp 2` with one
non-leader rank of one replica SIGKILLed by its PID mid-run: every step folds exactly its M ids, and
every loss, before and after the kill, is the same recipe's in one process without TP (the
failure-free trajectory). One launch (~30 s on 2 idle cores)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from conftest import one_process_losses, run_killing_rank_1_of_replica_1

pytestmark = [pytest.mark.procs, pytest.mark.timeout(400)]

EXAMPLE = str(Path(__file__).resolve().parents[1] / "examples" / "tp_loop.py")
STEPS, M = 30, 6  # 30 steps: the kill after 4 commits lands mid-run even on a loaded machine


def _args(out: Path) -> list[str]:
    return ["launch", "--replicas", "3", "--tp", "2", "--microbatches", str(M), "--steps", str(STEPS),
            "--out", str(out), "--", sys.executable, EXAMPLE]


def _one_process_losses() -> list[float]:
    """The example's recipe (model, data, AdamW, warm-up, clipping) in one process, no TP: each step's
    gradient is the mean over its M ids, its loss their mean loss."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    return one_process_losses(model, STEPS, M)


def test_a_users_tp_loop_loses_a_rank_and_keeps_its_trajectory(tmp_path):
    out = tmp_path / "kill"
    metrics = run_killing_rank_1_of_replica_1(_args(out), out, STEPS, M)
    # before and after the kill, the losses are those of the same recipe in one process (the
    # failure-free trajectory: a failure-free run of the example matches it to 1e-7, README)
    assert [m["loss"] for m in metrics] == pytest.approx(_one_process_losses(), rel=1e-5)
