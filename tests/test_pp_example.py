"""examples/pp_loop.py, a user's own pipeline-parallel loop (torch's pipelining over the replica's "pp"
group), under `recover launch --pp 2` (1f1b; the survivors' redo quotas of one id run as GPipe) with
the last stage of one replica SIGKILLed by its PID mid-run: every step folds exactly its M ids, and
every loss, before and after the kill, is the same recipe's in one process without stages (the
failure-free trajectory). One launch. Also what `recover launch` checks of --tp/--pp before anything
starts (pure)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from conftest import one_process_losses, run_killing_rank_1_of_replica_1

EXAMPLE = str(Path(__file__).resolve().parents[1] / "examples" / "pp_loop.py")
STEPS, M = 30, 6  # 30 steps: the kill after 4 commits lands mid-run even on a loaded machine


def _args(out: Path, *extra: str) -> list[str]:
    return ["launch", "--replicas", "3", "--pp", "2", "--microbatches", str(M), "--steps", str(STEPS),
            *extra, "--out", str(out), "--", sys.executable, EXAMPLE]


def _one_process_losses() -> list[float]:
    """The example's recipe (model, data, AdamW, warm-up, clipping) in one process, no stages: each
    step's gradient is the mean over its M ids, its loss their mean loss."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh()),
                                torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()), torch.nn.Linear(64, 1))
    return one_process_losses(model, STEPS, M)


@pytest.mark.procs
@pytest.mark.timeout(400)
def test_a_users_pp_loop_loses_a_stage_and_keeps_its_trajectory(tmp_path):
    out = tmp_path / "kill"
    metrics = run_killing_rank_1_of_replica_1(_args(out), out, STEPS, M)
    # before and after the kill, the losses are those of the same recipe in one process (the
    # failure-free trajectory: a failure-free run of the example matches it to 1e-7, README)
    assert [m["loss"] for m in metrics] == pytest.approx(_one_process_losses(), rel=1e-5)


@pytest.mark.parametrize("flags, message", [
    (["--pp", "0"], "recover: error: --pp: must be >= 1, got 0"),
    (["--pp", "2", "--pp-schedule", "zb"], "recover: error: --pp-schedule: 'zb' is not one of afab, 1f1b"),
])
def test_launch_refuses_a_layout_it_cannot_run_before_anything_starts(flags, message, tmp_path, capsys):
    from recover.experiments.cli import main

    assert main(["launch", "--replicas", "2", *flags, "--out", str(tmp_path / "x"), "--", "true"]) == 2
    assert capsys.readouterr().err.startswith(message)
    assert not (tmp_path / "x").exists()  # nothing started, nothing written


def test_launch_does_not_check_tp_or_pp_against_a_model_the_user_does_not_train():
    from recover.core.config.train_config import ConfigError, TrainConfig

    # the user's model is not --model's GPT (tiny: 2 heads, 2 layers): --tp 4 and --pp 3 are the loop's business
    cfg = TrainConfig(system="recover", replicas=2, microbatches=2, tp=4, pp=3)
    cfg.validate(own_model=True)
    with pytest.raises(ConfigError, match="--tp: 4 does not divide the model's 2 attention heads"):
        cfg.validate()
