"""torchft at replica groups of many ranks (fault-tolerant HSDP): `recover train --system torchft --shard 2`, real processes.

What is shown: 3 groups of 2 ranks (a torchft Manager per rank, FSDP2 inside each
group, torchft's ProcessGroupGloo across groups). Rank 1 of group 1 (not the rank that
hosts its group's ManagerServer) is SIGKILLed by its PID mid-run; its whole group goes,
the two other groups commit every later step with their own shares only (torchft's
semantics: the global batch shrinks), each step once. Before the kill, the losses are
plain data parallelism's on the same ids. Evidence from the workers' own metrics.jsonl
and events.jsonl.
"""
from __future__ import annotations

import json

import pytest

from conftest import load_run, pid_alive, run_recover, run_recover_killing

from recover.core.components.data import iteration_ids
from recover.core.contract.policy import assign_quotas
from recover.core.storage.results import read_jsonl, step_ids

pytest.importorskip("torchft", reason="the torchft extra is not installed: pip install -e '.[torchft]'")
pytestmark = [pytest.mark.procs, pytest.mark.timeout(300)]

STEPS, M = 9, 6
BASE = ["--replicas", "3", "--microbatches", str(M), "--no-progress", "--seed", "5"]


def _share(step: int, groups: list[int]) -> list[int]:
    quotas = assign_quotas(iteration_ids(step, M), [0, 1, 2])
    return sorted(i for g in groups for i in quotas[g])


def test_a_rank_killed_by_pid_takes_its_group_out_and_the_others_commit_every_later_step(tmp_path):
    out = tmp_path / "ft"
    # A 3 s join timeout, as test_baseline_torchft.py: on a loaded machine a live group can reach a
    # quorum more than 1 s after the others. The dead group is dropped by the heartbeat timeout (1 s).
    proc, victim = run_recover_killing(
        ["train", "--system", "torchft", "--shard", "2", *BASE, "--steps", str(STEPS), "--out", str(out),
         "--torchft-join-timeout-ms", "3000"], out, replica=1, after_commits=3, rank=1, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    _, metrics, summary = load_run(out)
    pids = json.loads((out / "pids.json").read_text())
    assert victim == pids["replicas"]["1"][1] and len(pids["replicas"]["1"]) == 2  # rank 1 of a group of 2
    assert [m["step"] for m in metrics] == list(range(STEPS))  # every step committed, once
    gone = next(m["step"] for m in metrics if m["members"] != [0, 1, 2])
    assert gone >= 3  # the kill came after 3 commits
    for m in metrics:
        groups = [0, 1, 2] if m["step"] < gone else [0, 2]
        assert m["members"] == groups
        assert step_ids(m) == _share(m["step"], groups)  # group 1's share went with it
        assert m["tokens"] == len(step_ids(m)) * 4 * 64
    (change,) = [e for e in read_jsonl(out / "events.jsonl") if e["kind"] == "quorum_change"]
    assert change["step"] == gone and change["lost_replicas"] == [1] and change["members"] == [0, 2]
    assert change["global_batch"] == 4
    assert summary["status"] == "ok" and summary["weights_checksum"] is not None
    # the killed group's other rank was ended with it; nothing the run started outlives it
    every = [pids["coordinator"], *(p for ps in pids["replicas"].values() for p in ps)]
    assert not [p for p in every if pid_alive(p)]
    # before the kill: the same sums as plain data parallelism over the same ids
    ref = tmp_path / "plain"
    run_recover("train", "--system", "plain", *BASE, "--steps", "3", "--out", str(ref), check=True, timeout=120)
    for a, b in zip(metrics[:3], load_run(ref)[1]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
