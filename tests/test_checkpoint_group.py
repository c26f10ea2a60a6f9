"""A collective checkpoint (a replica of many ranks saving together): every rank reports the same outcome.

Rank 0 alone renames the written temp dir into place. When that rename fails (a lost
mount), every rank of the group raises from the same `save`, so each counts the same
failures in a row and a replica's ranks stop together (core/training/resilient.py); the
temp dir is removed, nothing counts as complete, and the next saves (sync and async)
complete on every rank. Two real processes over gloo.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import run_ranks_around_a_store

from recover.core.storage.checkpoint_dir import CheckpointDir

pytestmark = [pytest.mark.procs, pytest.mark.timeout(120)]

WORKER = str(Path(__file__).with_name("ckpt_group_worker.py"))


def test_a_failed_rename_on_rank_0_fails_the_save_on_every_rank_and_the_next_saves_complete(tmp_path):
    run_ranks_around_a_store(lambda port: [[sys.executable, WORKER, str(port), str(tmp_path), str(r)]
                                           for r in range(2)], timeout=100)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert [o["step"] for o in r["outcomes"]] == [2, 4, 6]
        assert r["outcomes"][0]["error"] and r["outcomes"][1]["error"] is None and r["outcomes"][2]["error"] is None
        assert r["completed"] == [4, 6]
    assert "Input/output error" in ranks[0]["outcomes"][0]["error"]
    assert "rank 0 of the group could not rename" in ranks[1]["outcomes"][0]["error"]
    ckpts = CheckpointDir(tmp_path / "ckpts")
    assert ckpts.complete_steps() == [4, 6]
    assert not list(ckpts.root.glob(".tmp-step-*"))  # the failed save's temp dir is gone
