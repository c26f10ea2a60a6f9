"""Micro-benchmarks of the coordinator's hot path (pytest-benchmark).

They time, they do not judge: each asserts only that the benched call returned the
right answer. `pytest --benchmark-only tests/test_benchmarks.py` prints the figures;
`--benchmark-json FILE` writes them.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from recover.core.data import iteration_ids
from recover.core.policy import assign_quotas
from recover.core.protocol import Membership
from recover.core.results import step_ids

from conftest import as_read


def test_bench_quota_policy_512_replicas(benchmark):
    ids = iteration_ids(7, 4096)
    speeds = {r: 1.0 + (r % 7) / 10 for r in range(512)}
    quotas = benchmark(assign_quotas, ids, list(range(512)), speeds)
    assert sorted(i for q in quotas.values() for i in q) == ids


def test_bench_commit_vote_64_replicas(benchmark):
    """One iteration's votes through the coordinator's state machine, to the commit."""
    R, M = 64, 256

    def one_iteration():
        proto = Membership(R, M, 1, join_timeout=30.0, now=0.0)
        out = []
        for r in range(R):
            out += proto.on_hello(r, {"tokens_per_mb": 1}, 0.0)
        quotas = {a.replica: as_read(a.msg, a.replica)["quota"] for a in out if a.kind == "send" and a.msg["t"] == "gen"}
        for r in range(R):
            out = proto.on_vote(r, {"gen": 0, "step": 0, "ok": True, "ledger": quotas[r], "loss_sum": 1.0,
                                    "mb_seconds": 0.1}, 0.0)
        return out

    out = benchmark(one_iteration)
    commits = [a for a in out if a.kind == "commit"]
    assert len(commits) == 1 and step_ids(commits[0].msg) == iteration_ids(0, M)


@pytest.mark.procs  # the CLI and the figure script
def test_bench_coordinator_writes_its_figures_and_votes_stay_small(tmp_path):
    """`recover bench coordinator` end to end on small R: the JSON, the figure, and a vote
    whose size does not grow with the microbatches it names (ids travel as ranges)."""
    import json
    import subprocess
    import sys

    for per_replica, name in ((8, "coordinator_state_machine"), (1024, "coordinator_state_machine_before")):
        proc = subprocess.run([sys.executable, "-m", "recover.experiments.cli", "bench", "coordinator", "--replicas",
                               "4", "16", "--per-replica", str(per_replica), "--repeats", "1", "--out", str(tmp_path),
                               "--name", name, "--no-figure"], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
    small, big = (json.loads((tmp_path / f"{n}.json").read_text())["rows"]
                  for n in ("coordinator_state_machine", "coordinator_state_machine_before"))
    assert [r["replicas"] for r in small] == [4, 16] and big[1]["microbatches"] == 16 * 1024
    assert all(r["commit_s"] > 0 and r["recovery_s"] > 0 for r in small + big)
    # 1024 microbatches per vote cost a few digits more than 8, not 1016 more ids
    assert big[1]["vote_bytes"] - small[1]["vote_bytes"] < 20 and big[1]["join_bytes"] < 200
    fig = Path(__file__).resolve().parents[1] / "paper_figs" / "coordinator_scale.py"
    proc = subprocess.run([sys.executable, str(fig), "--results", str(tmp_path),
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "coordinator_scale.png").stat().st_size > 1000
