"""Micro-benchmarks of the coordinator's hot path (pytest-benchmark).

They time, they do not judge: each asserts only that the benched call returned the
right answer. `pytest --benchmark-only tests/test_benchmarks.py` prints the figures;
`--benchmark-json FILE` writes them.
"""
from __future__ import annotations

from recover.core.data import iteration_ids
from recover.core.policy import assign_quotas
from recover.core.protocol import Membership


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
        quotas = {a.replica: a.msg["quota"] for a in out if a.kind == "send"}
        for r in range(R):
            out = proto.on_vote(r, {"gen": 0, "step": 0, "ok": True, "ledger": quotas[r], "loss_sum": 1.0,
                                    "mb_seconds": 0.1}, 0.0)
        return out

    out = benchmark(one_iteration)
    commits = [a for a in out if a.kind == "commit"]
    assert len(commits) == 1 and commits[0].msg["microbatch_ids"] == iteration_ids(0, M)
