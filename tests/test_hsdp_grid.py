"""HSDP on real processes: R replicas x S shard ranks (FSDP2 inside a replica), failure-free.

Each rank is a plain process (tests/hsdp_worker.py) around one TCPStore; evidence is what
the workers wrote: each step's mean loss, the ledger and the weights fingerprint of every
rank. The losses are compared step by step with single-process training (core's flat
GradAccumulator, the same recipe) over the same M global ids per step.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import run_ranks_around_a_store

pytestmark = pytest.mark.procs

WORKER = str(Path(__file__).with_name("hsdp_worker.py"))
sys.path.insert(0, str(Path(__file__).parent))
import hsdp_worker as w  # noqa: E402  (the reference shares the worker's constants and data)


def _run_grid(out: Path, R: int, S: int, M: int, steps: int, *extra: str, timeout: float = 240) -> None:
    """Start R x S ranks around a fresh TCPStore (port 0); wait for all; kill leftovers by PID."""
    run_ranks_around_a_store(lambda port: [
        [sys.executable, WORKER, str(port), str(out), str(r), str(i), str(R), str(S), str(M), str(steps), *extra]
        for r in range(R) for i in range(S)], timeout)


def _reference_losses(M: int, steps: int) -> list[float]:
    """Single-process training over the same ids: what core's one-rank replica computes."""
    from recover.core.worker.accumulator import GradAccumulator
    from recover.core.components.data import iteration_ids
    from recover.core.worker.recipe import CommittedStep, build_adamw

    torch.set_num_threads(1)
    src, model = w.source(), w.fresh_model()
    acc = GradAccumulator(model.parameters())
    stepper = CommittedStep(build_adamw(acc.params, w.LR, w.WD), acc.params, grad_clip=w.CLIP)
    losses = []
    for step in range(steps):
        for mb in iteration_ids(step, M):
            x, y = src.get(mb)
            _, loss = model(x, y)
            loss.backward()
            acc.fold(mb, float(loss.detach()))
        losses.append(acc.load_mean(acc.pack(), M))
        stepper(step)
        acc.clear()
    return losses


@pytest.mark.timeout(300)
def test_folding_then_pack_sums_the_local_shards_of_the_microbatches_gradients(tmp_path: Path):
    """One replica of 2 ranks folds 3 microbatches (each rank its rows of each, SUM
    reduce-scatter): pack() is the local shard of the single-process gradient sum."""
    _run_grid(tmp_path, 1, 2, 3, 1, "--check-fold")
    for i in range(2):
        rec = json.loads((tmp_path / f"fold{i}.json").read_text())
        assert rec["numel"] == rec["expected_numel"]
        assert rec["max_rel"] < 1e-5, rec
        assert rec["detached"] == [] and rec["ledger"] == [5, 2, 9] and rec["buffer_untouched_by_pack"]
        assert rec["loss_sum"] == pytest.approx(rec["ref_loss_sum"], rel=1e-6)


@pytest.mark.timeout(420)
# 3x2 with M = 5: quotas of 2, 2, 1, so dividing by the global M (not a replica's count) is checked.
@pytest.mark.parametrize("R, S, M", [(2, 2, 4), (3, 2, 5)])
def test_failure_free_hsdp_matches_single_process_training(tmp_path: Path, R: int, S: int, M: int):
    steps = 3
    _run_grid(tmp_path, R, S, M, steps)
    ref = _reference_losses(M, steps)
    records = {(r, i): json.loads((tmp_path / f"rank{r}_{i}.json").read_text()) for r in range(R) for i in range(S)}
    worst = 0.0
    for (r, i), rec in records.items():
        assert len(rec["losses"]) == steps
        for got, want in zip(rec["losses"], ref):
            worst = max(worst, abs(got - want) / abs(want))
        # every rank of a replica folded the replica's ids; the replicas' ledgers union to M ids, each once
        assert rec["ledgers"] == records[(r, 0)]["ledgers"]
    for step in range(steps):
        folded = sorted(mb for r in range(R) for mb in records[(r, 0)]["ledgers"][step])
        assert folded == list(range(step * M, (step + 1) * M))
    # the ranks at one position hold the same shard after every step (replicas in sync)
    for i in range(S):
        assert len({tuple(records[(r, i)]["fingerprints"]) for r in range(R)}) == 1
    print(f"{R}x{S}: losses {records[(0, 0)]['losses']} vs single-process {ref}; max relative diff {worst:.2e}")
    assert worst < 1e-4
